"""Paged attention over the device KV cache (pure JAX; runs on CPU, GPU and TPU).

KV cache, one (k, v) pair per layer, head-major token locations:

    k_cache[l] : [num_kv_heads, num_pages * page_size, head_dim]
                               └─ token location = page * page_size + offset; page 0 is the sink:
                                  padded tokens write there and nothing reads it.

Queries come in blocks: every block holds up to `block` consecutive tokens of ONE request
(decode: block = 1; extend/mixed: a request's new tokens padded to a multiple of `block`).

    q          : [NB, block, H, D]      block_pages : [NB, max_pages]  the request's page table
    q_pos      : [NB, block]            committed_len : [NB]  KV tokens valid once this step's are written

Key j of a block's request (j = its position) is visible to query i iff
`j < committed_len` and `j <= q_pos[i]` (and `j > q_pos[i] - window` with a sliding window).
The keys are read `chunk` tokens at a time in a `fori_loop` whose trip count is
`ceil(max(committed_len) / chunk)`, a runtime value: one compiled program serves every context length.
Softmax is the online (flash) form, so the loop keeps only [NB, H, block] statistics.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)

_NEG = -1e30


def write_kv(cache: jax.Array, new: jax.Array, out_loc: jax.Array) -> jax.Array:
    """Scatter new[T, KV, D] into cache[KV, locations, D] at the token locations out_loc[T]
    (in place under donation)."""
    return cache.at[:, out_loc].set(jnp.swapaxes(new, 0, 1).astype(cache.dtype))


def paged_attention(
    q: jax.Array,
    q_pos: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    block_pages: jax.Array,
    committed_len: jax.Array,
    *,
    page_size: int,
    chunk_pages: int,
    scale: float,
    sliding_window: int | None = None,
) -> jax.Array:
    """Attention of blocked queries over their requests' pages. Returns [NB, block, H, D]."""
    nb, blk, h, d = q.shape
    kvh = k_cache.shape[0]
    g = h // kvh
    chunk = chunk_pages * page_size
    max_pages = block_pages.shape[1]
    assert max_pages % chunk_pages == 0, "page table width must be a multiple of chunk_pages"
    k_pages = k_cache.reshape(kvh, -1, page_size, d)
    v_pages = v_cache.reshape(kvh, -1, page_size, d)
    qg = q.reshape(nb, blk, kvh, g, d).astype(jnp.float32) * scale

    def body(c, carry):
        m, denom, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(block_pages, c * chunk_pages, chunk_pages, axis=1)
        k = k_pages[:, pages].reshape(kvh, nb, chunk, d).astype(jnp.float32)
        v = v_pages[:, pages].reshape(kvh, nb, chunk, d).astype(jnp.float32)
        s = jnp.einsum("bqkgd,kbcd->bkgqc", qg, k)  # [NB, KV, G, block, chunk]
        key_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
        visible = (key_pos[None, None, :] < committed_len[:, None, None]) & (
            key_pos[None, None, :] <= q_pos[:, :, None]
        )  # [NB, block, chunk]
        if sliding_window is not None:
            visible &= key_pos[None, None, :] > q_pos[:, :, None] - sliding_window
        visible = visible[:, None, None]
        s = jnp.where(visible, s, _NEG)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        denom = denom * alpha + p.sum(axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("bkgqc,kbcd->bkgqd", p, v)
        return m_new, denom, acc

    n_chunks = (jnp.max(committed_len) + chunk - 1) // chunk
    init = (
        jnp.full((nb, kvh, g, blk), _NEG, jnp.float32),
        jnp.zeros((nb, kvh, g, blk), jnp.float32),
        jnp.zeros((nb, kvh, g, blk, d), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, n_chunks, body, init)
    out = acc / jnp.maximum(denom, 1e-30)[..., None]  # fully masked (padding) rows give 0, not NaN
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(nb, blk, h, d).astype(q.dtype)


def resolve_backend(requested: str, platform: str) -> str:
    """Pick the attention implementation: "native" (this module) or "pallas" (TPU kernel).

    "auto" picks the Pallas ragged paged attention kernel on TPU when this jax ships it and
    ringserve has an adapter for its cache layout; otherwise the pure-JAX path, with a log line
    saying why. Only "native" is implemented today (see README: TPU status).
    """
    if requested not in ("auto", "native", "pallas"):
        raise ValueError(f"attention_backend={requested!r}: choose one of 'auto', 'native', 'pallas'")
    if requested == "native":
        return "native"
    if platform != "tpu":
        if requested == "pallas":
            raise ValueError(f"attention_backend='pallas' needs a TPU; this platform is {platform!r}")
        return "native"
    try:
        import jax.experimental.pallas.ops.tpu.ragged_paged_attention  # noqa: F401

        have_kernel = True
    except ImportError:
        have_kernel = False
    reason = "no ringserve adapter for its KV layout yet" if have_kernel else "this jax does not ship the kernel"
    if requested == "pallas":
        raise ValueError(f"attention_backend='pallas' is unavailable: {reason}")
    log.warning("TPU: using the pure-JAX paged attention, not the Pallas ragged kernel (%s)", reason)
    return "native"

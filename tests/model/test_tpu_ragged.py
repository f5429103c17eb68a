"""ringserve's TPU ragged paged attention kernel (model/compute/attention/tpu_ragged.py, backend
pallas_ragged) in Pallas's TPU interpreter against a dense reference: causal, sliding window and
soft-cap, decode and extend tiles, KV heads replicated over tp. The executor-level check against
the native backend is tests/model/test_attention.py; compiled for each chip: test_tpu_aot.py."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ringserve.model.compute.attention.base import AttnGeometry
from ringserve.model.compute.attention.pallas_ragged import PallasRaggedAttention, kv_layout

PAGE, NUM_PAGES, MAX_PAGES = 16, 40, 12
ROOT = Path(__file__).resolve().parents[2]


def batch(kv_len, new, rows_padded: int, tokens: int, seed: int = 0):
    """A ForwardBatch-like namespace: rows with `new` tokens ending at `kv_len`, padded to
    `rows_padded` rows and `tokens` tokens; page tables of distinct random pages (never page 0)."""
    rng = np.random.default_rng(seed)
    n = len(kv_len)
    kv_len = np.array(list(kv_len) + [0] * (rows_padded - n), np.int32)
    new = list(new) + [0] * (rows_padded - n)
    row_start = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    pages = rng.permutation(np.arange(1, NUM_PAGES))
    tables = np.zeros((rows_padded, MAX_PAGES), np.int32)
    for r in range(n):
        need = -(-int(kv_len[r]) // PAGE)
        tables[r, :need] = pages[:need]
        pages = pages[need:]
    pos = np.concatenate([np.arange(kv_len[r] - new[r], kv_len[r]) for r in range(n)]).astype(np.int32)
    out_loc = np.zeros(tokens, np.int32)
    for t, (r, p) in enumerate(zip(np.repeat(np.arange(n), new[:n]), pos, strict=True)):
        out_loc[t] = tables[r, p // PAGE] * PAGE + p % PAGE
    return types.SimpleNamespace(
        row_start=jnp.asarray(row_start), kv_len=jnp.asarray(kv_len), num_rows=jnp.asarray([n], jnp.int32),
        pages=jnp.asarray(tables), out_loc=jnp.asarray(out_loc), positions=pos, real=len(pos), local_pages=None,
        local_out_loc=None,
    )  # fmt: skip


def reference(q, keys, vals, fb, geo, soft_cap):
    """Dense attention per row over its keys 0..kv_len-1 (keys/vals [R][len, Hkv, D])."""
    out = np.zeros_like(q)
    rs = np.asarray(fb.row_start)
    for r in range(int(fb.num_rows[0])):
        kl = int(fb.kv_len[r])
        for t in range(rs[r], rs[r + 1]):
            pos = kl - (rs[r + 1] - t)
            for h in range(geo.num_heads):
                kh = h // geo.group
                s = keys[r][:kl, kh] @ q[t, h] * geo.scale
                if soft_cap:
                    s = soft_cap * np.tanh(s / soft_cap)
                j = np.arange(kl)
                vis = j <= pos
                if geo.windows:
                    vis &= j > pos - geo.windows[0]
                s = np.where(vis, s, -np.inf)
                p = np.exp(s - s.max())
                out[t, h] = (p / p.sum()) @ vals[r][:kl, kh]
    return out


CASES = {  # (kv_len, new tokens) per row, padded rows, padded tokens
    "decode": ([37, 16, 1, 150], [1, 1, 1, 1], 6, 6),
    "extend": ([70, 21, 33, 150], [40, 21, 1, 3], 6, 80),
}


def check(case: str, window: int | None, soft_cap: float | None, heads: tuple[int, int] = (6, 3), tp: int = 1) -> None:
    """The backend's write then attend on CASES[case] (`heads` = (query heads, KV heads), over a
    `tp` mesh of this process's devices) against `reference`; rows past the last token 0."""
    kv_len, new, rows, tokens = CASES[case]
    hq, hkv = heads
    geo = AttnGeometry(num_layers=2, num_pages=NUM_PAGES, page_size=PAGE, num_heads=hq, num_kv_heads=hkv, head_dim=64,
                       max_pages=MAX_PAGES, dtype=jnp.float32, windows=None if window is None else (window, window))  # fmt: skip
    mesh = jax.make_mesh((tp,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,)) if tp > 1 else None
    attn = PallasRaggedAttention(geo, interpret=True, tp=tp, mesh=mesh, soft_cap=soft_cap)
    fb = batch(kv_len, new, rows, tokens)
    rng = np.random.default_rng(1)
    # the rows' whole K/V: the earlier tokens put straight into layer 1's pages, the new ones by `write`
    keys = [rng.normal(size=(max(kv_len), hkv, 64)).astype(np.float32) for _ in kv_len]
    vals = [rng.normal(size=(max(kv_len), hkv, 64)).astype(np.float32) for _ in kv_len]
    cache = np.full(attn.kv_avals()[0].shape, np.nan, np.float32)  # unwritten: NaN, which must never leak
    tables = np.asarray(fb.pages)
    for r, kl in enumerate(kv_len):
        for p in range(kl - new[r]):
            kvp = np.concatenate([keys[r][p], vals[r][p]], -1)
            cache[NUM_PAGES + tables[r, p // PAGE], :, p % PAGE] = np.repeat(kvp, attn.copies, axis=0)
    k_new = np.concatenate([keys[r][kl - n : kl] for r, (kl, n) in enumerate(zip(kv_len, new, strict=True))])
    v_new = np.concatenate([vals[r][kl - n : kl] for r, (kl, n) in enumerate(zip(kv_len, new, strict=True))])
    pad = tokens - len(k_new)
    k_new, v_new = (np.concatenate([x, np.zeros((pad, hkv, 64), np.float32)]) for x in (k_new, v_new))
    q = rng.normal(size=(tokens, hq, 64)).astype(np.float32)
    layer = jnp.int32(1)

    @jax.jit
    def step(q, cache, k, v):
        kv = attn.write((cache,), layer, k, v, fb)
        return attn.attend(q, kv, layer, fb)

    got = np.asarray(step(jnp.asarray(q), jnp.asarray(cache), jnp.asarray(k_new), jnp.asarray(v_new)))
    want = reference(q, keys, vals, fb, geo, soft_cap)
    n = fb.real
    np.testing.assert_allclose(got[:n], want[:n], atol=2e-5, rtol=2e-5)
    assert (got[n:] == 0).all()


@pytest.mark.parametrize("case,window,soft_cap", [("decode", None, None), ("extend", None, None), ("extend", 24, None),
                                                  ("extend", None, 5.0)])  # fmt: skip
def test_kernel_matches_dense(case, window, soft_cap):
    check(case, window, soft_cap)


def write_collectives(tp: int) -> list[str]:
    """The collectives in the compiled program of the backend's write alone over a `tp` mesh (4
    query heads, 2 KV heads stored tp / 2 times): none, each device scatters into its own shard
    (a flattening reshape of the head-split cache all-gathered the whole pool: Qwen3-30B-A3B on
    v6e:2x4, 172 GB of temporaries)."""
    from jax.sharding import NamedSharding

    geo = AttnGeometry(num_layers=2, num_pages=NUM_PAGES, page_size=PAGE, num_heads=4, num_kv_heads=2, head_dim=64,
                       max_pages=MAX_PAGES, dtype=jnp.float32, windows=None)  # fmt: skip
    mesh = jax.make_mesh((tp,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    attn = PallasRaggedAttention(geo, interpret=True, tp=tp, mesh=mesh)
    fb = batch(*CASES["decode"])
    aval = attn.kv_avals()[0]
    cache = jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=NamedSharding(mesh, attn.kv_specs(tp)[0]))
    k = jax.ShapeDtypeStruct((CASES["decode"][3], 2, 64), jnp.float32)
    write = jax.jit(lambda c, k, v: attn.write((c,), jnp.int32(1), k, v, fb)[0])
    text = write.lower(cache, k, k).compile().as_text() or ""
    return [c for c in ("all-gather", "all-reduce", "all-to-all", "collective-permute") if c in text]


TP_SCRIPT = """
from tests.model.test_tpu_ragged import check, write_collectives
check("decode", 24, None, heads=(4, 2), tp=4)  # each KV head stored on the 2 devices of its query heads
assert write_collectives(4) == [], write_collectives(4)
print("ok")
"""


def test_kv_heads_replicated_over_tp():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", TP_SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_kv_layout():
    assert kv_layout(8, 32, 4) == (4, 1)  # split
    assert kv_layout(2, 32, 8) == (8, 4)  # each KV head on the 4 devices of its query heads
    assert kv_layout(3, 9, 2) == (1, 1)  # neither: every device runs all heads

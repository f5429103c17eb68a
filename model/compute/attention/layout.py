"""What the KV cache of one token costs in each backend's own layout, without JAX: the frontend
sizes the pool with it before any actor starts (actors/transport/memory.py), the launcher weighs
the TPU kernels with it (actors/cli/launch_plan.py), and the TPU backends lay their caches by the
same rules (pallas_tpu.py, pallas_ragged.py), so the sizing and the arrays cannot disagree.

    backend        stored per token and layer                           SmolLM2 (3 KV x 64, tp 1)
    (the rest)     K and V: Hkv x head_dim each                         2 x 3 x 64      = 384
    pallas         jax's kernel: a device's KV heads padded to what it   2 x 4 x 128     = 1024
                   tiles (K and V interleaved), head_dim to 128 lanes    (2.67x)
    pallas_ragged  ringserve's: K|V side by side on 2 x head_dim lanes,  3 x 128         = 384
                   KV heads fewer than tp copied to their query heads'
                   devices (SGLang's replication)
"""

from __future__ import annotations

from ringserve.model.compute.platform import platform_of

TPU_LANES = 128


def _tiles(n: int, packing: int) -> bool:
    """Whether jax's kernel tiles `n` K+V heads of `packing` values per 32-bit word."""
    if n % packing:
        return False
    n //= packing
    return n in (1, 2, 4, 8) or n % 8 == 0


def padded_kv_heads(kv_heads: int, itemsize: int) -> int:
    """jax's kernel: the fewest KV heads >= kv_heads whose K+V head count it tiles."""
    packing = 4 // itemsize  # values per 32-bit word
    h = kv_heads
    while not _tiles(2 * h, packing):
        h += 1
    return h


def ragged_kv_layout(num_kv_heads: int, num_heads: int, tp: int) -> tuple[int, int]:
    """ringserve's kernel: (tp the heads split over, copies of each KV head): split where tp
    divides the KV heads; copied where tp is a multiple of them and divides the query heads;
    else every device holds every head (tp 1)."""
    if num_kv_heads % tp == 0:
        return tp, 1
    if tp % num_kv_heads == 0 and num_heads % tp == 0:
        return tp, tp // num_kv_heads
    return 1, 1


def kv_token_bytes(backend: str, platform: str, *, num_layers: int, num_kv_heads: int, num_heads: int, head_dim: int,
                   tp: int, itemsize: int) -> int:  # fmt: skip
    """Cache bytes one token holds over every layer and every device of a group together, in the
    layout of `backend` ("auto": the first registered backend `auto` names for the platform, as
    the plan picks where it runs; model/compute/plan.py `resolve_backend`)."""
    if backend == "auto":
        from ringserve.model.compute.attention import REGISTRY

        backend = next((b.name for b in REGISTRY.values() if platform_of(platform) in b.auto), "native")
    if backend == "pallas":
        split = tp if num_kv_heads % tp == 0 else 1
        heads = split * padded_kv_heads(num_kv_heads // split, itemsize)
        lanes = 2 * -(-head_dim // TPU_LANES) * TPU_LANES
    elif backend == "pallas_ragged":
        _, copies = ragged_kv_layout(num_kv_heads, num_heads, tp)
        heads, lanes = num_kv_heads * copies, 2 * head_dim
    else:
        heads, lanes = num_kv_heads, 2 * head_dim
    return num_layers * heads * lanes * itemsize

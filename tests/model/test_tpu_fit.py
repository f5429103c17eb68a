"""TPU attention's VMEM fit (model/compute/attention/tpu_fit.py): the limit per chip, the blocks,
and the error that names the budget. Pure arithmetic, no TPU: tests/model/test_tpu_aot.py
compiles the kernel with these choices for each chip."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from ringserve.model.compute.attention import tpu_fit
from ringserve.model.compute.attention.base import AttnGeometry
from ringserve.model.compute.attention.pallas_tpu import PallasTPUAttention

MiB = tpu_fit.MiB
V5E, V6E, V5P, V4 = (tpu_fit.chip_of(k) for k in ("TPU v5 lite", "TPU v6 lite", "TPU v5", "TPU v4"))


def smollm2(page: int = 64, context: int = 4096) -> AttnGeometry:
    """SmolLM2-135M's attention at the launcher's settings (tools/launch_tpu.sh)."""
    return AttnGeometry(num_layers=30, num_pages=2049, page_size=page, num_heads=9, num_kv_heads=3, head_dim=64,
                        max_pages=context // page, dtype=jnp.bfloat16)  # fmt: skip


def test_limits_per_chip():
    assert [c.vmem_limit // MiB for c in (V5E, V6E, V5P, V4)] == [64, 64, 32, 16]


def test_estimate_matches_what_mosaic_reported():
    # the tiny model's decode-2 program with jax's fallback block (the whole 64-page table):
    # Mosaic reported a scoped allocation of 16.19M against its 16.00M default (issue 65)
    tiny = tpu_fit.KernelShape(q_heads=8, kv_heads=4, head_dim=128, page_size=64, pages_per_seq=64, tokens=2)
    assert 16.0 * MiB < tpu_fit.vmem_bytes(tiny, tpu_fit.Blocks(64, 2, 0)) < 16.3 * MiB


def test_launcher_config_gets_the_measured_blocks_on_v5e():
    attn = PallasTPUAttention(smollm2(), chip="TPU v5 lite")
    for tokens in (2, 256, 4096):
        b = attn.blocks(tokens)
        assert (b.kv_pages, b.queries, b.vmem_limit) == (16, min(32, tokens), 64 * MiB)
        assert tpu_fit.vmem_bytes(attn.kernel_shape(tokens), b) < 8 * MiB


@pytest.mark.parametrize("chip", [V6E, V5P, V4], ids=lambda c: c.name)
def test_heuristic_fits_each_chip(chip):
    # Llama-3-8B at tp 1: 32 query / 8 KV heads of 128, page 16, context 4096
    s = tpu_fit.KernelShape(q_heads=32, kv_heads=8, head_dim=128, page_size=16, pages_per_seq=256, tokens=4096)
    b = tpu_fit.choose(chip, s)
    assert b.kv_pages * 16 == tpu_fit.KV_KEYS and b.queries == 32  # the defaults fit every chip here
    assert tpu_fit.vmem_bytes(s, b) <= tpu_fit.FIT * chip.vmem_limit


def test_blocks_shrink_to_the_budget():
    # wide heads and big pages on v4: the default 1024-token block must halve until it fits
    s = tpu_fit.KernelShape(q_heads=16, kv_heads=8, head_dim=256, page_size=256, pages_per_seq=16, tokens=512)
    b = tpu_fit.choose(V4, s)
    assert b.kv_pages < tpu_fit.KV_KEYS // 256
    assert tpu_fit.vmem_bytes(s, b) <= tpu_fit.FIT * V4.vmem_limit
    assert tpu_fit.vmem_bytes(s, tpu_fit.Blocks(b.kv_pages * 2, b.queries, 0)) > tpu_fit.FIT * V4.vmem_limit


def test_nothing_fits_names_the_budget():
    s = tpu_fit.KernelShape(q_heads=64, kv_heads=32, head_dim=256, page_size=1024, pages_per_seq=4, tokens=4096)
    with pytest.raises(ValueError, match=r"v4's VMEM.*1 page of 1024 tokens x 8 queries.*16 MiB scoped limit"):
        tpu_fit.choose(V4, s)


def test_unknown_chip():
    with pytest.raises(ValueError, match="unknown chip 'cpu'"):
        PallasTPUAttention(smollm2(), chip="cpu")
    PallasTPUAttention(smollm2(), interpret=True)  # the interpreter needs no chip

"""The native backend's host plan: every (tile, key chunk) item runs exactly once, lanes are
balanced (split: ceil(items / lanes) steps), segments are runs of one tile's consecutive chunks
on one lane, and the deterministic mode keeps each tile whole on one lane. The numbers the
plan feeds (the combine of split tiles) are checked against the other backends and HF in
test_hf_parity.py and test_attention.py."""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest

from ringserve.model.compute.attention.base import AttnGeometry, StepShape
from ringserve.model.compute.attention.native import NativeAttention
from ringserve.model.compute.attention.tiles import cdiv, num_tiles

PAGE, CHUNK, BLOCK = 16, 64, 16


def geometry(deterministic: bool) -> AttnGeometry:
    return AttnGeometry(num_layers=2, num_pages=2048, page_size=PAGE, num_heads=8, num_kv_heads=4, head_dim=32,
                        max_pages=4352 // PAGE, dtype=jnp.float32, deterministic=deterministic)  # fmt: skip


def batch(ext: list[int], kv_len: list[int], rows: int):
    start = np.zeros(rows + 1, np.int32)
    start[1 : len(ext) + 1] = np.cumsum(ext)
    start[len(ext) + 1 :] = start[len(ext)]
    kv = np.zeros(rows, np.int32)
    kv[: len(kv_len)] = kv_len
    return types.SimpleNamespace(num_rows=np.array([len(ext)], np.int32), row_start=start, kv_len=kv)


CASES = {  # name: (new tokens per row, kv_len per row)
    "chunk_beside_decoders": ([64] + [1] * 32, [4096] + [100 + 7 * i for i in range(32)]),
    "one_long_decode": ([1], [2048]),
    "uneven_prefills": ([200, 5, 37], [200, 5, 1037]),
    "decode_batch": ([1] * 40, [16 + 50 * i for i in range(40)]),
}


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_plan_runs_every_item_once_in_segments(case, deterministic):
    ext, kv_len = CASES[case]
    decode = all(e == 1 for e in ext)
    rows = max(8, len(ext))
    shape = StepShape(block=1 if decode else BLOCK, tokens=rows if decode else cdiv(sum(ext), 64) * 64, rows=rows)
    be = NativeAttention(geometry(deterministic), chunk_tokens=CHUNK)
    p = be.plan(batch(ext, kv_len, rows), shape)
    for name, aval in be.plan_avals(shape).items():
        assert p[name].shape == aval.shape and p[name].dtype == aval.dtype, name

    nt_max, ns = num_tiles(shape), p["seg_tile"].shape[0] - 1
    real = p["item_tile"] < nt_max
    assert not real[p["num_steps"] :].any()
    # every real tile's chunks 0 .. ceil(keys / chunk) - 1, each exactly once
    keys = {}
    for t in range(nt_max):
        pos = p["tile_pos"][t]
        if (pos >= 0).any():
            keys[t] = int(pos.max()) + 1
    want = sorted((t, c) for t, k in keys.items() for c in range(cdiv(k, CHUNK)))
    got = sorted(zip(p["item_tile"][real].tolist(), p["item_chunk"][real].tolist(), strict=True))
    assert got == want
    lanes = p["item_tile"].shape[1]
    if deterministic:
        assert lanes == (be.decode_lanes if decode else be.extend_lanes)
    else:
        assert p["num_steps"] == cdiv(len(want), lanes), "split plans are balanced to one item"

    # segments: a lane's run of one tile's consecutive chunks, first..last, each with its own id
    seen = set()
    for lane in range(lanes):
        run = None
        for s in range(int(p["num_steps"])):
            if not real[s, lane]:
                assert run is None
                continue
            tile, chunk, seg = (int(p[k][s, lane]) for k in ("item_tile", "item_chunk", "item_seg"))
            if p["item_first"][s, lane]:
                assert run is None and seg not in seen and seg < ns
                seen.add(seg)
                run = (tile, chunk, seg)
            else:
                assert run is not None and run[0] == tile and run[2] == seg and chunk == run[1] + 1
                run = (tile, chunk, seg)
            assert p["seg_tile"][seg] == tile
            if p["item_last"][s, lane]:
                run = None
        assert run is None, "a segment must end (write its state) before the lane does"
    per_tile = np.bincount(p["seg_tile"][sorted(seen)], minlength=nt_max)
    if deterministic:
        assert (per_tile[list(keys)] == 1).all(), "deterministic: one segment (one lane) per tile"
    assert len(seen) <= be.max_segments(shape)
    assert (p["seg_tile"][[i for i in range(ns + 1) if i not in seen]] == nt_max).all()

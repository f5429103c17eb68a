"""The small-M matmul custom call (model/compute/kernels/cpu_matmul.py) against numpy in f32: every x
dtype x weight dtype x layout, row counts around the kernel's 4-row blocks, shapes that are
not multiples of its 16-lane vectors or 64-column tiles, and SmolLM2's. Skips with the reason
where the kernel does not build."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ringserve.model.compute.kernels import cpu_matmul

pytestmark = pytest.mark.skipif(cpu_matmul.reason() is not None, reason=f"cpu_matmul: {cpu_matmul.reason()}")

# (K, N): odd (not 16- or 64-multiples), SmolLM2's gate/up, short and wide
SHAPES = [(71, 200), (576, 1536), (40, 2100)]


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _weights(rng, k: int, n: int, wdtype: str):
    """(w as stored [K, N], scale or None, the f32 weights the product means)."""
    if wdtype == "int8":
        q = rng.integers(-127, 128, (k, n)).astype(np.int8)
        scale = (rng.random(n) * 0.02 + 0.001).astype(np.float32)
        return jnp.asarray(q), jnp.asarray(scale), q.astype(np.float32) * scale
    w = jnp.asarray(rng.standard_normal((k, n)), wdtype)
    return w, None, np.asarray(w, np.float32)


@pytest.fixture(scope="module")
def calls():
    """One jitted call per (layout, out dtype): retraced per shape, never rebuilt per test."""
    return {
        (t, od): jax.jit(lambda x, w, s, t=t, od=od: cpu_matmul.matmul(x, w, transpose_w=t, scale=s, out_dtype=od))
        for t in (False, True)
        for od in (jnp.float32, None)
    }


@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("wdtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("xdtype", ["float32", "bfloat16"])
def test_matches_numpy_in_both_layouts_for_every_dtype(calls, xdtype, wdtype, k, n):
    rng = np.random.default_rng(k + n)
    w, scale, wf = _weights(rng, k, n, wdtype)
    wt = jnp.asarray(np.asarray(w).T.copy())  # [N, K]
    for m in (1, 3, 4, 5, 17):
        x = jnp.asarray(rng.standard_normal((m, k)), xdtype)
        want = np.asarray(x, np.float32) @ wf  # the same (rounded) inputs, in f32
        for t, wl in ((False, w), (True, wt)):
            got = calls[(t, jnp.float32)](x, wl, scale)
            assert got.shape == (m, n) and got.dtype == jnp.float32
            assert _rel_err(got, want) < 1e-5, (m, t)  # f32 sums either way
            same = calls[(t, None)](x, wl, scale)  # x's dtype out
            assert same.dtype == jnp.dtype(xdtype)
            assert _rel_err(same, want) < (8e-3 if xdtype == "bfloat16" else 1e-5), (m, t)


@pytest.mark.parametrize("wdtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("xdtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("transpose", [False, True])
def test_grouped_call_gives_each_single_calls_bits(xdtype, wdtype, transpose):
    """`matmuls` (one call for the weights that share x: q/k/v, gate/up) returns, bit for bit,
    what a call per weight returns: 1 and 4 rows, uneven N, both out dtypes."""
    rng = np.random.default_rng(7)
    k, ns = 200, (576, 72, 71)  # a [K, N] weight of 576 columns splits into several row blocks
    made = [_weights(rng, k, n, wdtype) for n in ns]
    ws = [jnp.asarray(np.asarray(w).T.copy()) if transpose else w for w, _, _ in made]
    scales = None if wdtype != "int8" else [s for _, s, _ in made]
    for m in (1, 4):
        x = jnp.asarray(rng.standard_normal((m, k)), xdtype)
        for od in (jnp.float32, None):
            group = jax.jit(lambda x, ws, ss, od=od: cpu_matmul.matmuls(x, ws, transpose_w=transpose, scales=ss,
                                                                        out_dtype=od))(x, ws, scales)  # fmt: skip
            for g, w in enumerate(ws):
                s = None if scales is None else scales[g]
                one = cpu_matmul.matmul(x, w, transpose_w=transpose, scale=s, out_dtype=od)
                assert group[g].shape == one.shape and group[g].dtype == one.dtype
                np.testing.assert_array_equal(np.asarray(group[g]), np.asarray(one), err_msg=f"{m} {od} {g}")


def test_project_is_one_call_for_the_kernel_and_per_linear_otherwise():
    """layers.project: one custom call for q/k/v-like projections on the kernel dot (biases added
    after), the same values as each Linear alone; XLA's dot or too many rows: one dot each."""
    from ringserve.model.compute.dots import Dot
    from ringserve.model.layers.linear import Linear, project

    lins = [Linear(64, n, jnp.float32, bias=True, dot=Dot("kernel")) for n in (64, 32, 32)]
    rng = np.random.default_rng(9)
    for lin in lins:
        lin.weight[...] = jnp.asarray(rng.standard_normal(lin.weight.shape), jnp.float32)
        lin.bias[...] = jnp.asarray(rng.standard_normal(lin.bias.shape), jnp.float32)
    from ringserve.model.compute.dots import kernel_rows

    for rows, calls in ((1, 1), (kernel_rows("float32") + 1, 0)):  # f32 takes the kernel up to kernel_rows
        x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32)
        text = jax.jit(lambda x: project(x, *lins)).lower(x).as_text()
        assert text.count("ringserve_cpu_matmul") == calls, rows
        for got, lin in zip(project(x, *lins), lins, strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(lin(x)))


@pytest.mark.parametrize("wdtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("transpose", [False, True])
def test_stacked_weights_give_the_layers_own_bits(wdtype, transpose):
    """Weights stacked over layers ([L, K, N] / [L, N, K], scales [L, N]) and a traced layer
    index (the layers' scan): the bits of a call on that layer's own weights, grouped or not,
    for every layer (the last one too: the offsets stay inside the stack)."""
    rng = np.random.default_rng(13)
    k, ns, layers = 96, (80, 24), 3
    made = [[_weights(rng, k, n, wdtype) for _ in range(layers)] for n in ns]  # [weight][layer]
    lay = (lambda w: jnp.asarray(np.asarray(w).T.copy())) if transpose else (lambda w: w)
    stacks = [jnp.stack([lay(w) for w, _, _ in per]) for per in made]
    scales = None if wdtype != "int8" else [jnp.stack([s for _, s, _ in per]) for per in made]
    run = jax.jit(lambda x, ws, ss, li: cpu_matmul.matmuls(x, ws, transpose_w=transpose, scales=ss, layer=li))
    for m in (1, 5):
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        for li in range(layers):
            got = run(x, stacks, scales, jnp.int32(li))
            for g, per in enumerate(made):
                w, s, _ = per[li]
                one = cpu_matmul.matmul(x, lay(w), transpose_w=transpose, scale=s)
                np.testing.assert_array_equal(np.asarray(got[g]), np.asarray(one), err_msg=f"{m} {li} {g}")
    with pytest.raises(Exception, match="layer out of the stack's range"):
        jax.block_until_ready(run(x, stacks, scales, jnp.int32(layers)))


def test_project_multiplies_a_stacked_weight_as_the_layers_on_either_dot():
    """layers.project on weights stacked over layers (the CPU scan's view): the kernel reads
    layer li in place (one call, no slice); past the kernel's rows XLA's dot gets the slice;
    both give what the layer's own Linear gives."""
    from ringserve.model.compute.dots import Dot, kernel_rows
    from ringserve.model.layers.linear import Linear, project

    rng = np.random.default_rng(17)
    per_layer = [[Linear(64, n, jnp.float32, dot=Dot("kernel")) for n in (48, 16)] for _ in range(2)]
    for lins in per_layer:
        for lin in lins:
            lin.weight[...] = jnp.asarray(rng.standard_normal(lin.weight.shape), jnp.float32)
    stacked = [Linear(64, n, jnp.float32, dot=Dot("kernel")) for n in (48, 16)]
    for g, lin in enumerate(stacked):
        lin.weight = nnx_param(jnp.stack([lins[g].weight[...] for lins in per_layer]))
    for rows, calls in ((1, 1), (kernel_rows("float32") + 1, 0)):
        x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32)
        for li in range(2):
            text = jax.jit(lambda x, li: project(x, *stacked, layer=li)).lower(x, jnp.int32(li)).as_text()
            assert text.count("ringserve_cpu_matmul") == calls, rows
            got = project(x, *stacked, layer=jnp.int32(li))
            for y, lin in zip(got, per_layer[li], strict=True):
                np.testing.assert_array_equal(np.asarray(y), np.asarray(lin(x)), err_msg=f"{rows} {li}")


def nnx_param(value):
    from flax import nnx

    return nnx.Param(value)


def test_bf16_out_rounds_to_nearest_even_like_jax():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 200)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((200, 72)), jnp.float32)
    f32 = cpu_matmul.matmul(x, w, out_dtype=jnp.float32)
    b16 = cpu_matmul.matmul(x, w, out_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(b16), np.asarray(f32.astype(jnp.bfloat16)))


def test_leading_axes_are_rows():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 48)), jnp.float32)
    got = jax.jit(cpu_matmul.matmul)(x, w)
    assert got.shape == (2, 3, 48)
    assert _rel_err(got, np.asarray(x) @ np.asarray(w)) < 1e-5


@pytest.mark.parametrize("shape_x, shape_w", [((0, 64), (64, 48)), ((3, 64), (64, 0)), ((3, 0), (0, 48))])
def test_empty_operands_give_empty_or_zero_results(shape_x, shape_w):
    x, w = jnp.zeros(shape_x, jnp.float32), jnp.ones(shape_w, jnp.float32)
    got = cpu_matmul.matmul(x, w)
    assert got.shape == (shape_x[0], shape_w[1])
    np.testing.assert_array_equal(np.asarray(got), 0.0)


def test_wrong_dtypes_are_refused_by_name():
    x, w = jnp.ones((2, 8), jnp.float32), jnp.ones((8, 4), jnp.int8)
    with pytest.raises(Exception, match="cpu_matmul: w must be f32 or bf16"):
        jax.block_until_ready(cpu_matmul.matmul(x, w))
    with pytest.raises(Exception, match="cpu_matmul: x and y must be f32 or bf16"):
        jax.block_until_ready(cpu_matmul.matmul(x.astype(jnp.float16), w.astype(jnp.float32)))
    with pytest.raises(RuntimeError, match="multiplies float32, bfloat16 or int8 weights, not float16"):
        cpu_matmul.matmul(x, w.astype(jnp.float16))  # no library for them: refused as it is traced
    with pytest.raises(ValueError, match=r"share a dtype, got \['bfloat16', 'float32'\]"):
        cpu_matmul.matmuls(x, [w.astype(jnp.float32), w.astype(jnp.bfloat16)])


@pytest.mark.parametrize("wdtype", ["float32", "bfloat16", "int8"])
def test_a_row_has_the_same_bits_in_any_call_of_more_than_six_rows(calls, wdtype):
    """Above 6 rows a result is summed the same way whatever rows share the call: tiles read in
    place by blocks of 4 rows (AVX-512), or widened into a panel read by blocks of 6 (AVX2),
    each result one sum along K in order."""
    rng = np.random.default_rng(11)
    w, scale, _ = _weights(rng, 576, 200, wdtype)
    wt = jnp.asarray(np.asarray(w).T.copy())
    x = jnp.asarray(rng.standard_normal((64, 576)), jnp.float32)
    for t, wl in ((False, w), (True, wt)):
        many = np.asarray(calls[(t, jnp.float32)](x, wl, scale))
        for lo, hi in ((0, 7), (7, 20), (57, 64)):
            few = np.asarray(calls[(t, jnp.float32)](x[lo:hi], wl, scale))
            np.testing.assert_array_equal(many[lo:hi], few, err_msg=f"{wdtype} transpose_w={t} rows {lo}:{hi}")


def test_same_sums_on_one_thread_as_on_all():
    """The columns are dealt to threads, never split along K: one thread (a fresh process with
    RINGSERVE_MATMUL_THREADS=1) gives the bits this process gives with the variable unset."""
    code = (
        "import numpy as np, jax.numpy as jnp\n"
        "from ringserve.model.compute.kernels import cpu_matmul\n"
        "assert cpu_matmul.reason() is None\n"
        "r = np.random.default_rng(3)\n"
        "x = jnp.asarray(r.standard_normal((3, 576)), jnp.float32)\n"
        "w = jnp.asarray(r.standard_normal((576, 1536)), jnp.bfloat16)\n"
        "y = cpu_matmul.matmul(x, w) + cpu_matmul.matmul(x, w.T, transpose_w=True)\n"
        "print(np.asarray(y).tobytes().hex())\n"
    )  # fmt: skip
    assert "RINGSERVE_MATMUL_THREADS" not in os.environ
    env = {**os.environ, "RINGSERVE_MATMUL_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    r = np.random.default_rng(3)
    x = jnp.asarray(r.standard_normal((3, 576)), jnp.float32)
    w = jnp.asarray(r.standard_normal((576, 1536)), jnp.bfloat16)
    here = cpu_matmul.matmul(x, w) + cpu_matmul.matmul(x, w.T, transpose_w=True)
    assert out.stdout.strip() == np.asarray(here).tobytes().hex()


def test_the_plain_loops_without_avx512_agree():
    """The portable build (no -march: plain loops, no AVX-512) under test-only target names."""
    from ringserve.model.compute.kernels.build import loader

    plain = loader("cpu_matmul", ["-O2", "-mno-avx512f"], {"ringserve_cpu_matmul_plain": "RingserveCpuMatmul"})
    assert plain() is None
    rng = np.random.default_rng(5)
    for wdtype in ("float32", "bfloat16", "int8"):
        w, scale, wf = _weights(rng, 72, 200, wdtype)
        for m in (1, 5):
            x = jnp.asarray(rng.standard_normal((m, 72)), jnp.bfloat16)
            want = np.asarray(x, np.float32) @ wf
            for t, wl in ((False, w), (True, jnp.asarray(np.asarray(w).T.copy()))):
                out = jax.ShapeDtypeStruct((m, 200), jnp.float32)
                ops = (x, wl) if scale is None else (x, wl, scale)
                got = jax.ffi.ffi_call("ringserve_cpu_matmul_plain", out)(*ops, transpose_w=t)
                assert _rel_err(got, want) < 1e-5, (wdtype, m, t)


@pytest.mark.parametrize("m, k", [(1, 1536), (2, 1568), (3, 1536), (4, 1568), (7, 1536), (64, 1568)])
def test_int8_weights_times_bf16_rows_through_int16(m, k):
    """bf16 x with int8 [N, K] weights up to 64 rows (cpu_matmul.cc nk_seq_q16 wherever AVX2 or
    AVX-512 builds it; blocks of 4 rows and a shorter last one; K a whole number of 64 or one 32
    more): x becomes int16 per row at a step of 2^-15 of the power of two above the row's largest
    magnitude, so each value within 2^7 of it is exact and a smaller one is off by at most half
    a step; the sums are exact. Against float64 on the same bf16 inputs, the error stays inside
    that rounding's bound (a row holding one value 400x its others' scale), a row of zeros gives
    zeros and a NaN in x gives NaN, as the f32 path does. Where the vectors are built the int16
    path is the one that ran: a value below half a step counts for nothing."""
    rng = np.random.default_rng(11)
    n = 200
    q = rng.integers(-128, 128, (n, k)).astype(np.int8)  # [N, K]; -128 too, as a GGUF Q8_0 block holds
    scale = (rng.random(n) * 0.02 + 0.001).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, 5] = 400.0
    xb = jnp.asarray(x, jnp.bfloat16)
    xf = np.asarray(xb, np.float64)
    call = jax.jit(lambda x, w, s: cpu_matmul.matmul(x, w, transpose_w=True, scale=s, out_dtype=jnp.float32))
    got = np.asarray(call(xb, jnp.asarray(q), jnp.asarray(scale)), np.float64)
    want = (xf @ q.T.astype(np.float64)) * scale
    step = np.exp2(np.floor(np.log2(np.abs(xf).max(axis=1))) + 1 - 15)  # per row
    bound = (step / 2)[:, None] * (np.abs(q).sum(axis=1) * scale)[None, :]  # every value off by half a step
    bound += 1e-6 * np.abs(want)  # f32 conversions at the end
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) / bound))
    exact_rows = np.where(np.abs(xf) >= np.abs(xf).max(axis=1, keepdims=True) / 128, xf, 0.0)
    got_exact = np.asarray(call(jnp.asarray(exact_rows, jnp.bfloat16), jnp.asarray(q), jnp.asarray(scale)), np.float64)
    want_exact = (exact_rows @ q.T.astype(np.float64)) * scale
    np.testing.assert_allclose(got_exact, want_exact, rtol=2e-6, atol=1e-6 * np.abs(want_exact).max())
    zeros = call(jnp.zeros((m, k), jnp.bfloat16), jnp.asarray(q), jnp.asarray(scale))
    assert not np.any(np.asarray(zeros))
    if cpu_matmul.lanes("int8") > 1:
        tiny = np.full((m, k), 2.0**-10, np.float32)  # below half of row 0's step (2^-6)
        tiny[:, 3] = 400.0
        ones = np.ones((n, k), np.int8)
        got_tiny = np.asarray(call(jnp.asarray(tiny, jnp.bfloat16), jnp.asarray(ones), jnp.ones(n, jnp.float32)))
        np.testing.assert_array_equal(got_tiny, 400.0)
    x[m - 1, 7] = np.nan
    assert np.all(np.isnan(np.asarray(call(jnp.asarray(x, jnp.bfloat16), jnp.asarray(q), jnp.asarray(scale)))[m - 1]))


needs_pairs = pytest.mark.skipif(not cpu_matmul.packs_pairs(), reason="the kernel reads packed pairs on AVX512-BF16 only")


@needs_pairs
@pytest.mark.parametrize("k, n", [(576, 1536), (577, 100), (64, 2100)])
@pytest.mark.parametrize("transpose_w", [False, True])
def test_a_registered_bf16_weight_is_read_from_packed_pairs(k, n, transpose_w):
    """A registered bf16 weight (either layout; K odd or even, N past a whole 64-column tile) is
    packed in pairs along K on its first call (pairs.h) and multiplies from the copy at every row
    count to f32 rounding of float64 on the same inputs; a row's bits do not depend on the other
    rows of its call; a NaN in x reaches only its row; a release frees the copy and the plain
    weight is read again, to the same tolerance."""
    rng = np.random.default_rng(k + n)
    w = jnp.asarray(rng.standard_normal((n, k) if transpose_w else (k, n)), jnp.bfloat16)
    wf = np.asarray(w, np.float64).T if transpose_w else np.asarray(w, np.float64)
    call = jax.jit(lambda x, w: cpu_matmul.matmul(x, w, transpose_w=transpose_w, out_dtype=jnp.float32))
    x = jnp.asarray(rng.standard_normal((70, k)), jnp.bfloat16)
    owner = cpu_matmul.register_weights([w])
    try:
        assert cpu_matmul.packed_bytes(owner) == 0  # packed on first use
        whole = np.asarray(call(x, w))
        assert cpu_matmul.packed_bytes(owner) == (n + 63) // 64 * 64 * ((k + 1) // 2) * 4
        assert _rel_err(whole, np.asarray(x, np.float64) @ wf) < 1e-5
        for m in (1, 2, 3, 4, 5, 9, 64):
            np.testing.assert_array_equal(np.asarray(call(x[:m], w)), whole[:m])
        xn = x.at[3, 7].set(jnp.nan)
        got = np.asarray(call(xn, w))
        assert np.all(np.isnan(got[3])) and not np.any(np.isnan(np.delete(got, 3, axis=0)))
    finally:
        cpu_matmul.release_weights(owner)
    assert cpu_matmul.packed_bytes(owner) == 0
    assert _rel_err(call(x, w), np.asarray(x, np.float64) @ wf) < 1e-5


@pytest.mark.skipif(not cpu_matmul.packs_pairs("int8"), reason="the kernel reads packed pairs on AVX512-BF16 only")
@pytest.mark.parametrize("transpose_w", [False, True])
def test_a_registered_int8_weight_is_read_from_packed_pairs_by_many_rows(transpose_w):
    """A registered int8 weight times bf16 rows: calls of up to 16 rows stream the int8 weight
    (nothing packed; [N, K] through int16), a call of more packs its integers as bf16 pairs
    (exact) and multiplies from them with f32 sums, the scale after: to f32 rounding of float64
    on the same inputs, where the int16 path of few rows rounds x (values far below the row's
    largest lose bits there, none here); a row's bits do not depend on the other rows of its call."""
    rng = np.random.default_rng(21)
    k, n = (576 if transpose_w else 577), 130  # [N, K] of whole 32s: few rows take the int16 path
    q = rng.integers(-128, 128, (n, k) if transpose_w else (k, n)).astype(np.int8)
    qf = q.T.astype(np.float64) if transpose_w else q.astype(np.float64)
    scale = (rng.random(n) * 0.02 + 0.001).astype(np.float32)
    w, s = jnp.asarray(q), jnp.asarray(scale)
    call = jax.jit(lambda x, w, s: cpu_matmul.matmul(x, w, transpose_w=transpose_w, scale=s, out_dtype=jnp.float32))
    x = rng.standard_normal((40, k)).astype(np.float32)
    x[:, 3] = 400.0  # the rest of each row below 2^7 of it: the int16 path rounds them, pairs keep them
    xb = jnp.asarray(x, jnp.bfloat16)
    want = (np.asarray(xb, np.float64) @ qf) * scale
    owner = cpu_matmul.register_weights([w])
    try:
        few = np.asarray(call(xb[:16], w, s), np.float64)
        assert cpu_matmul.packed_bytes(owner) == 0
        whole = np.asarray(call(xb, w, s), np.float64)
        assert cpu_matmul.packed_bytes(owner) == 3 * 64 * ((k + 1) // 2) * 4
        assert _rel_err(whole, want) < 1e-5
        assert _rel_err(few, want[:16]) < (1e-2 if transpose_w else 1e-5)
        if transpose_w and cpu_matmul.lanes("int8") > 1:  # the int16 path did run
            assert _rel_err(few, want[:16]) > 10 * _rel_err(whole[:16], want[:16])
        for m in (17, 21, 33):
            np.testing.assert_array_equal(np.asarray(call(xb[:m], w, s)), whole[:m])
    finally:
        cpu_matmul.release_weights(owner)
    assert cpu_matmul.packed_bytes(owner) == 0


@needs_pairs
def test_a_registered_stack_packs_each_layer_apart():
    """A stack [L, K, N] registers each layer's matrix; the layers' scan reads layer l's packed
    copy in place, the same bits as that layer registered alone, and only what was read is packed."""
    rng = np.random.default_rng(3)
    stack = jnp.asarray(rng.standard_normal((3, 96, 130)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((6, 96)), jnp.bfloat16)
    call = jax.jit(lambda x, w, at: cpu_matmul.matmul(x, w, layer=at, out_dtype=jnp.float32))
    owner = cpu_matmul.register_weights([stack])
    try:
        got = np.asarray(call(x, stack, jnp.int32(2)))
        assert cpu_matmul.packed_bytes(owner) == 3 * 48 * 64 * 4  # layer 2 alone: 3 tiles of 48 pairs
        layer2 = stack[2]  # a buffer of its own, held while registered
        alone = cpu_matmul.register_weights([layer2])
        single = np.asarray(jax.jit(lambda x, w: cpu_matmul.matmul(x, w, out_dtype=jnp.float32))(x, layer2))
        assert cpu_matmul.packed_bytes(alone) == 3 * 48 * 64 * 4
        cpu_matmul.release_weights(alone)
        np.testing.assert_array_equal(got, single)
        assert _rel_err(got, np.asarray(x, np.float64) @ np.asarray(stack[2], np.float64)) < 1e-5
    finally:
        cpu_matmul.release_weights(owner)


def _reserved(want: int) -> tuple[int, int]:
    """The reserve nobody has taken, once `want` bytes of it are in (its thread faults them in)."""
    deadline = time.monotonic() + 30
    while (got := cpu_matmul.arena_bytes())[1] < want and time.monotonic() < deadline:
        time.sleep(0.01)
    return got


@needs_pairs
def test_the_next_registrant_packs_into_the_memory_a_reserve_faulted_in():
    """`reserve` maps the copies' memory ahead, as `take` will lay it out (copies under 32 MiB
    share 32 MiB chunks, a larger one has its own); the next registrant takes it and packs into
    it without mapping more, to the same bits as without a reserve; a reserve nobody took is
    replaced (and freed) by the next; f32 and int8 matrices reserve nothing (int8's pairs wait
    for calls of many rows)."""
    chunk, mib = 32 << 20, 1 << 20
    rng = np.random.default_rng(5)
    small = [jnp.asarray(rng.standard_normal((96, 130)), jnp.bfloat16), jnp.asarray(rng.standard_normal((130, 64)), jnp.bfloat16)]
    big = jnp.asarray(rng.standard_normal((4096, 4160)), jnp.bfloat16)  # 65 tiles x 2048 pairs: 32.5 MiB, a 34 MiB chunk
    assert cpu_matmul.pairs_bytes(big.shape) == 65 * 64 * 2048 * 4
    call = jax.jit(lambda x, w: cpu_matmul.matmul(x, w, out_dtype=jnp.float32))
    calls_t = jax.jit(lambda x, w: cpu_matmul.matmul(x, w, transpose_w=True, out_dtype=jnp.float32))
    x96, x64 = (jnp.asarray(rng.standard_normal((5, k)), jnp.bfloat16) for k in (96, 64))
    x4096 = jnp.asarray(rng.standard_normal((3, 4096)), jnp.bfloat16)
    plain = cpu_matmul.register_weights([*small, big])  # the bits without a reserve
    try:
        want = [np.asarray(call(x96, small[0])), np.asarray(calls_t(x64, small[1])), np.asarray(call(x4096, big))]
        assert cpu_matmul.arena_bytes(plain) == (chunk + 34 * mib, 0)
    finally:
        cpu_matmul.release_weights(plain)

    cpu_matmul.reserve([small[0], jax.ShapeDtypeStruct((3, 8, 8), jnp.float32), jax.ShapeDtypeStruct((4096, 4096), jnp.int8)])
    assert _reserved(chunk) == (0, chunk)
    cpu_matmul.reserve([jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (*small, big)])  # avals do
    assert _reserved(chunk + 34 * mib) == (0, chunk + 34 * mib)  # the first one gone
    owner = cpu_matmul.register_weights([*small, big])
    try:
        assert cpu_matmul.arena_bytes() == (0, 0) and cpu_matmul.arena_bytes(owner) == (0, chunk + 34 * mib)
        got = [np.asarray(call(x96, small[0])), np.asarray(calls_t(x64, small[1])), np.asarray(call(x4096, big))]
        assert cpu_matmul.arena_bytes(owner) == (chunk + 34 * mib, 0)  # all taken, nothing more mapped
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
    finally:
        cpu_matmul.release_weights(owner)
    assert cpu_matmul.arena_bytes(owner) == (0, 0)


@needs_pairs
def test_the_executor_registers_its_bf16_weights_for_pairs_and_again_after_a_swap(tiny_dir):
    """A bf16 executor on the kernel registers its weights (no oneDNN copy beside them), packs
    them on its first steps, prefill's included, and a swap releases the old copies before their
    buffers are freed and registers the new: greedy tokens as a fresh executor on the new weights
    gives, and as XLA's dot gives on the old (to a near-tie)."""
    from ringserve.model.compute.kernels import onednn
    from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor
    from tests.model.test_hf_parity import greedy_with_cached_prefix, prompts_with_shared_prefix

    cfg = ExecutorConfig(page_size=16, num_pages=64, max_context_len=256, max_batch=16, max_extend_tokens=128,
                         precompile=False, dtype="bfloat16")  # fmt: skip
    prompts = prompts_with_shared_prefix(16, [5, 30, 9, 17, 3, 8, 12, 20, 6])
    ex = ModelExecutor(tiny_dir("llama"), cfg)
    assert ex.plan.dot.name == "kernel"
    onednn_owner, first = ex._packed[0]
    assert onednn_owner is None and first is not None and cpu_matmul.packed_bytes(first) == 0
    a = greedy_with_cached_prefix(ex, prompts, 16, 4)
    assert cpu_matmul.packed_bytes(first) > 0 and onednn.packed_bytes() == 0
    ref = ModelExecutor(tiny_dir("llama"), dataclasses.replace(cfg, cpu_matmul="xla"))
    b = greedy_with_cached_prefix(ref, prompts, 16, 4)
    same = sum(x == y for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True))
    assert same >= 0.9 * sum(map(len, a)), (a, b)
    rng = np.random.default_rng(5)
    new = {k: (np.asarray(v, np.float32) * rng.uniform(0.5, 1.5, np.shape(v))).astype(np.float32)
           for k, v in ex.host_tensors.items()}  # fmt: skip
    ex.swap_params(ex.build_params(new), new)
    assert cpu_matmul.packed_bytes(first) == 0 and ex._packed[0][1] not in (None, first)
    got = greedy_with_cached_prefix(ex, prompts, 16, 8)
    assert cpu_matmul.packed_bytes(ex._packed[0][1]) > 0
    fresh = ModelExecutor(tiny_dir("llama"), cfg)
    fresh.swap_params(fresh.build_params(new), new)
    assert got == greedy_with_cached_prefix(fresh, prompts, 16, 8)
    ex.drop_params()
    assert ex._packed[0] is None


needs_amx = pytest.mark.skipif(not cpu_matmul.uses_amx(), reason="AMX: a Sapphire Rapids or later CPU whose Linux lends it")


@needs_amx
@pytest.mark.parametrize("k, n, transpose_w", [(576, 1536, False), (64, 2100, False), (96, 200, True)])
def test_amx_multiplies_registered_weights_at_every_row_count(k, n, transpose_w):
    """Where AMX runs, a registered bf16 weight with K a multiple of 32 multiplies through its
    tiles at every row count: the tails of its 16-row tiles (1, 15, 17, 31, 33 rows) and of its
    16-column blocks (N 200, 2100) to f32 rounding of float64, bf16 results its f32 ones rounded
    to nearest even; a row's bits do not depend on the other rows of its call (one block of 16
    rows or two); RINGSERVE_AMX=0 in a fresh process keeps the AVX-512 pairs, to the same
    tolerance."""
    rng = np.random.default_rng(k + n)
    w = jnp.asarray(rng.standard_normal((n, k) if transpose_w else (k, n)), jnp.bfloat16)
    wf = np.asarray(w, np.float64).T if transpose_w else np.asarray(w, np.float64)
    call = jax.jit(lambda x, w: cpu_matmul.matmul(x, w, transpose_w=transpose_w, out_dtype=jnp.float32))
    call_bf16 = jax.jit(lambda x, w: cpu_matmul.matmul(x, w, transpose_w=transpose_w))
    x = jnp.asarray(rng.standard_normal((70, k)), jnp.bfloat16)
    want = np.asarray(x, np.float64) @ wf
    owner = cpu_matmul.register_weights([w])
    try:
        whole = np.asarray(call(x, w))
        assert _rel_err(whole, want) < 1e-5
        for _ in range(40):  # items on both threads: a block written past its 32 rows raced the next item's
            np.testing.assert_array_equal(np.asarray(call(x, w)), whole)
        np.testing.assert_array_equal(np.asarray(call_bf16(x, w)), np.asarray(jnp.asarray(whole).astype(jnp.bfloat16)))
        for m in (1, 15, 16, 17, 31, 33):
            np.testing.assert_array_equal(np.asarray(call(x[:m], w)), whole[:m])
            np.testing.assert_array_equal(np.asarray(call(x[m - 1 : m + 1], w)), whole[m - 1 : m + 1])
    finally:
        cpu_matmul.release_weights(owner)
    code = (
        "import jax, jax.numpy as jnp, numpy as np\n"
        "from ringserve.model.compute.kernels import cpu_matmul\n"
        f"rng = np.random.default_rng({k + n})\n"
        f"w = jnp.asarray(rng.standard_normal({(n, k) if transpose_w else (k, n)}), jnp.bfloat16)\n"
        f"x = jnp.asarray(rng.standard_normal((70, {k})), jnp.bfloat16)\n"
        "owner = cpu_matmul.register_weights([w])\n"
        f"y = cpu_matmul.matmul(x, w, transpose_w={transpose_w}, out_dtype=jnp.float32)\n"
        "print(cpu_matmul.uses_amx(), cpu_matmul.packed_bytes(owner) > 0)\n"
        "np.save(__import__('sys').argv[1], np.asarray(y))\n"
    )
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "y.npy")
        env = {**os.environ, "RINGSERVE_AMX": "0"}
        done = subprocess.run([sys.executable, "-c", code, out], capture_output=True, text=True, env=env,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split() == ["False", "True"]  # the pairs, without AMX
        assert _rel_err(np.load(out), want) < 1e-5


def _bf16_steps(got, want) -> np.ndarray:
    """How many bf16 steps apart two bf16 arrays of one sign pattern are, element by element."""
    g = np.asarray(got).view(np.uint16).astype(np.int32)
    w = np.asarray(want).view(np.uint16).astype(np.int32)
    return np.abs(g - w)


@pytest.mark.parametrize("wdtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("register", [True, False])
def test_gated_is_silu_of_the_gate_times_up_as_layers_computes_it(wdtype, register):
    """`gated` (GatedMLP's silu(x @ wg) * (x @ wu) in one call) against the same two products
    from `matmuls` and model/layers/mlp.py's XLA activation: within two bf16 steps where its exp and
    XLA's round apart, in under 1% of the values, at every row count (the 16-row blocks of AMX,
    its 32-row blocks past 64 rows, int8's int16 stream up to 16 rows); registered weights (read
    from packed pairs: AMX sums both products and activates them in place) and unregistered ones
    (both products, then the activation); a row's bits do not depend on its call's other rows
    (int8: on either side of where x turns from int16 rows to bf16 pairs, or to f32 unregistered)."""
    from ringserve.model.layers.mlp import silu

    k, n = 576, 200
    rng = np.random.default_rng(7)
    if wdtype == "int8":
        ws = [jnp.asarray(rng.integers(-127, 128, (n, k)).astype(np.int8)) for _ in range(2)]
        scales = [jnp.asarray((rng.random(n) * 0.01 + 0.001).astype(np.float32)) for _ in range(2)]
        transpose = True
    else:
        ws = [jnp.asarray(rng.standard_normal((k, n)) * 0.06, jnp.bfloat16) for _ in range(2)]
        scales, transpose = None, False
    x = jnp.asarray(rng.standard_normal((100, k)), jnp.bfloat16)
    fused = jax.jit(lambda x, a, b: cpu_matmul.gated(x, [a, b], transpose_w=transpose, scales=scales))
    plain = jax.jit(lambda x, a, b: (lambda g, u: silu(g) * u)(*cpu_matmul.matmuls(x, [a, b], transpose_w=transpose, scales=scales)))
    owner = cpu_matmul.register_weights(ws) if register else None
    try:
        whole = np.asarray(fused(x, *ws))
        pairs = register and cpu_matmul.packs_pairs("int8")  # (no pairs without AVX512-BF16: as unregistered)
        cut = (16 if pairs else 64) if wdtype == "int8" else 0  # int8's int16 rows up to `cut`
        few = np.asarray(fused(x[:cut], *ws)) if cut else whole
        for m in (1, 5, 16, 17, 40, 64, 65, 100):
            got, want = np.asarray(fused(x[:m], *ws)), np.asarray(plain(x[:m], *ws))
            np.testing.assert_array_equal(got, (few if m <= cut else whole)[:m])
            steps = _bf16_steps(got, want)
            assert steps.max() <= 2 and (steps > 0).mean() < 0.01, (m, steps.max(), (steps > 0).mean())
    finally:
        cpu_matmul.release_weights(owner)


def test_the_mlp_takes_the_gated_call_for_bf16_on_the_kernel_only():
    """GatedMLP's activation runs in the gated call for bf16 x on the kernel's dots, and as XLA's
    expression under XLA's dot, for f32 and with adapters."""
    from ringserve.model.compute.dots import Dot
    from ringserve.model.layers.mlp import GatedMLP

    def calls(dtype, dot) -> bool:
        mlp = GatedMLP(32, 64, dtype, (), (), dot=Dot(dot))
        return "gated = true" in jax.jit(lambda x: mlp(x)).lower(jnp.ones((2, 32), dtype)).as_text()

    assert calls(jnp.bfloat16, "kernel")
    assert not calls(jnp.bfloat16, "xla") and not calls(jnp.bfloat16, "invariant") and not calls(jnp.float32, "kernel")

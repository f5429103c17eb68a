"""oneDNN's matmul custom call (model/compute/kernels/onednn.py) and how the executor picks the dot
(model/compute/plan.py resolve_dot). The kernel's tests run where `ringserve[onednn]` is installed
(the test extra installs it) and skip with the reason elsewhere; the choice is tested everywhere."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ringserve.model.compute.kernels import onednn
from ringserve.model.compute.options import ComputeOptions
from ringserve.model.compute.plan import resolve_dot
from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor

needs_onednn = pytest.mark.skipif(onednn.reason() is not None, reason=f"oneDNN custom call: {onednn.reason()}")


def needs(x_dtype: str, w_dtype: str):
    """Skip unless oneDNN makes x_dtype x w_dtype matmuls on this CPU (`onednn.supports`; an AVX2
    processor has no bf16 ones: test_what_onednn_lacks_here_fails_by_name covers it there)."""
    why = onednn.supports(x_dtype, w_dtype)
    return pytest.mark.skipif(why is not None, reason=f"oneDNN custom call: {why}")


def dot(platform: str, tp_size: int = 1, deterministic: bool = False, **opts) -> str:
    return resolve_dot(ComputeOptions(enable_deterministic_inference=deterministic, **opts), platform, tp_size)


def test_auto_picks_the_best_dot_that_runs_here(monkeypatch):
    from ringserve.model.compute.kernels import cpu_matmul

    monkeypatch.setattr(onednn, "supports", lambda x, w: None)
    monkeypatch.setattr(cpu_matmul, "reason", lambda weights="float32": None)
    # where the kernel reads bf16 weights from packed pairs (AVX512-BF16) it takes every bf16 step
    monkeypatch.setattr(cpu_matmul, "packs_pairs", lambda weights="bfloat16": True)
    assert dot("cpu", dtype="bfloat16") == "kernel"
    assert dot("cpu", dtype="bfloat16", cpu_matmul="kernel") == "kernel"
    assert dot("cpu", dtype="bfloat16", quantization="int8") == "kernel"
    assert dot("cpu", dtype="float32", quantization="int8") == "kernel+onednn"  # f32 rows
    assert dot("cpu", dtype="bfloat16", cpu_matmul="onednn") == "onednn"
    monkeypatch.setattr(cpu_matmul, "packs_pairs", lambda weights="bfloat16": False)
    assert dot("cpu", dtype="bfloat16") == "kernel+onednn"
    assert dot("cpu", dtype="float32", quantization="int8") == "kernel+onednn"
    assert dot("cpu", dtype="float32") == "kernel"  # XLA's f32 dot for larger steps
    assert dot("cpu", dtype="float16") == "onednn"  # the kernel has no f16
    assert dot("cpu", dtype="bfloat16", tp_size=2) == "xla"
    assert dot("gpu", dtype="bfloat16") == "xla"
    assert dot("cpu", dtype="bfloat16", deterministic=True) == "invariant"
    assert dot("cpu", dtype="float32", cpu_matmul="onednn") == "onednn"
    assert dot("cpu", dtype="bfloat16", cpu_matmul="xla") == "xla"
    # oneDNN present, but without bf16 kernels on this CPU (AVX2 alone): bf16 and int8 stay off it
    monkeypatch.setattr(onednn, "supports", lambda x, w: None if (x, w) == ("float32", "float32") else "no bf16")
    assert dot("cpu", dtype="bfloat16") == "kernel"
    assert dot("cpu", dtype="bfloat16", quantization="int8") == "kernel"
    assert dot("cpu", dtype="float32", cpu_matmul="onednn") == "onednn"
    with pytest.raises(ValueError, match="cpu_matmul='onednn' is not available here: no bf16"):
        dot("cpu", dtype="bfloat16", cpu_matmul="onednn")
    monkeypatch.setattr(onednn, "supports", lambda x, w: "no oneDNN")
    assert dot("cpu", dtype="bfloat16") == "kernel"
    assert dot("cpu", dtype="bfloat16", cpu_matmul="kernel") == "kernel"
    monkeypatch.setattr(cpu_matmul, "reason", lambda weights="float32": "no C++ compiler")
    assert dot("cpu", dtype="bfloat16") == "xla"  # auto falls back
    monkeypatch.setattr(onednn, "supports", lambda x, w: None)
    assert dot("cpu", dtype="bfloat16") == "onednn"


@pytest.mark.parametrize(
    "kwargs, platform, message",
    [
        (dict(cpu_matmul="mkl"), "cpu", "cpu_matmul='mkl': must be one of ['auto', 'xla', 'onednn', 'kernel']"),
        (dict(cpu_matmul="onednn", deterministic=True), "cpu", "deterministic mode keeps"),
        (dict(cpu_matmul="kernel", deterministic=True), "cpu", "deterministic mode keeps"),
        (dict(cpu_matmul="onednn"), "tpu", "runs on CPU only; this platform is 'tpu'"),
        (dict(cpu_matmul="kernel", tp_size=2), "cpu", "needs tp_size=1 (got 2)"),
        (dict(cpu_matmul="kernel", dtype="float16"), "cpu", "float32 or bfloat16, not float16"),
        (dict(cpu_matmul="onednn"), "cpu", "is not available here: no C++ compiler"),
        (dict(cpu_matmul="kernel"), "cpu", "is not available here: no C++ compiler"),
    ],
)
def test_asking_for_a_dot_that_cannot_run_names_why(monkeypatch, kwargs, platform, message):
    from ringserve.model.compute.kernels import cpu_matmul

    monkeypatch.setattr(onednn, "supports", lambda x, w: "no C++ compiler")
    monkeypatch.setattr(cpu_matmul, "reason", lambda weights="float32": "no C++ compiler")
    with pytest.raises(ValueError, match="cpu_matmul") as e:
        dot(platform, **kwargs)
    assert message in str(e.value)


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@needs_onednn
def test_what_onednn_lacks_here_fails_by_name():
    """oneDNN's kernels depend on the processor (bf16 needs AVX512-BF16, AMX or AVX2-VNNI-2):
    what `supports` says it lacks fails with a message naming the types, never a crash, and f32
    is made everywhere. Where it has everything, the other tests here cover each."""
    assert onednn.supports("float32", "float32") is None
    assert "no int8 x float32" in onednn.supports("int8", "float32")
    x = jnp.ones((8, 64), jnp.bfloat16)
    for w, scale in ((jnp.ones((64, 32), jnp.bfloat16), None), (jnp.ones((64, 32), jnp.int8), jnp.ones(32))):
        why = onednn.supports("bfloat16", jnp.dtype(w.dtype).name)
        if why is None:
            assert np.all(np.asarray(onednn.matmul(x, w, scale=scale), np.float32) == 64)
            continue
        assert why == f"oneDNN has no bfloat16 x {jnp.dtype(w.dtype).name} matmul on this CPU"
        with pytest.raises(Exception, match=f"oneDNN has no bf16 x {'int8' if scale is not None else 'bf16'} matmul"):
            onednn.matmul(x, w, scale=scale).block_until_ready()


@needs_onednn
@pytest.mark.parametrize("m", [1, 5, 64])
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=needs("bfloat16", "bfloat16"))])
def test_matmul_matches_numpy_in_both_weight_layouts(m, dtype):
    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.standard_normal((m, 96)), dtype)
    w = jnp.asarray(rng.standard_normal((96, 200)), dtype)
    want = np.asarray(x, np.float32) @ np.asarray(w, np.float32)  # the same (rounded) inputs, in f32
    got = jax.jit(lambda x, w: onednn.matmul(x, w, out_dtype=jnp.float32))(x, w)
    got_t = jax.jit(lambda x, wt: onednn.matmul(x, wt, transpose_w=True, out_dtype=jnp.float32))(x, w.T)
    assert got.shape == got_t.shape == (m, 200) and got.dtype == jnp.float32
    assert _rel_err(got, want) < 1e-5 and _rel_err(got_t, want) < 1e-5  # f32 accumulation either way
    same = jax.jit(lambda x, w: onednn.matmul(x, w))(x, w)
    assert same.dtype == jnp.dtype(dtype) and _rel_err(same, want) < (1e-2 if dtype == "bfloat16" else 1e-5)


@needs("bfloat16", "int8")
def test_leading_axes_are_rows_and_int8_weights_scale_per_column():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.bfloat16)
    q = rng.integers(-127, 128, (64, 48)).astype(np.int8)
    scale = (rng.random(48) * 0.02 + 0.001).astype(np.float32)
    want = np.asarray(x, np.float32) @ (q.astype(np.float32) * scale)
    got = jax.jit(lambda x, q, s: onednn.matmul(x, q, scale=s, out_dtype=jnp.float32))(x, jnp.asarray(q), jnp.asarray(scale))
    assert got.shape == (2, 3, 48)
    assert _rel_err(got, want) < 2e-2  # bf16 arithmetic over dequantized weights
    got_t = jax.jit(lambda x, q, s: onednn.matmul(x, q, transpose_w=True, scale=s, out_dtype=jnp.float32))(
        x, jnp.asarray(q.T.copy()), jnp.asarray(scale))  # fmt: skip
    assert _rel_err(got_t, want) < 2e-2


@needs("bfloat16", "bfloat16")
@pytest.mark.parametrize("cpu_matmul", ["onednn", "kernel"])
def test_a_bf16_model_through_onednn_keeps_its_cache_as_bits_and_agrees_with_xla(tiny_dir, cpu_matmul):
    """The tiny model in bf16, its projections and LM head through oneDNN (or decode's through
    ringserve's small-row kernel, every step's where it reads packed pairs), against the same
    model on XLA's dot: the cache is stored as uint16 (no whole-cache conversions on CPU) and
    greedy continuations agree (the LM head's f32 logits may break a near-tie differently)."""
    from ringserve.model.compute.kernels import cpu_matmul as kernel
    from tests.model.test_hf_parity import greedy_with_cached_prefix, prompts_with_shared_prefix

    cfg = ExecutorConfig(page_size=16, num_pages=64, max_context_len=256, max_batch=4, max_extend_tokens=128,
                         precompile=False, dtype="bfloat16", cpu_matmul=cpu_matmul)  # fmt: skip
    prompts = prompts_with_shared_prefix(16, [5, 30, 9, 17])
    fast = ModelExecutor(tiny_dir("llama"), cfg)
    dot = "onednn" if cpu_matmul == "onednn" else "kernel" if kernel.packs_pairs() else "kernel+onednn"
    assert fast.plan.dot.name == dot and fast.kv_pool.kv[0].dtype == jnp.uint16
    ref = ModelExecutor(tiny_dir("llama"), dataclasses.replace(cfg, cpu_matmul="xla"))
    assert ref.plan.dot.name == "xla"
    a, b = greedy_with_cached_prefix(fast, prompts, 16, 12), greedy_with_cached_prefix(ref, prompts, 16, 12)
    same = sum(x == y for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True))
    assert same >= 0.9 * sum(map(len, a)), (a, b)


@pytest.mark.parametrize("quant", [pytest.param(False, marks=needs("bfloat16", "bfloat16")),
                                   pytest.param(True, marks=needs("bfloat16", "int8"))])
@pytest.mark.parametrize("transpose_w", [False, True])
def test_a_registered_weight_is_packed_once_and_multiplies_to_the_same_bits(quant, transpose_w):
    """A weight registered as the executor's is copied into oneDNN's blocked layout on its first
    call of 8 rows or more and read from the copy after: the same bits as the plain weight gives.
    Fewer rows read the plain weight; a release frees the copy."""
    rng = np.random.default_rng(3)
    k, n = 96, 200
    shape = (n, k) if transpose_w else (k, n)
    if quant:
        w = jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
        scale = jnp.asarray(rng.random(n) * 0.02 + 0.001, jnp.float32)
    else:
        w, scale = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16), None
    x = jnp.asarray(rng.standard_normal((64, k)), jnp.bfloat16)
    f = jax.jit(lambda x, w: onednn.matmul(x, w, transpose_w=transpose_w, scale=scale, out_dtype=jnp.float32))
    plain, plain_few = np.asarray(f(x, w)), np.asarray(f(x[:4], w))
    owner = onednn.register_weights([w, jnp.zeros((7,), jnp.float32)])  # a vector is never a weight: skipped
    try:
        np.testing.assert_array_equal(np.asarray(f(x[:4], w)), plain_few)
        assert onednn.packed_bytes(owner) == 0  # 4 rows: the plain weight
        np.testing.assert_array_equal(np.asarray(f(x, w)), plain)
        packed = onednn.packed_bytes(owner)
        assert packed >= w.nbytes
        np.testing.assert_array_equal(np.asarray(f(x[:16], w)), plain[:16])
        assert onednn.packed_bytes(owner) == packed  # one copy serves every row count
    finally:
        onednn.release_weights(owner)
    assert onednn.packed_bytes(owner) == 0
    np.testing.assert_array_equal(np.asarray(f(x, w)), plain)


@pytest.mark.parametrize("quant", [False, pytest.param(True, marks=needs("float32", "int8"))])
@pytest.mark.parametrize("transpose_w", [False, True])
@needs_onednn
def test_a_stacked_weight_reads_each_layer_in_place_packed_or_not(quant, transpose_w):
    """Weights stacked over layers ([L, K, N] / [L, N, K], scales [L, N]; the CPU scan) with the
    layer as an operand: each layer's bits are its own matrix's, read plain (4 rows) and from
    the packed copy of that layer's registered slice (64 rows); the last layer too; a layer out
    of the stack is refused."""
    rng = np.random.default_rng(4)
    k, n, layers = 96, 200, 3
    shape = (layers, n, k) if transpose_w else (layers, k, n)
    if quant:
        w = jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
        scale = jnp.asarray(rng.random((layers, n)) * 0.02 + 0.001, jnp.float32)
    else:
        w, scale = jnp.asarray(rng.standard_normal(shape), jnp.float32), None
    x = jnp.asarray(rng.standard_normal((64, k)), jnp.float32)
    one = jax.jit(lambda x, w, s: onednn.matmul(x, w, transpose_w=transpose_w, scale=s))
    stacked = jax.jit(lambda x, w, s, li: onednn.matmul(x, w, transpose_w=transpose_w, scale=s, layer=li))
    want = [[np.asarray(one(x[:rows], w[li], None if scale is None else scale[li])) for li in range(layers)]
            for rows in (4, 64)]  # fmt: skip
    owner = onednn.register_weights([w])
    try:
        for i, rows in enumerate((4, 64)):
            for li in range(layers):
                np.testing.assert_array_equal(np.asarray(stacked(x[:rows], w, scale, jnp.int32(li))), want[i][li],
                                              err_msg=f"{rows} {li}")  # fmt: skip
        assert onednn.packed_bytes(owner) >= w.nbytes  # every layer's slice packed once
        with pytest.raises(Exception, match="layer out of the stack's range"):
            jax.block_until_ready(stacked(x, w, scale, jnp.int32(layers)))
    finally:
        onednn.release_weights(owner)


@needs("bfloat16", "bfloat16")
def test_the_executor_packs_its_weights_and_repacks_after_a_swap(tiny_dir):
    """The executor registers its weights; a swap releases the old ones before they are freed
    and registers the new, whose steps then give what a fresh executor on them gives."""
    from tests.model.test_hf_parity import greedy_with_cached_prefix, prompts_with_shared_prefix

    cfg = ExecutorConfig(page_size=16, num_pages=64, max_context_len=256, max_batch=16, max_extend_tokens=128,
                         precompile=False, dtype="bfloat16", cpu_matmul="onednn")  # fmt: skip
    prompts = prompts_with_shared_prefix(16, [5, 30, 9, 17, 3, 8, 12, 20, 6])  # 9 rows: decode packs too
    ex = ModelExecutor(tiny_dir("llama"), cfg)
    first = ex._packed[0][0]  # (oneDNN's owner, the kernel's)
    assert first is not None and onednn.packed_bytes(first) == 0  # packed on first use
    greedy_with_cached_prefix(ex, prompts, 16, 4)
    assert onednn.packed_bytes(first) > 0
    rng = np.random.default_rng(5)
    new = {k: (np.asarray(v, np.float32) * rng.uniform(0.5, 1.5, np.shape(v))).astype(np.float32)
           for k, v in ex.host_tensors.items()}  # fmt: skip
    ex.swap_params(ex.build_params(new), new)
    assert onednn.packed_bytes(first) == 0 and ex._packed[0][0] not in (None, first)
    got = greedy_with_cached_prefix(ex, prompts, 16, 8)
    assert onednn.packed_bytes(ex._packed[0][0]) > 0
    fresh = ModelExecutor(tiny_dir("llama"), cfg)
    fresh.swap_params(fresh.build_params(new), new)
    assert got == greedy_with_cached_prefix(fresh, prompts, 16, 8)
    ex.drop_params()
    assert ex._packed[0] is None


@needs_onednn
@pytest.mark.parametrize("dtype, beside", [("bfloat16", 4), ("int8", 16)])
def test_beside_onednn_the_small_row_kernel_takes_fewer_rows(dtype, beside, monkeypatch):
    """With oneDNN reading packed weights from 8 rows up, the small-row kernel keeps only the
    rows it is faster for (model/compute/dots.py KERNEL_ROWS_BESIDE_ONEDNN); alone it keeps more;
    bf16 weights read from packed pairs take the kernel at every size, beside oneDNN or not."""
    from ringserve.model.compute.dots import PAIR_ROWS, Dot, kernel_rows
    from ringserve.model.compute.kernels import cpu_matmul

    monkeypatch.setattr(cpu_matmul, "packs_pairs", lambda weights="bfloat16": True)
    assert kernel_rows(dtype) == kernel_rows(dtype, True) == PAIR_ROWS  # bf16 rows
    assert kernel_rows(dtype, True, "float32") != PAIR_ROWS  # f32 rows never read pairs
    monkeypatch.setattr(cpu_matmul, "packs_pairs", lambda weights="bfloat16": False)

    w = jnp.zeros((64, 32), jnp.int8 if dtype == "int8" else jnp.bfloat16)
    alone = kernel_rows(dtype)
    assert alone > beside
    for rows in (1, beside, beside + 1, alone, alone + 1):
        x = jnp.zeros((rows, 64), jnp.bfloat16)
        assert Dot("kernel+onednn").few_rows(x, w) == (rows <= beside), rows
        assert Dot("kernel").few_rows(x, w) == (rows <= alone), rows
    assert not Dot("onednn").few_rows(jnp.zeros((1, 64), jnp.bfloat16), w)

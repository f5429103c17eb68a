"""Every attention backend on one mixed batch, against the native path and transformers. The
Pallas kernels run in their interpreters (attention_interpret=True), so the TPU and GPU kernels
are checked on CPU.

Tolerance: 1e-5 of the logit scale, as in tests/model/test_hf_parity.py (float32 everywhere;
the backends differ in summation order only: measured <= 1.3e-6 of the scale, max |logit| ~68).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ringserve.model.compute.step_inputs import DeviceRow
from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor
from tests.hf_ref import hf_greedy, hf_logits
from tests.model import test_hf_parity as parity

PAGE = 16
CFG = ExecutorConfig(
    page_size=PAGE, num_pages=96, max_context_len=512, max_batch=8, max_extend_tokens=512,
    extend_block=16, precompile=False,
)  # fmt: skip
TOL = 1e-5  # of the logit scale

# Three steps: two extend steps of one program (T = 512: every compile costs ~8 s in the
# interpreters) and a decode step, which reads the K/V step 2 wrote for all of its tokens.
#
#   row  step 1       step 2                          step 3        pages
#   P    300 tokens   a 40-token chunk over them      decode @ 340  1..22
#   Q    150 tokens   decode @ 150                    decode @ 151  30..39
#   S    31 tokens    decode @ 31 (ends page 2)       decode @ 32   40..42  (opens page 3)
#   F    -            a fresh prefill of 230          decode @ 230  50..64
#
# No row writes a page another row reads. P's chunk spans two query blocks of 32 tokens over
# three KV blocks of 8 pages: the layout that broke the TPU kernel's old interpreter path.
ROWS = ("P", "Q", "S", "F")
TABLES = {r: np.array(p, np.int32) for r, p in
          {"P": range(1, 23), "Q": range(30, 40), "S": range(40, 43), "F": range(50, 65)}.items()}  # fmt: skip


def scenario_tokens() -> list[dict[str, list[int]]]:
    """Each step's new tokens per row (steps 1, 2, 3)."""
    rng = np.random.default_rng(3)

    def draw(n: int) -> list[int]:
        return rng.integers(3, 2000, n).tolist()

    return [
        {"P": draw(300), "Q": draw(150), "S": draw(31)},
        {"P": draw(40), "Q": [7], "S": [9], "F": draw(230)},
        {r: draw(1) for r in ROWS},
    ]


def run_scenario(ex: ModelExecutor) -> list[np.ndarray]:
    """Per step, [rows of the step, vocab] f32: the last-token logits of its rows."""
    done = dict.fromkeys(ROWS, 0)
    out = []
    for step in scenario_tokens():
        out.append(ex.logits([DeviceRow(np.array(step[r], np.int32), done[r], TABLES[r]) for r in step])[0])
        for r in step:
            done[r] += len(step[r])
    return out


def executor(path, backend: str, **kw) -> ModelExecutor:
    return ModelExecutor(
        path,
        dataclasses.replace(CFG, attention_backend=backend, attention_interpret=backend != "native", **kw),
    )


@pytest.fixture(scope="module")
def native(tiny_dir) -> list[np.ndarray]:
    return run_scenario(executor(tiny_dir("llama"), "native"))


def assert_close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for step, (g, w) in enumerate(zip(got, want, strict=True), 1):
        scale = np.abs(w).max()
        err = np.abs(g - w).max(axis=-1)  # per row
        assert (err <= TOL * scale).all(), (step, err, scale)
        assert (g.argmax(-1) == w.argmax(-1)).all(), step


def test_native_matches_hf(tiny_dir, native):
    path = tiny_dir("llama")
    steps = scenario_tokens()
    seqs = {r: sum((s.get(r, []) for s in steps), []) for r in ROWS}
    full = {r: hf_logits(path, seqs[r]) for r in ROWS}
    ends = dict.fromkeys(ROWS, 0)
    ref = []
    for step in steps:
        for r in step:
            ends[r] += len(step[r])
        ref.append(np.stack([full[r][ends[r] - 1] for r in step]))
    assert_close(native, ref)


@pytest.mark.parametrize("backend", ["cpu_kernel", "bucketed", "pallas", "pallas_ragged", "pallas_gpu"])
def test_mixed_step_matches_native(tiny_dir, native, backend):
    if backend == "cpu_kernel":
        from ringserve.model.compute.kernels import cpu_attention

        if (why := cpu_attention.reason()) is not None:
            pytest.skip(f"the C++ attention kernel: {why}")
    assert_close(run_scenario(executor(tiny_dir("llama"), backend)), native)


def _kernel_case(d: int, bits: bool, seed: int = 0, heads: tuple[int, int] = (6, 2), q_bf16: bool = False):
    """The C++ kernel called directly on a hand-made batch: 4 rows (a decode token after a
    partial page, an extend of 21 tokens from 0, a decode at exactly a page's end, and a padding
    row), `heads` = (query heads, KV heads), pages of 16 scattered over layer 1's range. The
    caches hold bf16-representable values, as f32 or as bf16 bits, and so does q (passed as f32,
    or as bf16 with `q_bf16`). Returns (out, reference)."""
    import jax
    import jax.numpy as jnp

    from ringserve.model.compute.kernels import cpu_attention

    if (why := cpu_attention.reason()) is not None:
        pytest.skip(f"the C++ attention kernel: {why}")
    rng = np.random.default_rng(seed)
    (h, hkv), s, num_pages, layers = heads, 16, 24, 2
    kv_len = np.array([37, 21, 32, 0], np.int32)
    new = [1, 21, 1, 0]  # tokens this step per row
    row_start = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    positions = np.concatenate([np.arange(kv_len[r] - new[r], kv_len[r]) for r in range(4)]).astype(np.int32)
    pages = rng.permutation(np.arange(1, num_pages))[:12].reshape(4, 3).astype(np.int32)
    q = np.asarray(jnp.asarray(rng.normal(size=(len(positions), h, d)).astype(np.float32)).astype(jnp.bfloat16).astype(jnp.float32))
    k = jnp.asarray(rng.normal(size=(hkv, layers * num_pages, d, s)).astype(np.float32)).astype(jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(hkv, layers * num_pages, s, d)).astype(np.float32)).astype(jnp.bfloat16)
    kf, vf = np.asarray(k.astype(jnp.float32)), np.asarray(v.astype(jnp.float32))
    if bits:
        k, v = jax.lax.bitcast_convert_type(k, jnp.uint16), jax.lax.bitcast_convert_type(v, jnp.uint16)
    else:
        k, v = jnp.asarray(kf), jnp.asarray(vf)
    scale = 1.0 / np.sqrt(d)
    call = jax.ffi.ffi_call(cpu_attention.TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = np.asarray(call(jnp.asarray(q).astype(jnp.bfloat16) if q_bf16 else q, k, v, pages, row_start, kv_len, positions, np.int32(num_pages), np.int32(0),
                          scale=np.float32(scale), softcap=np.float32(0)))  # fmt: skip
    ref = np.zeros_like(out)
    for r in range(4):
        ids = [pages[r, j // s] + num_pages for j in range(kv_len[r])]  # layer 1's pages
        for t in range(row_start[r], row_start[r + 1]):
            for head in range(h):
                g = head // (h // hkv)
                keys = np.stack([kf[g, ids[j], :, j % s] for j in range(positions[t] + 1)])
                vals = np.stack([vf[g, ids[j], j % s, :] for j in range(positions[t] + 1)])
                w = keys @ q[t, head] * scale
                w = np.exp(w - w.max())
                ref[t, head] = w @ vals / w.sum()
    return out, ref


@pytest.mark.parametrize("d", [64, 128, 48])
def test_cpu_kernel_reads_bf16_pages_as_their_f32_values(d):
    """Head dims 64 and 128 read a bf16 page straight into AVX-512 registers; 48 widens it into
    a scratch page first. Either way a bf16-bits cache gives exactly the f32 cache's output (the
    widening is exact and the sums run in the same order), and both match a NumPy reference."""
    got, ref = _kernel_case(d, bits=True)
    want, _ = _kernel_case(d, bits=False)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads", [(5, 5), (6, 2), (8, 1), (14, 2)])
def test_cpu_kernel_takes_every_group_size_unpadded(heads):
    """A decode token's G query heads are scored and summed as G rows, with no padding rows up to
    8 (G = 1, 3, 8, 7 here; an extend row's 21 x G queries in blocks of 8): the same outputs as
    the NumPy reference, from f32 and from bf16 pages alike."""
    for bits in (False, True):
        got, ref = _kernel_case(64, bits=bits, heads=heads)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d", [64, 128, 48])
@pytest.mark.parametrize("heads", [(6, 2), (8, 1)])
def test_cpu_kernel_bf16_queries(d, heads):
    """bf16 q against bf16 pages: where the CPU has AVX512-BF16, the page is read in registers
    (head dims 64 and 128) and an item holds 8 queries or more (the extend row's 21 x G; a
    decode token's 8 heads over one KV head) the scores are summed by vdpbf16ps (exact
    products, f32 sums) and the probabilities are rounded to bf16 for the values' sum, as HF's
    bf16 attention does: within bf16's rounding of the reference. Elsewhere (head dim 48, no
    AVX512-BF16, a decode token's 3 heads) q is widened exactly: the same bits as the same
    values passed as f32."""
    got, ref = _kernel_case(d, bits=True, heads=heads, q_bf16=True)
    want, _ = _kernel_case(d, bits=True, heads=heads)
    np.testing.assert_allclose(got, ref, rtol=0, atol=8e-3)  # outputs up to ~3.5: 2^-9 of them
    if d == 48 or "avx512_bf16" not in Path("/proc/cpuinfo").read_text():
        np.testing.assert_array_equal(got, want)
        return
    decode = [0, 22] if heads == (6, 2) else []  # rows 0 and 2's tokens: 3 heads an item, widened
    np.testing.assert_array_equal(got[decode], want[decode])
    assert not np.array_equal(got, want)  # the vdpbf16ps items: bf16 probabilities move some outputs


@pytest.mark.parametrize("arch, dtype", [("mistral", "float32"), ("qwen3", "bfloat16"), ("llama", "bfloat16")])
def test_cpu_kernel_matches_native_with_a_window_and_in_bf16(tiny_dir, arch, dtype):
    """The C++ kernel against the pure-JAX native backend: Mistral's sliding window (f32, to the
    same tolerance), and a bf16 cache stored as bits (the same greedy tokens, logits within bf16's
    rounding of the scale): Qwen3's head dim 48 in the native layout, Llama's 32 in the pair
    layouts where the kernel reads them (the backend writes K and V there)."""
    from ringserve.model.compute.kernels import cpu_attention

    if (why := cpu_attention.reason()) is not None:
        pytest.skip(f"the C++ attention kernel: {why}")
    path = tiny_dir(arch)
    want = run_scenario(executor(path, "native", dtype=dtype))
    ex = executor(path, "cpu_kernel", dtype=dtype)
    assert getattr(ex.attn, "pairs", False) == (arch == "llama" and dtype == "bfloat16" and cpu_attention.reads_pairs())
    got = run_scenario(ex)
    if dtype == "float32":
        assert_close(got, want)
        return
    for g, w in zip(got, want, strict=True):
        assert np.abs(g - w).max() <= 0.02 * np.abs(w).max()
        assert (g.argmax(-1) == w.argmax(-1)).mean() >= 0.75


def test_pallas_interpret_greedy_matches_hf(tiny_dir):
    path = tiny_dir("llama")
    ex = ModelExecutor(
        path, dataclasses.replace(parity.CFG, attention_backend="pallas", attention_interpret=True)
    )
    # the prefix step and the remainders' step (48 and 1 + 9 + 30 tokens) share the T = 64 program
    prompts = parity.prompts_with_shared_prefix(48, [1, 9, 30])
    ours = parity.greedy_with_cached_prefix(ex, prompts, 48, 4)
    assert ours == hf_greedy(path, prompts, 4)


TP_SCRIPT = r"""
import json, sys
import numpy as np
from tests.model.test_attention import executor, run_scenario
ex = executor(sys.argv[1], "pallas", tp_size=2)
np.savez(sys.argv[2], *run_scenario(ex))
print(json.dumps({"kv": repr(tuple(ex.kv_pool.kv[0].sharding.spec))}))
"""


def test_pallas_interpret_tp2_matches_native(tiny_dir, native, tmp_path):
    """The kernel per device under shard_map, each device over its own 2 of the 4 KV heads."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    out = tmp_path / "logits.npz"
    cmd = [sys.executable, "-c", TP_SCRIPT, str(tiny_dir("llama")), str(out)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["kv"].startswith("(None, None, 'tp'")
    with np.load(out) as got:
        assert_close([got[f"arr_{i}"] for i in range(len(got.files))], native)


def test_auto_picks_the_cpu_kernel_on_one_cpu_device_only(monkeypatch):
    from ringserve.model.compute.kernels import cpu_attention
    from ringserve.model.compute.plan import resolve_backend

    monkeypatch.setattr(cpu_attention, "reason", lambda: None)
    assert resolve_backend("auto", "cpu") == "cpu_kernel"
    assert resolve_backend("auto", "cpu", tp=2) == "native"  # the kernel is not sharded over tp
    assert resolve_backend("auto", "gpu") == "bucketed"
    with pytest.raises(ValueError, match=r"attention_backend='cpu_kernel' needs tp_size=1 \(got 2\)"):
        resolve_backend("cpu_kernel", "cpu", tp=2)
    with pytest.raises(
        ValueError, match="attention_backend='cpu_kernel' runs on CPU only; this platform is 'tpu'"
    ):
        resolve_backend("cpu_kernel", "tpu")
    monkeypatch.setattr(cpu_attention, "reason", lambda: "no C++ compiler (g++, or $CXX)")
    assert resolve_backend("auto", "cpu") == "native"  # falls back, with the reason logged
    with pytest.raises(ValueError, match=r"'cpu_kernel' is not available here: no C\+\+ compiler"):
        resolve_backend("cpu_kernel", "cpu")


def _to_pairs(k, v):
    """Native-layout caches k [Hkv, P, D, 16], v [Hkv, P, 16, D] in the pair layouts
    (model/compute/attention/cpu_kernel.py): k [Hkv, P, D/2, 16, 2], v [Hkv, P, 8, D, 2]."""
    hkv, p, d, s = k.shape
    return (k.reshape(hkv, p, d // 2, 2, s).transpose(0, 1, 2, 4, 3),
            v.reshape(hkv, p, s // 2, 2, d).transpose(0, 1, 2, 4, 3))  # fmt: skip


def _pairs_case(d, heads=(6, 2), window=0, kv_len=(37, 40, 32, 0), new=(1, 21, 1, 0), q_dtype="bf16", seed=0, env=None):
    """The kernel on bf16 caches in the pair layouts: rows of `kv_len` keys of which the last
    `new` are this step's queries (a decode, an extend, a decode at a page's end, a padding row),
    pages of 16 scattered over layer 1's range. Returns (out, reference with f32 softmax,
    reference with the kernel's rounding: probabilities normalised, then rounded to bf16). `env`:
    run it in a fresh process with these variables (RINGSERVE_AMX=0: without the tiles)."""
    import jax
    import jax.numpy as jnp

    from ringserve.model.compute.kernels import cpu_attention

    if not cpu_attention.reads_pairs():
        pytest.skip("the kernel reads the pair layouts where the CPU has AVX512-BF16")
    # the same keys, values, pages and queries (by row and position) whatever the case's rows
    rng = np.random.default_rng(seed)
    (h, hkv), s, num_pages, layers, per = heads, 16, 24, 2, 4  # rows of up to 64 keys
    k = jnp.asarray(rng.normal(size=(hkv, layers * num_pages, d, s)).astype(np.float32)).astype(jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(hkv, layers * num_pages, s, d)).astype(np.float32)).astype(jnp.bfloat16)
    kv_len, new = np.array(kv_len, np.int32), list(new)
    rows = len(kv_len)
    pages = rng.permutation(np.arange(1, num_pages))[: rows * per].reshape(rows, per).astype(np.int32)
    q_all = rng.normal(size=(rows, per * s, h, d)).astype(np.float32)
    row_start = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    positions = np.concatenate([np.arange(kv_len[r] - new[r], kv_len[r]) for r in range(rows)]).astype(np.int32)
    q_rows = np.concatenate([q_all[r, kv_len[r] - new[r] : kv_len[r]] for r in range(rows)])
    q = jnp.asarray(q_rows).astype(jnp.bfloat16)
    kf, vf, qf = (np.asarray(a.astype(jnp.float32), np.float64) for a in (k, v, q))
    kp, vp = _to_pairs(jax.lax.bitcast_convert_type(k, jnp.uint16), jax.lax.bitcast_convert_type(v, jnp.uint16))
    scale = 1.0 / np.sqrt(d)
    args = dict(q=np.asarray(q if q_dtype == "bf16" else q.astype(jnp.float32)), k=np.asarray(kp), v=np.asarray(vp),
                pages=pages, row_start=row_start, kv_len=kv_len, positions=positions)  # fmt: skip
    if env is None:
        call = jax.ffi.ffi_call(cpu_attention.TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
        out = np.asarray(call(*(jnp.asarray(a) for a in args.values()), np.int32(num_pages), np.int32(window),
                              scale=np.float32(scale), softcap=np.float32(0)))  # fmt: skip
    else:
        out = _pairs_in_process(args, num_pages, window, scale, env)
    ref, ref16 = np.zeros_like(out), np.zeros_like(out)
    for r in range(rows):
        ids = [pages[r, j // s] + num_pages for j in range(kv_len[r])]  # layer 1's pages
        for t in range(row_start[r], row_start[r + 1]):
            lo = max(0, positions[t] - window + 1) if window else 0
            for head in range(h):
                g = head // (h // hkv)
                keys = np.stack([kf[g, ids[j], :, j % s] for j in range(lo, positions[t] + 1)])
                vals = np.stack([vf[g, ids[j], j % s, :] for j in range(lo, positions[t] + 1)])
                w = keys @ qf[t, head] * scale
                w = np.exp(w - w.max())
                ref[t, head] = w @ vals / w.sum()
                p16 = np.asarray(jnp.asarray((w / w.sum()).astype(np.float32)).astype(jnp.bfloat16).astype(jnp.float32))
                ref16[t, head] = p16 @ vals
    return out, ref, ref16


def _pairs_in_process(args, num_pages, window, scale, env):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        bf16 = args["q"].dtype != np.float32
        np.savez(os.path.join(tmp, "in.npz"), **(args | {"q": args["q"].view(np.uint16) if bf16 else args["q"]}))
        code = (
            "import sys, numpy as np, jax, jax.numpy as jnp\n"
            "from ringserve.model.compute.kernels import cpu_attention\n"
            "assert cpu_attention.reason() is None\n"
            "a = np.load(sys.argv[1])\n"
            "q = jnp.asarray(a['q']) if a['q'].dtype == np.float32 else jax.lax.bitcast_convert_type(jnp.asarray(a['q']), jnp.bfloat16)\n"
            "call = jax.ffi.ffi_call(cpu_attention.TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))\n"
            "out = call(q, *(jnp.asarray(a[n]) for n in ('k', 'v', 'pages', 'row_start', 'kv_len', 'positions')),"
            f" np.int32({num_pages}), np.int32({window}), scale=np.float32({scale!r}),"
            " softcap=np.float32(0))\n"
            "np.save(sys.argv[2], np.asarray(out))\n"
            "print(cpu_attention.uses_amx())\n"
        )
        out = os.path.join(tmp, "out.npy")
        done = subprocess.run([sys.executable, "-c", code, os.path.join(tmp, "in.npz"), out], capture_output=True,
                              text=True, env={**os.environ, **env}, cwd=Path(__file__).parents[2])  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split() == [str(env.get("RINGSERVE_AMX") != "0" and _amx())]
        return np.load(out)


def _amx() -> bool:
    from ringserve.model.compute.kernels import cpu_attention

    return cpu_attention.uses_amx()


@pytest.mark.parametrize("d, heads", [(64, (6, 2)), (128, (8, 1)), (32, (9, 3)), (64, (16, 1))])
def test_cpu_kernel_pair_layouts_match_the_reference(d, heads):
    """bf16 caches in the pair layouts (vdpbf16ps's and AMX's operands as they lie): each query's
    softmax over all its visible keys, its probabilities normalised then rounded to bf16, as HF's
    bf16 attention rounds them: within bf16's rounding of the f32 reference, and to f32 rounding
    of the same computation in float64 (where the exps' last bits round a probability the other
    way, one bf16 step of it); head dims 32, 64 and 128, 1 to 16 query heads a KV head; q in bf16
    or f32 (rounded to bf16 first)."""
    for q_dtype in ("bf16", "f32"):
        got, ref, ref16 = _pairs_case(d, heads=heads, q_dtype=q_dtype)
        np.testing.assert_allclose(got, ref, rtol=0, atol=8e-3)
        err = np.abs(got - ref16)
        assert np.median(err) < 1e-6 and err.max() < 2e-2, (np.median(err), err.max())


def test_cpu_kernel_pair_layouts_with_a_window_and_without_amx():
    """A sliding window (keys before it masked, pages before it skipped), with AMX where Linux
    lends it and without (RINGSERVE_AMX=0 in a fresh process: vdpbf16ps): both within bf16's
    rounding of the reference."""
    got, ref, _ = _pairs_case(64, heads=(6, 2), window=24, kv_len=(37, 60, 32, 0), new=(1, 40, 1, 0))
    np.testing.assert_allclose(got, ref, rtol=0, atol=8e-3)
    no_amx, _, _ = _pairs_case(64, heads=(6, 2), window=24, kv_len=(37, 60, 32, 0), new=(1, 40, 1, 0),
                               env={"RINGSERVE_AMX": "0"})  # fmt: skip
    np.testing.assert_allclose(no_amx, ref, rtol=0, atol=8e-3)


def test_cpu_kernel_pair_layouts_give_a_query_the_same_bits_however_its_row_was_cut():
    """In the pair layouts a query's output depends only on its own keys: a row of 60 tokens
    computed in one step, as 2 chunks (37 + 23), and token by token from 55 (decode steps) gives
    every token the same bits (the chunked-prefill and decode invariance a temperature-0 output
    relies on), beside other rows of any length."""
    whole, _, _ = _pairs_case(64, kv_len=(60, 9), new=(60, 3), seed=3)
    first, _, _ = _pairs_case(64, kv_len=(37, 9), new=(37, 3), seed=3)
    second, _, _ = _pairs_case(64, kv_len=(60, 21), new=(23, 1), seed=3)
    np.testing.assert_array_equal(first[:37], whole[:37])
    np.testing.assert_array_equal(second[:23], whole[37:60])
    for pos in range(55, 60):
        step, _, _ = _pairs_case(64, kv_len=(pos + 1, 9), new=(1, 2), seed=3)
        np.testing.assert_array_equal(step[0], whole[pos])

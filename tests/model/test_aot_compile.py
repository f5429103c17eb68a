"""`ringserve compile` (actors/cli/compile.py, model/runtime/aot.py): the step programs a server
would compile, compiled by libtpu for TPU topologies on this CPU-only host.

The `tpu_aot` tests run `ringserve compile` in a subprocess per configuration (a module fixture
each, so the test process stays CPU JAX) and read its --json report; libtpu is installed by
tools/install_libtpu.sh where absent, and the tests are skipped with the reason where it cannot
be. A few programs each (a family's smallest and largest, `--ends`): a TPU compile is seconds.
The first tests need no libtpu: the HLO counting, the shapes and the estimate's arithmetic.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# ---- without libtpu -----------------------------------------------------------------------------

HLO = """HloModule step

%region_body.1 (arg: (s32[], bf16[8,4096])) -> (s32[], bf16[8,4096]) {
  %p = bf16[8,4096]{1,0} parameter(0)
  %all-reduce.1 = bf16[8,4096]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add
  %all-reduce-start.2 = (bf16[8,4096]{1,0}, bf16[8,4096]{1,0}) all-reduce-start(%p), to_apply=%add
  %all-reduce-done.2 = bf16[8,4096]{1,0} all-reduce-done(%all-reduce-start.2)
}

ENTRY %main.9 (a: bf16[8,4096]) -> f32[8,128256] {
  %w = (s32[], bf16[8,4096]) while(%t), condition=%cond.1, body=%region_body.1
  %ag = f32[8,128256]{1,0} all-gather(%x), dimensions={1}, replica_groups={{0,1,2,3}}
}
"""


def test_collectives_are_counted_per_layer_and_outside():
    from ringserve.model.runtime.aot import count_collectives

    c = count_collectives(HLO, scanned=True)
    assert c["all-reduce"]["per_layer"] == 2  # the async pair counted once
    assert c["all-reduce"]["bytes_per_layer"] == 2 * 8 * 4096 * 2
    assert c["all-gather"]["outside"] == 1 and c["all-gather"]["bytes_outside"] == 8 * 128256 * 4
    assert c["all-reduce"]["outside"] == 0
    unrolled = count_collectives(HLO, scanned=False)
    assert unrolled["all-reduce"]["per_layer"] == 0 and unrolled["all-reduce"]["outside"] == 2


@pytest.mark.parametrize(("name", "params"), [("llama-3-8b", 8_030_261_248), ("qwen3-8b", 8_190_735_360)])
def test_named_shapes_have_the_published_parameter_counts(name, params):
    from ringserve.model.checkpoints.config_shapes import model_config
    from ringserve.model.families import family

    mc, _ = model_config(name)
    assert sum(math.prod(p.hf_shape) for p in family(mc.family).layout(mc).values()) == params


def test_a_topology_or_shape_not_known_is_refused():
    from ringserve.model.checkpoints.config_shapes import model_config
    from ringserve.model.compute.tpu_topology import chip_of

    with pytest.raises(ValueError, match="v5e, v6e, v5p, v4"):
        chip_of("v9x:2x2")
    with pytest.raises(ValueError, match="llama-3-8b"):
        model_config("gpt-5")


# ---- compiled by libtpu ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def libtpu():
    """libtpu importable by `ringserve compile` (installed by tools/install_libtpu.sh if absent)."""
    import importlib.util

    from ringserve.model.compute.tpu_topology import LIBTPU_DIR

    if importlib.util.find_spec("libtpu") is None and not (LIBTPU_DIR / "libtpu").is_dir():
        env = dict(os.environ, PYTHON=sys.executable)
        r = subprocess.run(
            ["bash", str(ROOT / "tools" / "install_libtpu.sh")], env=env, capture_output=True, text=True
        )
        if r.returncode != 0:
            pytest.skip(f"libtpu could not be installed (tools/install_libtpu.sh: {r.stderr.strip()[-300:]})")
    return LIBTPU_DIR


def compile_report(tmp_path: Path, *flags: str) -> list[dict]:
    """`ringserve compile FLAGS --json` in a subprocess; its report."""
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "ringserve.actors.cli.main", "compile", *flags, "--json", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.is_file(), (
        f"ringserve compile wrote no report (exit {r.returncode}): {r.stdout[-2000:]}{r.stderr[-2000:]}"
    )
    return json.loads(out.read_text())


SMALL = ("--page-size", "16", "--max-running-requests", "8", "--max-prefill-tokens", "64", "--context-length", "512",
         "--chunked-prefill-size", "64", "--dtype", "bfloat16", "--ends", "--jobs", "2")  # fmt: skip


def _families(report: list[dict]) -> dict[str, list[dict]]:
    by: dict[str, list[dict]] = {}
    for p in report:
        by.setdefault(p["family"], []).append(p)
    return by


def _all_ok(report: list[dict]) -> None:
    failed = [(p["family"], p["tokens"], p["error"]) for p in report if not p["ok"]]
    assert not failed, failed
    for p in report:
        assert p["memory"]["argument"] > 0 and p["seconds"] > 0
        assert p["estimate"]["step_s"] > 0 and p["estimate"]["bound"] in ("HBM", "MXU", "ICI")


@pytest.fixture(scope="module")
def tiny_v5e(libtpu, tmp_path_factory):
    """The tiny model on one v5e chip: decode, extend (mixed steps run there) and verify, LoRA on
    (every program takes the adapter pool) and grammar masks (every program takes them)."""
    return compile_report(tmp_path_factory.mktemp("tiny-v5e"), "--topology", "v5e:1x1", "--model", "tiny", *SMALL,
                          "--enable-lora", "--speculative-algorithm", "ngram")  # fmt: skip


@pytest.mark.tpu_aot
def test_tiny_on_v5e_every_family_at_both_ends_compiles(tiny_v5e):
    _all_ok(tiny_v5e)
    by = _families(tiny_v5e)
    assert sorted(by) == ["decode", "extend", "verify"]
    assert all(len(v) == 2 for v in by.values())  # smallest and largest
    assert all(p["programs_total"] > len(tiny_v5e) for p in tiny_v5e)


@pytest.fixture(scope="module")
def tiny_v6e_multistep(libtpu, tmp_path_factory):
    return compile_report(tmp_path_factory.mktemp("tiny-v6e"), "--topology", "v6e:1x1", "--model", "tiny", *SMALL,
                          "--decode-steps", "4", "--families", "multistep,decode")  # fmt: skip


@pytest.mark.tpu_aot
def test_tiny_on_v6e_multistep_decode_compiles(tiny_v6e_multistep):
    _all_ok(tiny_v6e_multistep)
    assert sorted(_families(tiny_v6e_multistep)) == ["decode", "multistep"]


@pytest.fixture(scope="module")
def smollm2_v6e(libtpu, tmp_path_factory):
    return compile_report(tmp_path_factory.mktemp("smol-v6e"), "--topology", "v6e:1x1", "--model", "smollm2", *SMALL,
                          "--families", "decode,extend")  # fmt: skip


@pytest.mark.tpu_aot
@pytest.mark.sweep  # (the launcher's test below compiles SmolLM2 in CI)
def test_smollm2_on_v6e_decode_and_extend_compile(smollm2_v6e):
    _all_ok(smollm2_v6e)
    decode = min((p for p in smollm2_v6e if p["family"] == "decode"), key=lambda p: p["rows"])
    # one chip: no collectives; a decode step reads at least the weights (SmolLM2: 135 M bf16, tied)
    assert not decode["collectives_per_layer"] and not decode["collectives_outside_layers"]
    assert decode["estimate"]["weight_bytes_per_chip"] >= 2 * 134_000_000
    assert decode["estimate"]["bound"] == "HBM"


def _llama(tmp: Path, topology: str, tp: int) -> list[dict]:
    """Llama-3-8B's shape, one decode program (2 rows) at tp."""
    return compile_report(tmp, "--topology", topology, "--model", "llama-3-8b", "--tp-size", str(tp), "--page-size",
                          "64", "--max-running-requests", "2", "--context-length", "2048", "--dtype", "bfloat16",
                          "--families", "decode", "--jobs", "1")  # fmt: skip


@pytest.fixture(scope="module", params=[("v5e:2x2", 4), pytest.param(("v6e:2x4", 8), marks=pytest.mark.sweep)],
                ids=["v5e-tp4", "v6e-tp8"])
def llama_tp(libtpu, tmp_path_factory, request):
    topology, tp = request.param
    return _llama(tmp_path_factory.mktemp(f"llama-{tp}"), topology, tp)


@pytest.mark.tpu_aot
def test_llama3_8b_tensor_parallel_has_two_all_reduces_per_layer(llama_tp):
    _all_ok(llama_tp)
    (decode,) = llama_tp
    assert decode["collectives_per_layer"] == {"all-reduce": 2}  # Megatron: after attention and after the MLP


@pytest.mark.tpu_aot
def test_llama3_8b_tensor_parallel_never_gathers_the_full_logits(llama_tp):
    (decode,) = llama_tp
    vocab_row = 128256 * 2  # one row of bf16 logits
    gathers = decode["collectives"]["all-gather"]
    assert gathers["bytes_outside"] < decode["rows"] * vocab_row


@pytest.mark.tpu_aot
def test_the_launchers_own_flags_compile(libtpu, tmp_path):
    """tools/launch_tpu.sh --dry-run on a host without TPU runs `ringserve compile` for its own
    flags on a v5e chip (launch-plan's for SmolLM2: one chip a replica, pages of 128, 256 running
    requests, bf16, ringserve's kernel over the unpadded KV, the pool sized by HBM): SmolLM2's
    smallest decode program."""
    out = tmp_path / "launcher.json"
    env = dict(os.environ, RINGSERVE_BIN=str(Path(sys.executable).parent / "ringserve"),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               RINGSERVE_COMPILE_ARGS=f"--programs decode:min --jobs 1 --json {out}")  # fmt: skip
    r = subprocess.run(["bash", str(ROOT / "tools" / "launch_tpu.sh"), "--dry-run", "--topology", "v5e:1x1", "--model",
                        "smollm2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert "--page-size 128" in r.stdout and "--attention-backend pallas_ragged" in r.stdout, r.stdout + r.stderr
    assert out.is_file(), r.stdout + r.stderr
    report = json.loads(out.read_text())
    assert [(p["family"], p["page_size"], p["tp_size"]) for p in report] == [("decode", 128, 1)]
    _all_ok(report)
    assert r.returncode == 0

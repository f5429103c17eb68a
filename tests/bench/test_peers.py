"""bench/peers.py, bench/peer_systems.py, bench/proc_tree.py without any peer installed: the
workload, the figures and ratios, the commands, skipping with a reason, GGUF requantizing, and
the process-tree sampler."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ringserve.bench import peer_systems as ps
from ringserve.bench import peers
from ringserve.bench.proc_tree import TreeSampler, tree_pids, tree_usage


def test_workload_is_seeded_within_ranges_and_single_differs_from_burst():
    wl = peers.make_workload(49152, seed=0, burst=64, single=8)
    assert wl == peers.make_workload(49152, seed=0, burst=64, single=8)
    assert len(wl.burst) == 64 and len(wl.single) == 8
    for r in wl.burst + wl.single:
        assert 32 <= r.prompt_len <= 512 and 32 <= r.output_len <= 256
        assert min(r.prompt) >= 3 and max(r.prompt) < 49152
    burst_prompts = {tuple(r.prompt[:8]) for r in wl.burst}
    assert not any(tuple(r.prompt[:8]) in burst_prompts for r in wl.single)


def _run(system, rnd, **figs):
    return {"system": system, "round": rnd, **figs}


def test_headline_medians_and_ratios():
    burst = {"output_throughput": 100.0, "ttft_ms_median": 2500.0}
    single = {"itl_ms_median": 40.0, "ttft_ms_median": 700.0}
    assert peers.headline(burst, single) == {"out_tok_s": 100.0, "ttft_median_s": 2.5, "single_itl_ms": 40.0,
                                             "single_ttft_ms": 700.0}  # fmt: skip
    runs = [
        _run("ringserve", 1, out_tok_s=100.0, single_itl_ms=40.0, peak_rss_mb=1000.0, cores_busy=1.5),
        _run("vllm", 1, out_tok_s=200.0, single_itl_ms=20.0, peak_rss_mb=4000.0, cores_busy=1.8),
        _run("ringserve", 2, out_tok_s=120.0, single_itl_ms=50.0, peak_rss_mb=1200.0),
        _run("vllm", 2, out_tok_s=300.0, single_itl_ms=30.0, error="2 requests failed"),  # not counted
        _run("llamacpp", 1, error="exited with 1 before it was ready"),
    ]
    med = peers.medians(runs)
    assert med == {"ringserve": {"out_tok_s": 110.0, "single_itl_ms": 45.0, "peak_rss_mb": 1100.0, "cores_busy": 1.5},
                   "vllm": {"out_tok_s": 200.0, "single_itl_ms": 20.0, "peak_rss_mb": 4000.0, "cores_busy": 1.8},
                   "llamacpp": {}}  # fmt: skip
    rat = peers.ratios(med)
    # throughput: ours / theirs; latency and memory: theirs / ours (> 1: ringserve better);
    # cores busy is reported, never a ratio
    assert rat == {"vllm": {"out_tok_s": 0.55, "single_itl_ms": 20.0 / 45.0, "peak_rss_mb": 4000.0 / 1100.0},
                   "llamacpp": {}}  # fmt: skip
    assert peers.ratios(med, reference="absent") == {}
    table = peers.format_ratios(rat, "ringserve")
    assert "0.55x" in table and "3.64x" in table
    rows = peers.format_runs(runs).splitlines()
    assert len(rows) == 6 and "error: exited with 1" in rows[-1]


def test_a_missing_peer_has_a_reason_naming_the_install_script(tmp_path):
    layout = ps.Layout(tmp_path)
    assert ps.missing(ps.system("ringserve"), layout) is None
    assert "tools/install_peers.sh vllm" in ps.missing(ps.system("vllm-bf16"), layout)
    assert "tools/install_peers.sh llamacpp" in ps.missing(ps.system("llamacpp-q8_0"), layout)
    for p in (layout.vllm, layout.llama_server):
        p.parent.mkdir(parents=True)
        p.write_text("")
    assert ps.missing(ps.system("vllm"), layout) is None and ps.missing(ps.system("llamacpp"), layout) is None
    with pytest.raises(ValueError, match="unknown system 'sglang'"):
        ps.system("sglang")


def test_a_ringserve_system_at_a_tag_runs_another_checkout(tmp_path):
    """`NAME@TAG` (bench.peers --tree TAG=DIR): ringserve system NAME served from checkout DIR,
    with its own name in the report; a peer, or a tag not given, is refused by name."""
    s = ps.system("ringserve-bf16@before", {"before": str(tmp_path)})
    assert (s.name, s.kind, s.precision, s.tree) == ("ringserve-bf16@before", "ringserve", "bf16", str(tmp_path))
    assert ps.system("ringserve-bf16").tree == ""
    with pytest.raises(ValueError, match="'vllm@before': a ringserve system @ a tag"):
        ps.system("vllm@before", {"before": str(tmp_path)})
    with pytest.raises(ValueError, match="'ringserve@old': a ringserve system @ a tag given by --tree old=DIR"):
        ps.system("ringserve@old", {"before": str(tmp_path)})


def test_commands_bind_localhost_with_the_same_limits():
    layout = ps.Layout(Path("/p"))
    lim = ps.Limits(max_len=768, parallel=64, threads=2)
    d = Path("/m/smollm2")
    r = ps.launch(ps.system("ringserve-bf16"), d, 4000, lim, layout, ("--page-size", "32"))
    assert r.argv[1:] == ["-m", "ringserve.actors.cli.main", "serve", "--model", "/m/smollm2", "--host", "127.0.0.1", "--port",
                          "4000", "--no-socket", "--dtype", "bfloat16", "--context-length", "768",
                          "--max-running-requests", "64", "--log-level", "warning", "--page-size", "32"]  # fmt: skip
    q = ps.launch(ps.system("ringserve-int8"), d, 4000, lim, layout)
    assert q.argv[q.argv.index("--dtype"):][:2] == ["--dtype", "bfloat16"] and q.argv[-2:] == ["--quantization", "int8"]
    m = ps.launch(ps.system("ringserve-int8-ds4"), d, 4000, lim, layout)
    assert m.argv[len(q.argv):] == ["--decode-steps", "4"] and m.argv[: len(q.argv)] == q.argv
    v = ps.launch(ps.system("vllm"), d, 4001, lim, layout)
    assert v.argv == ["/p/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m/smollm2", "--host", "127.0.0.1", "--port", "4001", "--dtype",
                      "float32", "--max-model-len", "768", "--max-num-seqs", "64", "--seed", "0"]  # fmt: skip
    assert v.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    g = ps.launch(ps.system("llamacpp-q8_0"), Path("/m/x.gguf"), 4002, lim, layout)
    assert g.argv == ["/p/llamacpp/bin/llama-server", "-m", "/m/x.gguf", "--host", "127.0.0.1", "--port", "4002",
                      "-t", "2", "-tb", "2", "-c", str(64 * 768), "-np", "64", "--seed", "0"]  # fmt: skip


def test_main_skips_absent_peers_with_their_reasons(tmp_path, capsys):
    out = tmp_path / "report.json"
    rep = peers.main(["--model", "tiny", "--systems", "vllm", "llamacpp", "--peers-dir", str(tmp_path / "none"),
                      "--output-json", str(out), "--rounds", "1"])  # fmt: skip
    assert rep["runs"] == [] and rep["ratios"] == {}
    assert set(rep["skipped"]) == {"vllm", "llamacpp"}
    assert json.loads(out.read_text())["skipped"] == rep["skipped"]
    text = capsys.readouterr().out
    assert "skipped vllm: vLLM for CPU is not installed" in text and "(no ratios: they need" in text


def _tiny_gguf(path: Path) -> dict[str, np.ndarray]:
    import gguf

    rng = np.random.default_rng(0)
    w = {"blk.0.attn_q.weight": rng.standard_normal((8, 64)).astype(np.float32),
         "blk.0.attn_norm.weight": rng.standard_normal(64).astype(np.float32)}  # fmt: skip
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_file_type(3)  # MOSTLY_Q4_1
    writer.add_context_length(128)
    writer.add_token_list(["<pad>", "a", "b"])
    q = gguf.quants.quantize(w["blk.0.attn_q.weight"], gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("blk.0.attn_q.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("blk.0.attn_norm.weight", w["blk.0.attn_norm.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return w


def test_requantize_gguf_keeps_metadata_and_dequantized_values(tmp_path):
    import gguf

    _tiny_gguf(tmp_path / "src.gguf")
    src = gguf.GGUFReader(tmp_path / "src.gguf")
    exact = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in src.tensors}
    f32 = gguf.GGUFReader(ps.requantize_gguf(tmp_path / "src.gguf", tmp_path / "f32.gguf", "f32"))
    assert f32.fields["general.file_type"].contents() == 0
    assert f32.fields["llama.context_length"].contents() == 128
    assert f32.fields["tokenizer.ggml.tokens"].contents() == ["<pad>", "a", "b"]
    for t in f32.tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        np.testing.assert_array_equal(np.asarray(t.data).reshape(exact[t.name].shape), exact[t.name])
    q8 = gguf.GGUFReader(ps.requantize_gguf(tmp_path / "src.gguf", tmp_path / "q8.gguf", "q8_0"))
    types = {t.name: t.tensor_type.name for t in q8.tensors}
    assert types == {"blk.0.attn_q.weight": "Q8_0", "blk.0.attn_norm.weight": "F32"}
    assert q8.fields["general.file_type"].contents() == 7
    assert not list(tmp_path.glob("*.part"))
    with pytest.raises(ValueError, match="precision='q5_0'"):
        ps.requantize_gguf(tmp_path / "src.gguf", tmp_path / "x.gguf", "q5_0")


def test_tree_sampler_counts_children():
    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(64 << 20); time.sleep(30)"])
    try:
        import os
        import time

        deadline = time.monotonic() + 20
        while child.pid not in tree_pids(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = tree_pids(os.getpid())
        assert pids[0] == os.getpid() and child.pid in pids
        while tree_usage(child.pid)["rss_mb"] < 64 and time.monotonic() < deadline:
            time.sleep(0.05)
        s = TreeSampler(os.getpid(), interval=0.05).start()
        time.sleep(0.2)
        assert s.peak_pss_mb == 0  # the loop reads RSS only (statm): smaps_rollup costs the server CPU
        s.sample(pss=True)
        s.stop()
        assert s.peak_rss_mb >= tree_usage(child.pid)["rss_mb"] >= 64
        assert s.peak_pss_mb > 0
    finally:
        child.kill()
        child.wait()
    assert tree_pids(child.pid) == []


def test_a_server_that_dies_before_ready_fails_with_its_last_log_line(tmp_path):
    log = tmp_path / "server.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-c", "print('loading'); print('ValueError: no such model')\nraise SystemExit(3)"],
                                stdout=f, stderr=subprocess.STDOUT)  # fmt: skip
    with pytest.raises(
        peers.ServerFailed, match="exited with 3 before it was ready: ValueError: no such model"
    ):
        peers.wait_ready(proc, f"http://127.0.0.1:{peers.free_port()}", log, timeout=60)

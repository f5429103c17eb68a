"""AReaL's RemoteSGLangEngine, unmodified, against `ringserve serve`: greedy generate with
logprobs (SGLang's fields, Content-Type application/json), pause/continue mid-rollout resumed by
AReaL to the tokens of an uninterrupted run, update_weights_from_disk with abort_all_requests;
then AReaL's FSDPEngine weight sync over an update group (its own rendezvous and broadcasts,
gloo): the server then answers as HF transformers on the broadcast checkpoint."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.clients.conftest import ROOT, client_python, run_script
from tests.hf_ref import hf_greedy


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_areal_remote_sglang_engine(tmp_path, tiny_dir):
    areal = client_python("areal")
    from ringserve.model.checkpoints.tiny import make_tiny_model

    old, new = tiny_dir("llama"), make_tiny_model(tmp_path / "new", "llama", seed=1)
    newer = make_tiny_model(tmp_path / "newer", "llama", seed=2)  # what the trainer broadcasts
    prompt, max_new, long_new = [5, 17, 99, 123, 7], 12, 400
    port = _port()
    server = subprocess.Popen([sys.executable, "-m", "ringserve.actors.cli.main", "serve", "--model-path", str(old),
                               "--port", str(port), "--context-length", "512", "--max-running-requests", "8",
                               "--log-level", "warning"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None, server.stderr.read().decode()[-3000:] if server.stderr else ""
            time.sleep(0.5)
        cases = tmp_path / "cases.json"
        cases.write_text(json.dumps({"prompt": prompt, "max_new": max_new, "long_new": long_new, "new_model": str(new),
                                     "name_resolve_root": str(tmp_path / "name_resolve")}))  # fmt: skip
        out = run_script(areal, "areal_remote.py", f"127.0.0.1:{port}", str(cases), timeout=900)
        cases.write_text(json.dumps({"prompt": prompt, "max_new": max_new, "new_model": str(newer),
                                     "name_resolve_root": str(tmp_path / "name_resolve2")}))  # fmt: skip
        synced = run_script(areal, "areal_update_group.py", f"127.0.0.1:{port}", str(cases), timeout=900)
    finally:
        server.terminate()
        server.wait(timeout=60)
    want_old = hf_greedy(old, [prompt], long_new)[0]
    assert (
        out["first"] == want_old[:max_new] and out["first_stop"] == "length" and out["first_logprobs_ok"]
    ), out
    calls = out["interrupted_calls"]
    assert calls[0]["stop"] == "abort" and 0 < calls[0]["n"] < long_new, calls  # paused mid-way
    assert calls[1]["prompt_len"] == len(prompt) + calls[0]["n"] and calls[-1]["stop"] == "length", (
        calls
    )  # resubmitted
    assert (
        out["interrupted"] == want_old and out["interrupted_stop"] == "length"
    )  # the uninterrupted run's tokens
    assert out["after_update"] == hf_greedy(new, [prompt], max_new)[0]
    assert synced["after_update"] == hf_greedy(newer, [prompt], max_new)[0], synced

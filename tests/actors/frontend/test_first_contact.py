"""What a newcomer meets first: a common mistake ends in one line and exit status 2 before
anything loads (a model that is not there, a Hub id, a directory that is no model, options that
clash, a port in use), the traceback only with --log-level debug; a killed server's shared
memory is removed when the next one starts; OpenAI's chat rules (a message's content) and
errors that name the field the caller sent; the model's own sampling defaults."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[3]


def ringserve(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ringserve.actors.cli.main", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)  # fmt: skip


def one_line(r: subprocess.CompletedProcess) -> str:
    """The refusal: exit status 2, one line on stderr, no traceback."""
    lines = [x for x in r.stderr.splitlines() if x.strip() and not x.startswith("ringserve serve: removed")]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-3000:])
    return lines[0]


def test_a_hub_id_says_nothing_is_downloaded_and_how_to_get_a_model():
    line = one_line(ringserve("serve", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--port", "0"))
    assert line.startswith("ringserve serve: model 'HuggingFaceTB/SmolLM2-135M-Instruct': no such directory")
    assert "Hugging Face Hub id" in line and "never downloads" in line and "ringserve fetch-model smollm2" in line
    line = one_line(ringserve("generate", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct"))
    assert line.startswith("ringserve generate: model 'HuggingFaceTB/SmolLM2-135M-Instruct'")


def test_a_wrong_path_and_a_directory_that_is_no_model(tmp_path):
    line = one_line(ringserve("serve", "--model", str(tmp_path / "nope"), "--port", "0"))
    assert f"no such directory or .gguf file (looked for {tmp_path / 'nope'})" in line and "Hub" not in line
    line = one_line(ringserve("serve", "--model", str(tmp_path), "--port", "0"))
    assert "config.json: missing; a model directory needs config.json, *.safetensors and tokenizer files" in line


def test_options_that_clash_are_refused_before_anything_starts():
    line = one_line(ringserve("serve", "--model", "tiny", "--max-total-tokens", "16", "--port", "0"))
    assert line == "ringserve serve: max_total_tokens=16: must hold at least 2 pages of 16"
    r = ringserve("serve", "--model", "tiny", "--max-total-tokens", "16", "--port", "0", "--log-level", "debug")
    assert r.returncode != 0 and "Traceback" in r.stderr  # where it was raised, when asked


def test_a_port_in_use_is_told_before_the_model_loads():
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        t0 = time.monotonic()
        r = ringserve("serve", "--model", "tiny", "--port", str(port))
        took = time.monotonic() - t0
    line = one_line(r)
    assert line == (f"ringserve serve: --host 127.0.0.1 --port {port}: the address is in use; stop what holds it or "
                    "pass another --port (0: any free port)")  # fmt: skip
    assert "loading the model" not in r.stderr and took < 30  # (imports only: nothing was loaded)


def test_serve_removes_a_dead_servers_shared_memory_and_says_so():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    stale = Path(f"/dev/shm/rs-{pid}-0badc0de-first-contact-test")  # (the rings' names: rs-<pid>-<hex>-<edge>)
    stale.write_bytes(b"x")
    live = Path(f"/dev/shm/rs-{os.getpid()}-0badc0de-first-contact-test")  # this process lives: kept
    live.write_bytes(b"x")
    try:
        with socket.create_server(("127.0.0.1", 0)) as held:  # (a taken port ends it early)
            r = ringserve("serve", "--model", "tiny", "--port", str(held.getsockname()[1]))
        assert "ringserve serve: removed 1 shared-memory segments left by dead ringserve processes" in r.stderr
        assert not stale.exists() and live.exists()
    finally:
        stale.unlink(missing_ok=True)
        live.unlink(missing_ok=True)


def test_serve_help_is_in_sections_and_every_flag_says_its_default_once():
    from ringserve.actors.cli import generate, serve

    out = ringserve("serve", "--help").stdout
    for title in ("model compute", "memory:", "scheduling:", "speculative decoding:", "sampling and outputs:",
                  "LoRA adapters:", "parallelism:", "serving:"):  # fmt: skip
        assert title in out, title
    actions = [a for a in serve.parser()._actions if a.option_strings and a.dest != "help"]
    assert len(actions) >= 70
    for a in actions:  # every flag says what it does, and its default once
        assert a.help and len(a.help) > 12 and a.help.count("(default:") == 1, (a.option_strings, a.help)
    ap = generate._parser("ringserve generate", "")
    for a in ap._actions:
        if a.option_strings and a.dest != "help":
            assert a.help and "(default" in a.help, (a.option_strings, a.help)


# ---- OpenAI's chat rules and field names, through HTTP ---------------------------------------


def _chat(servers, messages, **kw):
    return httpx.post(servers.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 4, **kw},
                      timeout=60)  # fmt: skip


def test_a_chat_message_without_content_is_a_400_naming_it(servers):
    for bad in ({"role": "user"}, {"role": "user", "content": None}):
        r = _chat(servers, [bad])
        assert r.status_code == 400 and "messages[0].content: required" in r.json()["error"]["message"], r.text
    r = _chat(servers, [{"role": "system", "content": "be brief"}, {"role": "user"}])
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages[1].content: required")
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    ok = _chat(servers, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": calls},
                         {"role": "tool", "content": "42", "tool_call_id": "c1"}])  # fmt: skip
    assert ok.status_code == 200, ok.text  # an assistant's turn of tool calls has no content (OpenAI allows it)
    r = _chat(servers, [{"role": "user", "content": "hi", "tool_calls": calls}])
    assert r.status_code == 400 and "messages[0].tool_calls: only an assistant message" in r.text
    assert _chat(servers, [{"role": "user", "content": ""}]).status_code == 200  # empty, but given


def test_openai_errors_name_the_field_the_caller_sent(servers):
    r = _chat(servers, [{"role": "user", "content": "hi"}], max_tokens=100000)
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and msg.startswith("max_tokens=100000 exceeds the limit") and "max_new_tokens" not in msg
    r = _chat(servers, [{"role": "user", "content": "hi"}], max_completion_tokens=100000, max_tokens=None)
    assert r.json()["error"]["message"].startswith("max_completion_tokens=100000 exceeds")
    r = httpx.post(servers.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 100000}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens=100000 exceeds")
    r = _chat(servers, [{"role": "user", "content": "hi"}], max_tokens=0)
    assert r.status_code == 400 and r.json()["error"]["message"] == "max_tokens=0 must be >= 1"


# ---- the model's sampling defaults -------------------------------------------------------------


def test_the_model_sampling_defaults_fill_what_a_request_leaves_out(tiny_dir):
    from ringserve.actors.frontend.actor import TokenizerManager
    from ringserve.actors.frontend.inputs import GenerateArgs
    from ringserve.actors.server_args import ServerArgs
    from ringserve.model.checkpoints.tokenizer import load_tokenizer

    tm = TokenizerManager(load_tokenizer(tiny_dir("llama")), args=ServerArgs(max_total_tokens=65536), vocab_size=2048,
                          sampling_defaults={"temperature": 0.2, "top_p": 0.9, "max_new_tokens": 7})  # fmt: skip
    try:
        def sp(params=None):
            return tm.specs(GenerateArgs(input_ids=[5, 6, 7], sampling_params=params))[0][0].sampling

        got = sp()
        assert (got.temperature, got.top_p, got.top_k, got.max_new_tokens) == (0.2, 0.9, -1, 7)
        got = sp({"temperature": 0, "max_new_tokens": 3})  # what a request gives wins
        assert (got.temperature, got.top_p, got.max_new_tokens) == (0.0, 0.9, 3)
        assert sp({"temperature": None}).temperature == 0.2  # (None: left out)
        assert tm.model_info()["default_sampling_params"] == {"temperature": 0.2, "top_p": 0.9, "max_new_tokens": 7}
    finally:
        tm.close()


def test_generation_config_is_read_for_its_sampling_keys_alone(tmp_path, caplog):
    import json

    from ringserve.model.checkpoints.generation import read_sampling_defaults

    assert read_sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "eos_token_id": 2, "max_new_tokens": 512,
         "repetition_penalty": 1.0}))  # fmt: skip
    assert read_sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 512,
                                                "repetition_penalty": 1.0}  # fmt: skip
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "repetition_penalty": 1.1}))
    assert read_sampling_defaults(tmp_path) == {"temperature": 0.7, "repetition_penalty": 1.1}  # (a default like any)
    (tmp_path / "generation_config.json").write_text("[1]")
    assert read_sampling_defaults(tmp_path) == {} and read_sampling_defaults(tmp_path / "x.gguf") == {}


@pytest.mark.slow
def test_an_engine_serves_with_its_model_defaults_and_reports_them(tiny_dir, tmp_path):
    """A model whose generation_config.json sets temperature and top_p: a request that leaves
    them out samples exactly as one that gives them; get_model_info and /v1/models report them;
    `sampling_defaults="openai"` keeps the plain defaults (temperature 1)."""
    import json
    import shutil

    from ringserve import Servers
    from tests.engine.conftest import engine_ctx

    model = tmp_path / "tiny"
    shutil.copytree(tiny_dir("llama"), model)
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.3, "top_p": 0.8}))
    prompt = {"input_ids": [5, 6, 7, 8]}
    with engine_ctx(model) as e:
        assert e.get_model_info()["default_sampling_params"] == {"temperature": 0.3, "top_p": 0.8}
        left_out = e.generate(**prompt, sampling_params={"sampling_seed": 11, "max_new_tokens": 24})
        given = e.generate(**prompt, sampling_params={"sampling_seed": 11, "max_new_tokens": 24, "temperature": 0.3,
                                                      "top_p": 0.8})  # fmt: skip
        hot = e.generate(**prompt, sampling_params={"sampling_seed": 11, "max_new_tokens": 24, "temperature": 1.0})
        assert left_out["output_ids"] == given["output_ids"] != hot["output_ids"]
        with Servers(e, ipc=False, port=0) as s:
            model_row = httpx.get(s.url + "/v1/models", timeout=30).json()["data"][0]
            assert model_row["default_sampling_params"] == {"temperature": 0.3, "top_p": 0.8}
            assert httpx.get(s.url + "/get_model_info", timeout=30).json()["default_sampling_params"]["top_p"] == 0.8
    with engine_ctx(model, sampling_defaults="openai") as e:
        assert e.get_model_info()["default_sampling_params"] == {}
        plain = e.generate(**prompt, sampling_params={"sampling_seed": 11, "max_new_tokens": 24})
        hot = e.generate(**prompt, sampling_params={"sampling_seed": 11, "max_new_tokens": 24, "temperature": 1.0})
        assert plain["output_ids"] == hot["output_ids"]  # (seeded draws match within an engine's one shape)

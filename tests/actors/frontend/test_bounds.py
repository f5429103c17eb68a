"""The front doors' bounds: nesting depth (HTTP and the socket), prompt length checked before
tokenizing. Each refusal is a 400 / `Failed` / ValueError naming the field and the limit, the
server logs no traceback and carries on (issue 28, failures 2, 3 and 9)."""

from __future__ import annotations

import logging
import socket
import struct
import time

import httpx
import msgspec
import pytest

from ringserve.actors.frontend import protocol as p

enc = msgspec.msgpack.encode
GREEDY = {"temperature": 0, "ignore_eos": True}
MAX_DEPTH = 64  # actors/frontend/limits.py


def nest(depth: int, inner: bytes = b"1", kind: str = "list") -> bytes:
    """A JSON value `depth` containers deep around `inner`."""
    if kind == "list":
        return b"[" * depth + inner + b"]" * depth
    return b'{"a":' * depth + inner + b"}" * depth


DEEP_HTTP = [  # the bodies of issue 28, failure 2: each a 500 with a plain-text body before
    ("/generate", b'{"text":"a","sampling_params":{"stop":' + nest(494, b'"x"') + b"}}", "sampling_params"),
    ("/generate", b'{"input_ids":' + nest(50_000) + b"}", "input_ids"),
    ("/generate", b'{"text":"a","sampling_params":{"stop":' + nest(10_000, kind="dict") + b"}}", "sampling_params"),
    ("/v1/chat/completions", b'{"messages":[{"role":"user","content":[' + nest(10_000, kind="dict") + b"]}]}", "messages"),
    ("/open_session", b'{"session_id":' + nest(10_000) + b"}", "session_id"),
    ("/generate", nest(10_000), "request body"),
]


@pytest.mark.parametrize(("path", "body", "field"), DEEP_HTTP, ids=[f"{c[0]}-{i}" for i, c in enumerate(DEEP_HTTP)])
def test_http_deeply_nested_json_is_a_400_naming_the_field_and_the_limit(servers, path, body, field, caplog):
    with caplog.at_level(logging.ERROR):
        r = httpx.post(servers.url + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["message"].startswith(f"{field}: nested deeper than the limit of {MAX_DEPTH} levels"), err
    if path.startswith("/v1/"):
        assert r.json()["object"] == "error" and r.json()["code"] == 400
    assert not [rec for rec in caplog.records if rec.exc_info], "a traceback was logged"


def test_http_depth_limit_is_exact_and_brackets_in_strings_do_not_count(servers):
    def stop_at(depth: int) -> bytes:  # the body object is level 1, sampling_params 2, stop 3 ...
        return b'{"text":"a","sampling_params":{"stop":' + nest(depth - 2, b'"x"') + b"}}"

    ok = httpx.post(servers.url + "/generate", content=stop_at(MAX_DEPTH))
    assert ok.status_code == 400 and "nested deeper" not in ok.text and "stop" in ok.text  # a list of lists
    deep = httpx.post(servers.url + "/generate", content=stop_at(MAX_DEPTH + 1))
    assert deep.status_code == 400 and "sampling_params: nested deeper than the limit of 64 levels" in deep.text
    text = "[" * 70 + "{" * 10 + '\\"[' * 10 + "\\\\"  # 80 brackets, escaped quotes and a backslash
    body = msgspec.json.encode({"text": text, "sampling_params": {**GREEDY, "max_new_tokens": 1, "stop": ["[[[["]}})
    r = httpx.post(servers.url + "/generate", content=body)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 1


def _connect(servers) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(servers.socket_path)
    s.settimeout(20)
    return s


def _send(s: socket.socket, body: bytes) -> None:
    s.sendall(struct.pack("<I", len(body)) + body)


def _recv(s: socket.socket) -> p.Started | p.Chunk | p.Done | p.Failed | None:
    def exactly(n: int) -> bytes | None:
        out = b""
        while len(out) < n:
            got = s.recv(n - len(out))
            if not got:
                return None
            out += got
        return out

    head = exactly(4)
    if head is None:
        return None
    body = exactly(struct.unpack("<I", head)[0])
    return None if body is None else p.server_decoder.decode(body)


def _frame(tag: str, cid: int, **fields: bytes) -> bytes:
    """A client frame built by hand (values already msgpack), as msgspec lays it out."""
    out = bytes([0x80 + 2 + len(fields)]) + enc("type") + enc(tag) + enc("id") + enc(cid)
    for k, v in fields.items():
        out += enc(k) + v
    return out


def _mp_nest(depth: int, inner: bytes = b"\x01") -> bytes:
    return b"\x91" * depth + inner  # fixarray of one element, `depth` times


def _mp_dict_nest(depth: int) -> bytes:
    return (b"\x81" + enc("a")) * depth + b"\x01"  # fixmap {"a": ...}, `depth` times


DEEP_IPC = [  # issue 28, failure 3: the connection closed without a Failed before
    ("generate input_ids 100k deep", _frame("generate", 7, args=b"\x81" + enc("input_ids") + _mp_nest(100_000)),
     "args"),
    ("control kwargs 10k deep", _frame("control", 8, verb=enc("open_session"),
                                       kwargs=b"\x81" + enc("session_id") + _mp_dict_nest(10_000)), "kwargs"),
    ("sampling_params 200 deep", _frame("generate", 9, args=b"\x82" + enc("input_ids") + enc([5, 6]) + enc("sampling_params")
                                        + b"\x81" + enc("stop") + _mp_nest(200, enc("x"))), "sampling_params"),
    ("control kwargs 200 deep", _frame("control", 10, verb=enc("open_session"),
                                       kwargs=b"\x81" + enc("session_id") + _mp_dict_nest(200)), "open_session: session_id"),
]


@pytest.mark.parametrize(("frame", "field"), [c[1:] for c in DEEP_IPC], ids=[c[0] for c in DEEP_IPC])
def test_socket_deeply_nested_frame_gets_a_failed_naming_the_limit_and_the_connection_lives(engine, servers, frame,
                                                                                           field, caplog):  # fmt: skip
    s = _connect(servers)
    with caplog.at_level(logging.ERROR):
        _send(s, frame)
        f = _recv(s)
    assert isinstance(f, p.Failed), f
    assert f.kind == "ValueError" and f.id in (7, 8, 9, 10), f
    assert f.message.startswith(f"{field}: nested deeper than the limit of {MAX_DEPTH} levels"), f.message
    assert not [rec for rec in caplog.records if rec.exc_info], "a traceback was logged"
    _send(s, p.frame(p.Control(11, "get_load"))[4:])  # the same connection goes on
    ok = _recv(s)
    assert isinstance(ok, p.Done) and ok.id == 11 and ok.value["num_running_reqs"] == 0
    s.close()


def test_engine_deep_input_ids_element_is_a_value_error(engine):
    deep: list = [1]
    for _ in range(5000):  # deeper than repr() can go
        deep = [deep]
    with pytest.raises(ValueError, match=r"input_ids\[0\]: token id \[\[\[.*at position 0 is not an integer"):
        engine.generate(input_ids=[deep, 5])
    with pytest.raises(ValueError, match="sampling_params: nested deeper than the limit of 64 levels"):
        engine.generate(input_ids=[5, 6], sampling_params={"stop": deep})


# ---- prompt length before tokenizing (issue 28, failure 9) --------------------------------------
HUGE = "hello world " * 200_000  # 1,000,001 tokens of the tiny model


def test_a_text_that_cannot_fit_is_refused_without_tokenizing(engine, servers, monkeypatch):
    calls: list[int] = []
    tok = engine.frontend.tok  # what the frontend encodes with (a FastTokenizer once its spec is cached)
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, *a, **k: calls.append(len(text)) or encode(text, *a, **k))
    t0 = time.monotonic()
    r = httpx.post(servers.url + "/generate", json={"text": HUGE}, timeout=60)
    took = time.monotonic() - t0
    assert r.status_code == 400, r.text[:300]
    msg = r.json()["error"]["message"]
    assert msg.startswith("prompt: a text of 2,400,000 bytes is at least ") and "context length 256" in msg, msg
    with pytest.raises(ValueError, match=r"prompt\[1\]: a text of 2,400,000 bytes"):
        engine.generate([".", HUGE])
    r = httpx.post(servers.url + "/v1/completions", json={"prompt": HUGE}, timeout=60)
    assert r.status_code == 400 and "context length 256" in r.json()["error"]["message"]
    assert len(HUGE) not in calls, "the whole text was tokenized"
    assert took < 2.0, f"refusing took {took:.1f} s"


def test_a_text_that_may_fit_is_still_tokenized_and_checked_exactly(engine):
    text = "hello " * 300  # 1,800 bytes could be fewer than 256 tokens; tokenized, they are 901
    with pytest.raises(ValueError, match="input_ids: prompt of 901 tokens does not fit the context length 256"):
        engine.generate(text)
    out = engine.generate("hello " * 50, {**GREEDY, "max_new_tokens": 2})
    assert out["meta_info"]["prompt_tokens"] == len(engine.tokenizer.encode("hello " * 50))


def test_a_long_input_ids_prompt_is_refused_by_its_length_first(engine):
    ids = [5] * 10_000_000 + ["x"]
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="input_ids: prompt of 10000001 tokens does not fit the context length 256"):
        engine.generate(input_ids=ids)
    assert time.monotonic() - t0 < 1.0

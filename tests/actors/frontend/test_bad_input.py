"""Bad input over HTTP and the socket: each gets a clear error naming the field or the limit,
and the server and every other client carry on (a stream running meanwhile finishes exactly)."""

from __future__ import annotations

import socket
import struct
import time

import httpx
import msgspec
import pytest

from ringserve.actors.frontend import protocol as p
from ringserve.actors.frontend.inputs import GenerateArgs

GREEDY = {"temperature": 0, "ignore_eos": True}
SP = {**GREEDY, "max_new_tokens": 20}


@pytest.fixture
def running(engine, client):
    """A request streaming through the client while the bad input arrives; checked after."""
    want = engine.generate(input_ids=[7, 8, 9], sampling_params=SP)["output_ids"]
    stream = client.generate(input_ids=[7, 8, 9], sampling_params=SP, stream=True)
    chunks = [next(stream)]  # on a busy machine the whole output may come in this one chunk
    yield
    chunks += list(stream)
    assert chunks[-1]["output_ids"] == want


HTTP_CASES = [
    ("/generate", b"{not json", 400, ["malformed JSON"]),
    ("/generate", b'{"text": 5}', 400, ["text", "Expected `str | array | null`, got `int`"]),
    ("/generate", b'{"text": "hi", "temperature": 0.5}', 400, ["unknown field `temperature`"]),
    ("/generate", b'{"text": "hi", "sampling_params": {"top_p": 0}}', 400, ["top_p=0", "(0, 1]"]),
    ("/generate", b'{"text": "hi", "sampling_params": {"stop": 5}}', 400, ["sampling_params", "stop"]),
    ("/generate", b'{"text": "hi", "sampling_params": {"max_new_tokens": "ten"}}', 400, ["max_new_tokens", "expected int"]),
    ("/generate", b'{"input_ids": [5, 1000000]}', 400, ["input_ids", "1000000", "vocabulary"]),
    ("/generate", f'{{"input_ids": {list(range(3, 300))}}}'.encode(), 400, ["297 tokens", "context length 256"]),
    ("/generate", b'{"text": "hi", "image_data": "x.png"}', 400, ["image_data", "not supported"]),
    ("/generate", b'{"text": "hi", "top_logprobs_num": 50}', 400, ["top_logprobs_num", "[0, 5]"]),
    ("/pause_generation", b'{"mode": "sideways"}', 400, ["mode='sideways'", "abort"]),
    ("/abort_request", b'{"rid": 5}', 400, ["rid", "Expected `str`"]),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": -3}', 400, ["max_tokens=-3"]),
    ("/v1/completions", b'{"prompt": "hi", "presence_penalty": 2.5}', 400, ["presence_penalty=2.5", "[-2, 2]"]),
    ("/v1/completions", b'{"prompt": "hi", "logprobs": 77}', 400, ["top_logprobs_num=77"]),
    ("/v1/chat/completions", b'{"messages": []}', 400, ["messages", "empty"]),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "colour": "red"}', 400, ["unknown field `colour`"]),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "top_p": "high"}', 400, ["top_p", "got `str`"]),
    # issue 28, failure 4: an unknown role was rendered and answered 200
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "a"}]}', 400,
     ["messages[0].role='wizard'", "system", "user", "assistant", "tool", "developer"]),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a"}, {"role": ""}]}', 400, ["messages[1].role=''"]),
    # issue 28, failure 5: a number out of range named no field (`sampling_params[...]`)
    ("/generate", b'{"text": "hi", "sampling_params": {"temperature": 1e999}}', 400, ["temperature=inf", "[0, 1e4]"]),
    ("/generate", b'{"text": "hi", "sampling_params": [{"max_new_tokens": -1e999}]}', 400, ["max_new_tokens", "expected int"]),
    ("/generate", b'{"input_ids": [5, 1e999]}', 400, ["input_ids", "position 1"]),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 1e999}', 400, ["temperature"]),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1e999}]}]}',
     400, ["messages[0].content[0]"]),
    ("/generate", b'[{"text": "a"}]', 400, ["request body: Expected `object`, got `array`"]),
    ("/open_session", b'"x"', 400, ["request body: Expected `object`, got `str`"]),
]


@pytest.mark.parametrize(("path", "body", "status", "words"), HTTP_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(HTTP_CASES)])
def test_http_bad_input(servers, running, path, body, status, words):
    r = httpx.post(servers.url + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    for w in words:
        assert w in err["message"], (w, err)
    if path.startswith("/v1/"):  # OpenAI's shape too
        assert r.json()["object"] == "error" and r.json()["code"] == status


def test_http_oversize_body_is_413(servers, running):
    big = b'{"text": "' + b"x" * (65 << 20) + b'"}'
    r = httpx.post(servers.url + "/generate", content=big, timeout=60)
    assert r.status_code == 413 and "exceeds the limit of 67108864 bytes" in r.json()["error"]["message"]


def _raw(servers) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(servers.socket_path)
    s.settimeout(10)
    return s


def _reply(s: socket.socket) -> p.Failed | None:
    head = b""
    while len(head) < 4:
        got = s.recv(4 - len(head))
        if not got:
            return None
        head += got
    (n,) = struct.unpack("<I", head)
    body = b""
    while len(body) < n:
        body += s.recv(n - len(body))
    msg = p.server_decoder.decode(body)
    assert isinstance(msg, p.Failed)
    return msg


def _closed(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_socket_garbage_bytes(servers, running):
    s = _raw(servers)
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    f = _reply(s)
    assert f is not None and f.id == 0 and f.kind == "ValueError" and "exceeds the limit" in f.message
    assert _closed(s)


def test_socket_frame_announcing_4_gib(servers, running):
    s = _raw(servers)
    s.sendall(struct.pack("<I", 0xFFFFFFFF))
    f = _reply(s)
    assert f is not None and "frame of 4294967295 bytes exceeds the limit of 67108864 bytes" in f.message
    assert _closed(s)


def test_socket_frame_of_the_wrong_shape(servers, running):
    s = _raw(servers)
    body = msgspec.msgpack.encode({"rid": "a", "input_ids": [1, 2]})
    s.sendall(struct.pack("<I", len(body)) + body)
    f = _reply(s)
    assert f is not None and f.message.startswith("malformed frame")
    assert _closed(s)


def test_socket_truncated_frame_and_silent_client(engine, servers, running):
    silent = _raw(servers)  # connects and sends nothing: costs nothing, blocks nobody
    s = _raw(servers)
    body = msgspec.msgpack.encode(p.Generate(1, GenerateArgs(input_ids=[5, 6], sampling_params={"max_new_tokens": 50})))
    s.sendall(struct.pack("<I", len(body)) + body[: len(body) // 2])
    s.close()  # mid-frame: the server drops the connection, nothing was submitted
    time.sleep(0.2)
    assert engine.get_load()["num_waiting_reqs"] == 0
    silent.close()


def test_socket_bad_arguments_name_the_field(client, running):
    with pytest.raises(ValueError, match="sampling_params: unknown parameter"):
        client.generate("hi", {"beam_width": 3})
    with pytest.raises(ValueError, match="input_ids: token id 'x' at position 0 is not an integer"):
        client.generate(input_ids=["x"])


def test_engine_wrong_types_are_value_errors(engine):
    for sp, words in [({"stop": 5}, ["stop", "expected"]), ({"top_k": "3"}, ["top_k", "got str"]),
                      ({"ignore_eos": "yes"}, ["ignore_eos", "expected bool"]),
                      ({"stop_token_ids": [1, "a"]}, ["stop_token_ids"]), ({"n": 2.5}, ["n", "expected int"])]:  # fmt: skip
        with pytest.raises(ValueError) as e:
            engine.generate("hi", sp)
        for w in words:
            assert w in str(e.value), (w, str(e.value))

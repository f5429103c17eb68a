"""Weights pushed from another process: a trainer process pushes every tensor of another
checkpoint through `Client.update_weights_from_tensor` in small buckets, or over HTTP as
safetensors blobs; greedy outputs then equal a fresh Engine on that checkpoint. A pusher killed
half way, a body cut off, a stalled pusher and a refused push leave the old weights serving,
every segment unlinked (/dev/shm checked) and the update lock free.

The engine is the session's shared tiny engine (conftest.py); `restored` puts its own weights
back after each test."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from tests.actors.frontend.conftest import API_KEY
from tests.engine.conftest import SMALL, in_background, random_prompts

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 10}
PROMPTS = random_prompts(3, seed=71, lo=6, hi=30)
SMALL_BUCKET = 96 << 10  # 96 KiB: the tiny model's 12.5 MiB in ~140 buckets; embed (2 MiB) cut in 22 pieces


def outputs(engine) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def push_segments() -> list[str]:
    """This process's weight-push segments in /dev/shm (the server here is the test process)."""
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(f"rs-{os.getpid()}-") and "-push" in f)


def wait_no_segments(timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while push_segments():
        assert time.monotonic() < deadline, f"segments left behind: {push_segments()}"
        time.sleep(0.02)


def tensors(ck) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(ck / "model.safetensors"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from ringserve.model.checkpoints.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("push")
    return {seed: make_tiny_model(root / f"s{seed}", "llama", seed=seed) for seed in (1, 2)}


@pytest.fixture(scope="module")
def fresh(checkpoints):
    """Greedy outputs of a fresh Engine on each checkpoint (the references)."""
    from ringserve import Engine

    refs = {}
    for seed, ck in checkpoints.items():
        with Engine(str(ck), page_size=16, precompile=False, **SMALL) as e:
            refs[seed] = outputs(e)
    return refs


@pytest.fixture
def restored(engine):
    """The shared engine, its own weights put back afterwards; nothing left in /dev/shm."""
    before = outputs(engine)
    yield engine
    engine.continue_generation()
    assert engine.update_weights_from_disk(str(engine.model_dir), weight_version="restored")["success"]
    assert outputs(engine) == before
    assert push_segments() == []
    assert not engine.frontend.weights._lock.locked()


def pusher(socket_path: str, ck, *, bucket_bytes: int, version: str, stop_after: int | None = None) -> subprocess.Popen:
    """A trainer process: loads `ck`'s tensors and pushes them through a Client. With
    `stop_after`, it prints "half" after handing over that many tensors and then hangs."""
    script = textwrap.dedent(f"""
        import json, sys, time
        from safetensors.numpy import load_file
        from ringserve import Client

        named = list(load_file({str(ck / "model.safetensors")!r}).items())

        def gen():
            for i, item in enumerate(named):
                if i == {stop_after!r}:
                    print("half", flush=True)
                    time.sleep(600)
                yield item

        with Client({socket_path!r}) as c:
            print(json.dumps(c.update_weights_from_tensor(gen(), weight_version={version!r},
                                                          bucket_bytes={bucket_bytes})), flush=True)
    """)
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})  # fmt: skip


def test_a_second_process_pushes_every_tensor_in_small_buckets(restored, servers, checkpoints, fresh):
    import json

    import httpx

    from ringserve import Client

    engine = restored
    assert outputs(engine) != fresh[1]
    t, box = in_background(engine, PROMPTS, 200)  # a rollout runs: pause it as an RL loop does
    assert engine.pause_generation("retract")["success"]
    proc = pusher(servers.socket_path, checkpoints[1], bucket_bytes=SMALL_BUCKET, version="pushed-1")
    out, _ = proc.communicate(timeout=120)
    r = json.loads(out)
    new = tensors(checkpoints[1])
    assert r == {"success": True, "message": f"updated {len(new)} tensors", "weight_version": "pushed-1",
                 "bytes": sum(a.nbytes for a in new.values())}, r
    assert engine.continue_generation()["success"]
    t.join(60)
    assert "err" not in box
    assert outputs(engine) == fresh[1]
    meta = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["meta_info"]
    assert meta["weight_version"] == "pushed-1"
    assert push_segments() == []
    # the pushed weights read back, through the Client and HTTP (the serving dtype is float32)
    name = "model.embed_tokens.weight"  # the tensor cut into the most pieces
    with Client(servers.socket_path) as c:
        got = np.asarray(c.get_weights_by_name(name, truncate_size=300), np.float32)
    np.testing.assert_array_equal(got, new[name][:300])
    w = httpx.post(servers.url + "/get_weights_by_name", json={"name": "model.layers.3.mlp.down_proj.weight",
                                                               "truncate_size": 2}).json()  # fmt: skip
    np.testing.assert_array_equal(np.asarray(w, np.float32), new["model.layers.3.mlp.down_proj.weight"][:2])


def test_a_pusher_killed_half_way_leaves_the_old_weights_and_no_shared_memory(restored, servers, checkpoints):
    from ringserve import Client

    engine = restored
    before, version = outputs(engine), engine.get_server_info()["weight_version"]
    old_embed = engine.get_weights_by_name("model.embed_tokens.weight", truncate_size=4)
    assert engine.pause_generation("retract")["success"]
    proc = pusher(servers.socket_path, checkpoints[2], bucket_bytes=SMALL_BUCKET, version="never", stop_after=30)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "half"
        segs = push_segments()
        assert len(segs) == 2  # the server's two slots, only the owner may open them
        assert all(stat.S_IMODE(os.stat(f"/dev/shm/{s}").st_mode) == 0o600 for s in segs)
        assert engine.frontend.weights._lock.locked()  # the push is alive, its buckets staged
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    wait_no_segments()
    wait_unlocked(engine)
    # no part of the half-received update reaches the device: not now, not after a flush, not
    # after the weights are rebuilt from the host copy
    assert engine.continue_generation()["success"]
    assert outputs(engine) == before and engine.get_server_info()["weight_version"] == version
    assert engine.flush_cache()["success"]
    assert engine.release_memory_occupation(["weights"])["success"]
    assert engine.resume_memory_occupation(["weights"])["success"]
    assert outputs(engine) == before
    assert engine.get_weights_by_name("model.embed_tokens.weight", truncate_size=4) == old_embed
    # the next push (a subset: one norm) applies just that, none of the dead push's tensors
    norm = tensors(checkpoints[2])["model.norm.weight"]
    with Client(servers.socket_path) as c:
        r = c.update_weights_from_tensor({"model.norm.weight": norm}, weight_version="norm-only", bucket_bytes=4096)
    assert r == {"success": True, "message": "updated 1 tensors", "weight_version": "norm-only", "bytes": norm.nbytes}
    assert engine.get_weights_by_name("model.norm.weight", truncate_size=256) == norm.tolist()
    assert engine.get_weights_by_name("model.embed_tokens.weight", truncate_size=4) == old_embed


def test_a_push_while_requests_run_is_refused_and_dropped(restored, servers, checkpoints):
    from ringserve import Client

    engine = restored
    before = outputs(engine)
    t, box = in_background(engine, PROMPTS, 150)  # not paused
    with Client(servers.socket_path) as c:
        r = c.update_weights_from_tensor(tensors(checkpoints[1]), bucket_bytes=SMALL_BUCKET)
    assert r["success"] is False and "pause_generation" in r["message"], r
    t.join(60)
    assert "err" not in box and push_segments() == []
    assert outputs(engine) == before


def test_abort_all_requests_aborts_the_rollout_then_pushes(restored, servers, checkpoints, fresh):
    from ringserve import Client

    engine = restored
    t, box = in_background(engine, PROMPTS, 200)  # not paused: the flag makes it quiet
    with Client(servers.socket_path) as c:
        r = c.update_weights_from_tensor(tensors(checkpoints[1]), weight_version="aborted-first",
                                         bucket_bytes=SMALL_BUCKET, abort_all_requests=True)  # fmt: skip
    assert r["success"] and r["weight_version"] == "aborted-first", r
    t.join(60)
    assert [o["meta_info"]["finish_reason"]["type"] for o in box["out"]] == ["abort"] * len(PROMPTS)
    assert outputs(engine) == fresh[1]


def test_bad_tensors_from_a_client_are_refused_naming_them(restored, servers):
    from ringserve import Client

    engine = restored
    before = outputs(engine)
    with Client(servers.socket_path) as c:
        r = c.update_weights_from_tensor({"model.layers.9.mlp.up_proj.weight": np.zeros((640, 256), np.float32)})
        assert r["success"] is False and "'model.layers.9.mlp.up_proj.weight' is not a weight" in r["message"], r
        r = c.update_weights_from_tensor({"model.norm.weight": np.zeros(255, np.float32)})
        assert r["success"] is False and "'model.norm.weight' has shape (255,), the served model's is (256,)" in r["message"]
        with pytest.raises(ValueError, match="'model.norm.weight' has dtype int64"):
            c.update_weights_from_tensor({"model.norm.weight": np.zeros(256, np.int64)})
        with pytest.raises(ValueError, match="bucket_bytes=0"):
            c.update_weights_from_tensor({}, bucket_bytes=0)
        with pytest.raises(ValueError, match="slots=9"):
            c.update_weights_from_tensor({"model.norm.weight": np.ones(256, np.float32)}, slots=9)
        assert c.update_weights_from_tensor({})["message"] == "no tensors"
        assert c.health()
    assert push_segments() == [] and outputs(engine) == before


def test_a_stalled_pusher_times_out_and_a_cancelled_push_is_dropped(restored, servers):
    import threading

    from ringserve import AsyncClient
    from ringserve.actors.frontend import protocol as p

    engine = restored
    own = list(tensors(engine.model_dir).items())
    handed = threading.Event()

    def slow():  # hands over 20 tensors, then takes its time
        for i, item in enumerate(own):
            if i == 20:
                handed.set()
                time.sleep(2)
            yield item

    async def go() -> str:
        async with AsyncClient(servers.socket_path) as c:
            cid, q = await c._open(lambda cid: p.PushWeights(cid, 1 << 20, timeout=0.5))
            ready = await c._next(q)
            assert isinstance(ready, p.PushReady) and len(push_segments()) == 2
            with pytest.raises(ValueError) as e:
                await c._next(q)  # nothing sent: the server gives up
            assert push_segments() == []
            # a push its caller cancels half way
            task = asyncio.ensure_future(c.update_weights_from_tensor(slow(), bucket_bytes=SMALL_BUCKET))
            while not handed.is_set():
                await asyncio.sleep(0.01)
            assert len(push_segments()) == 2
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return str(e.value)

    text = asyncio.run(go())
    assert "no bucket for 0.5 s (timeout)" in text, text
    wait_no_segments()
    wait_unlocked(engine)
    assert engine.get_server_info()["weight_version"] != "" and engine.health()


def wait_unlocked(engine) -> None:
    deadline = time.monotonic() + 10
    while engine.frontend.weights._lock.locked():
        assert time.monotonic() < deadline, "the update lock is still held"
        time.sleep(0.02)


# ---- HTTP ------------------------------------------------------------------------------------
def _post(url: str, body, query: str = "", key: str | None = None, ctype: str = "application/octet-stream"):
    import httpx

    headers = {"content-type": ctype} | ({"authorization": f"Bearer {key}"} if key else {})
    return httpx.post(url + "/update_weights_from_tensor" + query, content=body, headers=headers, timeout=120)


def test_http_push_of_safetensors_blobs_equals_a_fresh_engine(restored, servers, checkpoints, fresh):
    from ringserve.actors.frontend.weight_buckets import safetensors_stream

    engine = restored
    assert engine.pause_generation("retract")["success"]
    new = tensors(checkpoints[2])
    r = _post(servers.url, safetensors_stream(new, SMALL_BUCKET), "?weight_version=http-2&flush_cache=true")
    assert r.status_code == 200, r.text
    assert r.json() == {"success": True, "message": f"updated {len(new)} tensors", "weight_version": "http-2",
                        "bytes": sum(a.nbytes for a in new.values())}
    engine.continue_generation()
    assert outputs(engine) == fresh[2] and push_segments() == []


def test_http_push_refusals_name_the_tensor_and_field(restored, servers, served_with_key):
    import json
    import struct

    from ringserve.actors.frontend.weight_buckets import safetensors_stream

    engine = restored
    before = outputs(engine)
    assert engine.pause_generation("retract")["success"]

    def blob(header: dict, data: bytes) -> bytes:
        h = json.dumps(header).encode()
        return struct.pack("<Q", len(h)) + h + data

    one = {"dtype": "F32", "shape": [256], "data_offsets": [0, 1024]}
    cases = [
        (blob({"model.nope.weight": one}, bytes(1024)), 400, ["model.nope.weight", "not a weight"]),
        (blob({"model.norm.weight": {**one, "shape": [128], "data_offsets": [0, 512]}}, bytes(512)), 400,
         ["'model.norm.weight' has shape (128,), the served model's is (256,)"]),
        (blob({"model.norm.weight": {**one, "dtype": "I32"}}, bytes(1024)), 400, ["bucket 0: tensor 'model.norm.weight' dtype"]),
        (blob({"model.norm.weight": one}, bytes(1000)), 400, ["bucket 0: the body ends after 1000 of the blob's 1024"]),
        (b"".join(safetensors_stream({"model.norm.weight": np.ones(256, np.float32)}, 4096)) + b"\x01\x02", 400,
         ["bucket 1: the body ends inside the 8-byte header length"]),
    ]  # fmt: skip
    for body, status, words in cases:
        r = _post(servers.url, body)
        assert r.status_code == status, (r.status_code, r.text)
        for w in words:
            assert w in r.text, (w, r.text)
    r = _post(servers.url, b"{}", ctype="application/json")
    assert r.status_code == 415 and "application/octet-stream" in r.text
    r = _post(servers.url, b"", "?flush=1")
    assert r.status_code == 400 and "flush: unknown argument" in r.text
    r = _post(servers.url, b"", "?flush_cache=maybe")
    assert r.status_code == 400 and "flush_cache='maybe'" in r.text
    # auth as every admin route: 401 without the key, the push with it
    norm = np.asarray(engine.get_weights_by_name("model.norm.weight", truncate_size=256), np.float32)
    body = list(safetensors_stream({"model.norm.weight": norm}, 4096))
    assert _post(served_with_key.url, body).status_code == 401
    r = _post(served_with_key.url, body, "?weight_version=keyed", key=API_KEY)
    assert r.status_code == 200 and r.json()["weight_version"] == "keyed", r.text
    engine.continue_generation()
    assert outputs(engine) == before and push_segments() == []


def read_response(s: socket.socket) -> str:
    """One whole HTTP/1.1 response (head and Content-Length body) off a raw socket."""
    s.settimeout(30)
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += s.recv(65536)
    return (head + b"\r\n\r\n" + body).decode()


def test_an_http_client_that_stalls_or_disconnects_half_way_leaves_the_old_weights(restored, servers, checkpoints):
    from urllib.parse import urlparse

    from ringserve.actors.frontend.weight_buckets import safetensors_stream

    engine = restored
    before = outputs(engine)
    assert engine.pause_generation("retract")["success"]
    body = b"".join(safetensors_stream(tensors(checkpoints[1]), SMALL_BUCKET))
    u = urlparse(servers.url)
    for stall in (True, False):
        with socket.create_connection((u.hostname, u.port)) as s:
            query = "weight_version=cut" + ("&timeout=0.5" if stall else "")
            s.sendall(f"POST /update_weights_from_tensor?{query} HTTP/1.1\r\nHost: x\r\n"
                      f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n\r\n".encode())  # fmt: skip
            s.sendall(body[: len(body) // 2])
            deadline = time.monotonic() + 10
            while not push_segments():  # the server is reading it
                assert time.monotonic() < deadline
                time.sleep(0.01)
            if stall:  # the server gives up on its own while the connection stays open
                answer = read_response(s)
                assert answer.startswith("HTTP/1.1 400") and "no data for 0.5 s (timeout)" in answer, answer
                assert push_segments() == []
            else:
                time.sleep(0.3)  # some buckets staged, then the client is gone
        wait_no_segments()
        wait_unlocked(engine)
    engine.continue_generation()
    assert outputs(engine) == before and engine.get_server_info()["weight_version"] != "cut"


def test_deltas_from_the_client_and_over_http(restored, servers):
    """A delta through each other door: the Client's ("add" of Rows and a whole tensor), HTTP's
    (Rows cut over blobs); each against its base, refused on another (nothing changes), a bad
    mode a ValueError / 400 naming the field."""
    from ringserve import Client, Rows
    from ringserve.actors.frontend.weight_buckets import safetensors_stream

    engine = restored
    E, N = "model.embed_tokens.weight", "model.norm.weight"

    def served() -> tuple[np.ndarray, np.ndarray]:
        return (np.asarray(engine.get_weights_by_name(E, truncate_size=4096), np.float32),
                np.asarray(engine.get_weights_by_name(N, truncate_size=256), np.float32))  # fmt: skip

    v = engine.get_server_info()["weight_version"]
    emb, norm = served()
    rows, d = np.full((3, 256), 0.125, np.float32), np.full(256, 0.5, np.float32)
    with Client(servers.socket_path) as c:
        r = c.update_weights_from_tensor({E: Rows(10, rows), N: d}, weight_version="c1", mode="add",
                                         base_weight_version=v, bucket_bytes=4096)  # fmt: skip
        assert r == {"success": True, "message": "updated 2 tensors", "weight_version": "c1", "bytes": rows.nbytes + d.nbytes}
        emb[10:13] += rows
        norm += d
        r = c.update_weights_from_tensor({N: d}, mode="add", base_weight_version=v)  # made against the old version
        assert r["success"] is False and f"base_weight_version={v!r} but the engine serves 'c1'" in r["message"], r
        with pytest.raises(ValueError, match=r"mode='sub' must be one of \['replace', 'add'\]"):
            c.update_weights_from_tensor({N: d}, mode="sub")
    got = served()
    np.testing.assert_array_equal(got[0], emb)
    np.testing.assert_array_equal(got[1], norm)
    block = np.full((40, 256), -1.0, np.float32)
    r = _post(servers.url, safetensors_stream({E: Rows(100, block)}, 8192), "?weight_version=h1&base_weight_version=c1")
    assert r.status_code == 200 and r.json() == {"success": True, "message": "updated 1 tensors", "weight_version": "h1",
                                                 "bytes": block.nbytes}, r.text  # fmt: skip
    emb[100:140] = block
    r = _post(servers.url, safetensors_stream({N: d}), "?mode=add&base_weight_version=c1")
    assert r.status_code == 400 and "base_weight_version='c1' but the engine serves 'h1'" in r.text, r.text
    r = _post(servers.url, safetensors_stream({N: d}), "?mode=sub")
    assert r.status_code == 400 and "mode='sub' must be one of ['replace', 'add']" in r.text, r.text
    got = served()
    np.testing.assert_array_equal(got[0], emb)
    np.testing.assert_array_equal(got[1], norm)
    assert engine.get_server_info()["weight_version"] == "h1" and push_segments() == []

"""Shutdown paths that always finish: the socket file and its directory are removed however the
engine ends (an actor killed, the servers failing to start, the engine shut down first), and a
client left open never blocks the interpreter's exit (issue 28, failures 1 and 8)."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import httpx
import pytest

from tests.engine.conftest import SMALL


@pytest.mark.parametrize("actor", ["scheduler", "runner", "detokenizer"])
def test_a_killed_actor_leaves_no_socket_file_or_directory(tiny_dir, actor):
    from ringserve import Engine, Servers

    engine = Engine(str(tiny_dir("llama")), page_size=16, supervise=False, **SMALL)
    try:
        servers = Servers(engine, port=0).start()  # the socket in a private directory made for it
        path, made = servers.socket_path, os.path.dirname(servers.socket_path)
        assert os.path.exists(path) and os.path.isdir(made)
        os.kill(engine.group.pid(actor), signal.SIGKILL)
        deadline = time.monotonic() + 20
        while engine.frontend.dead is None:
            assert time.monotonic() < deadline, "the frontend never saw the actor die"
            time.sleep(0.05)
        servers.stop()  # what `ringserve serve` runs when the engine died
        assert not os.path.exists(path) and not os.path.exists(made)
        with pytest.raises(httpx.ConnectError):
            httpx.get(servers.url + "/health", timeout=2)
    finally:
        engine.shutdown()


def test_servers_that_fail_to_start_leave_no_socket(engine, servers, tmp_path, monkeypatch):
    from ringserve import Servers

    taken = servers.port  # HTTP cannot bind a port that is in use
    sock = tmp_path / "d" / "s.sock"
    sock.parent.mkdir(mode=0o700)
    with pytest.raises(OSError, match="did not start"):
        Servers(engine, socket=str(sock), port=taken).start()
    assert not sock.exists()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # where the private directory is made
    with pytest.raises(OSError, match="did not start"):
        Servers(engine, port=taken).start()
    assert sorted(os.listdir(tmp_path)) == ["d"]


def test_an_engine_shut_down_under_its_servers_takes_the_socket_with_it(tiny_dir):
    from ringserve import Engine, Servers

    engine = Engine(str(tiny_dir("llama")), page_size=16, **SMALL)
    servers = Servers(engine, port=0, http=False).start()
    path = servers.socket_path
    engine.shutdown()  # the servers were never stopped
    assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path))
    servers.stop()  # still fine afterwards


# ---- clients left open -----------------------------------------------------------------------
def _run(script: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-W", "always::ResourceWarning", "-c", textwrap.dedent(script)],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})  # fmt: skip


def test_a_client_left_open_at_module_level_does_not_hang_the_exit(servers):
    t0 = time.monotonic()
    try:
        r = _run(f"""
            from ringserve import Client
            c = Client({servers.socket_path!r})
            print(c.generate(input_ids=[5, 6], sampling_params={{"max_new_tokens": 2, "temperature": 0}})["output_ids"])
        """, timeout=40)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("the interpreter hung at exit on a Client left open")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().startswith("[") and "ResourceWarning: unclosed Client" in r.stderr, r.stderr[-2000:]
    assert time.monotonic() - t0 < 30


def test_a_client_left_open_in_a_thread_and_an_async_client_do_not_hang_the_exit(servers):
    r = _run(f"""
        import asyncio, threading
        from ringserve import AsyncClient, Client
        box = []
        t = threading.Thread(target=lambda: box.append(Client({servers.socket_path!r})))
        t.start(); t.join()
        box[0].get_load()

        async def main():
            c = AsyncClient({servers.socket_path!r})
            await c.connect()
            await c.get_load()
            return c
        kept = asyncio.run(main())  # its loop is gone; the client was never closed
        print("done")
    """, timeout=40)  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr[-2000:]
    assert "unclosed Client" in r.stderr and "unclosed AsyncClient" in r.stderr, r.stderr[-2000:]


def test_a_client_dropped_unclosed_warns_and_lets_go_of_its_connection(servers):
    from ringserve import Client

    before = servers.ipc.num_connections
    c = Client(servers.socket_path)
    c.get_load()
    assert servers.ipc.num_connections == before + 1
    with pytest.warns(ResourceWarning, match="unclosed Client"):
        del c
        gc.collect()
    deadline = time.monotonic() + 10
    while servers.ipc.num_connections > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert servers.ipc.num_connections == before


def test_closing_a_client_whose_loop_is_gone_returns_at_once(servers):
    from ringserve import Client

    c = Client(servers.socket_path)
    c._lt.loop.call_soon_threadsafe(c._lt.loop.stop)  # the loop thread ends under the client
    c._lt.thread.join(5)
    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c.close()
    assert time.monotonic() - t0 < 1
    c.close()

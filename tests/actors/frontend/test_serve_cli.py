"""`ringserve serve` as a user runs it, and what it must never expose: private socket and shared
memory, HTTP on localhost by default, 401 without the API key; SIGTERM under load; the TPU
launcher's dry run."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.actors.frontend.conftest import API_KEY
from tests.engine.conftest import SMALL

ROOT = Path(__file__).resolve().parents[3]


def test_socket_and_shared_memory_are_private_and_http_is_local(engine, servers):
    from ringserve.actors.server_args import ServerArgs

    mode = os.stat(servers.socket_path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(servers.socket_path)).st_mode) == 0o700
    names = engine.group.ring_names
    assert len(names) == 6  # five rings and the groups' load board
    for name in names:
        base = name.lstrip("/")
        files = [f"/dev/shm/{base}"] + [f"/dev/shm/{f}" for f in os.listdir("/dev/shm") if f.startswith(f"sem.{base}-")]
        assert len(files) >= (1 if base.endswith("-loads") else 3)
        for f in files:
            assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f
    assert ServerArgs().host == "127.0.0.1" and servers.host == "127.0.0.1"
    assert servers._http.servers[0].sockets[0].getsockname()[0] == "127.0.0.1"


def test_api_key(served_with_key):
    url = served_with_key.url
    assert httpx.get(url + "/v1/models").status_code == 401
    r = httpx.post(url + "/generate", json={"text": "hi"}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200 and r.json()["data"]
    assert httpx.get(url + "/health").status_code == 200  # load balancers probe without the key


def test_launch_tpu_dry_run_on_cpu():
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "RINGSERVE_LIBTPU_DIR": "/nonexistent"}  # fmt: skip -- no compile here (tests/model/test_aot_compile.py)
    r = subprocess.run(["bash", str(ROOT / "tools/launch_tpu.sh"), "--dry-run", "--model", "smollm2", "--port", "31001"],
                       capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "JAX sees no TPU on this host (it sees 4 cpu device(s))" in r.stderr
    line = r.stdout.strip()
    assert line.startswith("env JAX_PLATFORMS=tpu ") and " serve " in line
    # SmolLM2's 9 query / 3 KV heads split over no 4 chips: data parallel (actors/cli/launch_plan.py)
    # and, its head_dim 64 padded to 128 lanes by jax's kernel, ringserve's kernel
    for flag in ("--dp-size 4 --tp-size 1", "--dtype bfloat16", "--attention-backend pallas_ragged", "--page-size 128",
                 "--decode-bucket-step 0", "--model smollm2", "--port 31001"):  # fmt: skip
        assert flag in line, flag
    r = subprocess.run(["bash", str(ROOT / "tools/launch_tpu.sh"), "--model", "tiny"], capture_output=True, text=True,
                       env=env, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "no TPU on this host" in r.stderr


def test_launch_tpu_dry_run_on_a_multi_host_slice():
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "JAX_PLATFORMS": "cpu", "TPU_WORKER_HOSTNAMES": "w0,w1,w2,w3", "TPU_WORKER_ID": "2"}  # fmt: skip
    env.pop("RINGSERVE_DIST_TOKEN", None)
    r = subprocess.run(["bash", str(ROOT / "tools/launch_tpu.sh"), "--dry-run", "--model", "m"], capture_output=True,
                       text=True, env=env, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "--tp-size 16 --nnodes 4 --node-rank 2 --dist-init-addr w0:8476 " in r.stdout  # 4 hosts x 4 chips
    assert "RINGSERVE_DIST_TOKEN" in r.stderr
    del env["TPU_WORKER_ID"]
    r = subprocess.run(["bash", str(ROOT / "tools/launch_tpu.sh"), "--dry-run"], capture_output=True, text=True, env=env,
                       timeout=120)  # fmt: skip
    assert r.returncode != 0 and "set TPU_WORKER_ID" in r.stderr


def test_sigterm_under_load_exits_within_10s_callers_get_abort_nothing_left(tiny_dir, xla_cache, tmp_path):
    """SIGTERM to the server's whole process group, as Ctrl-C in a terminal or a harness's killpg
    sends it: only the server acts on it (its actors have sessions of their own), so nothing is
    taken for a crash and restarted while it shuts down."""
    from ringserve import Client

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "xla").symlink_to(xla_cache)  # the session's compiled programs: a quick start
    sock = tmp_path / "s" / "engine.sock"
    sock.parent.mkdir(mode=0o700)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ringserve.actors.cli.main", "serve", "--model", str(tiny_dir("llama")), "--socket", str(sock),
         "--port", "0", "--page-size", "16", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "RINGSERVE_CACHE": str(cache), "PYTHONPATH": str(ROOT)}, start_new_session=True,
    )  # fmt: skip
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(proc.stderr or []), daemon=True).start()  # never let it fill
    try:
        url = None
        assert proc.stdout is not None
        for line in proc.stdout:
            m = re.search(r"HTTP\s+(http://127\.0\.0\.1:\d+)", line)
            if m:
                url = m.group(1)
            if "stops it" in line:
                break
        assert url is not None, "no banner: " + "".join(err)[-3000:]
        pid = proc.pid
        assert any(f.startswith(f"rs-{pid}-") for f in os.listdir("/dev/shm"))
        finals: dict[str, dict] = {}
        started = threading.Barrier(5)

        def stream(i: int) -> None:
            with Client(str(sock)) as c:
                last = None
                for k, chunk in enumerate(c.generate(input_ids=[5 + i, 6, 7], stream=True,
                                                     sampling_params={"max_new_tokens": 240, "temperature": 0, "ignore_eos": True})):  # fmt: skip
                    last = chunk
                    if k == 2:
                        started.wait(30)
                finals[f"ipc{i}"] = last

        def http_stream() -> None:
            body = {"input_ids": [9, 9, 9], "stream": True, "sampling_params": {"max_new_tokens": 240, "ignore_eos": True}}
            with httpx.stream("POST", url + "/generate", json=body, timeout=60) as r:
                last = None
                for k, line in enumerate(x for x in r.iter_lines() if x.startswith("data: {")):
                    last = line
                    if k == 2:
                        started.wait(30)
                import json

                finals["http"] = json.loads(last[6:])

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)] + [threading.Thread(target=http_stream)]
        for t in threads:
            t.start()
        started.wait(60)  # every caller is mid-stream
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(15)
        took = time.monotonic() - t0
        for t in threads:
            t.join(15)
        assert code == 0, "".join(err)[-3000:]
        assert took < 10, f"took {took:.1f} s"
        assert not re.search(r"restart|died|failed", "".join(err)), "".join(err)[-3000:]
        assert sorted(finals) == ["http", "ipc0", "ipc1", "ipc2"]
        for name, last in finals.items():
            assert last["meta_info"]["finish_reason"]["type"] == "abort", (name, last["meta_info"])
            assert 3 <= len(last["output_ids"]) < 240
        assert not any(f.startswith(f"rs-{pid}-") or f.startswith(f"sem.rs-{pid}-") for f in os.listdir("/dev/shm"))
        assert not sock.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_second_server_on_a_live_socket_is_refused(engine, servers):
    from ringserve import Servers

    with pytest.raises(ValueError, match="another server is listening"):
        Servers(engine, socket=servers.socket_path, http=False).start()
    assert os.path.exists(servers.socket_path)

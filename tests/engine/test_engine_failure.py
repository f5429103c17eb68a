"""Without the supervisor (supervise=False), a dead actor takes the engine down cleanly: pending
requests get an error naming the actor, new calls are refused, and no shared-memory segment is
left behind. (With it, tests/engine/test_supervisor.py.)"""

from __future__ import annotations

import glob
import os
import signal
import threading
import time

import pytest

from tests.engine.conftest import SMALL


def decoding_in_background(engine):
    """A long generate() in a thread, returned once it is decoding; box gets its error."""
    box: dict = {}

    def go():
        try:
            engine.generate(
                input_ids=[[5, 6, 7]] * 2,
                sampling_params={"max_new_tokens": 200, "temperature": 0, "ignore_eos": True},
            )
        except BaseException as e:
            box["err"] = e

    t = threading.Thread(target=go)
    t.start()
    while engine.get_server_info()["forward_ct_decode"] < 2:
        time.sleep(0.01)
    return t, box


def test_runner_killed_mid_generation_fails_requests_and_cleans_up(tiny_llama):
    from ringserve.actors.frontend.engine import Engine
    from ringserve.actors.frontend.errors import EngineDead

    engine = Engine(str(tiny_llama), page_size=16, supervise=False, **SMALL)
    try:
        names = engine.group.ring_names

        def left() -> list[str]:  # segments and their semaphores (sem.<name>-...)
            return [p for n in names for p in glob.glob(f"/dev/shm/*{n.lstrip('/')}*")]

        assert len(left()) >= len(names)
        t, box = decoding_in_background(engine)
        os.kill(engine.group.pid("runner"), signal.SIGKILL)
        t.join(10)
        assert not t.is_alive(), "a pending request hung after its runner died"
        assert isinstance(box.get("err"), EngineDead) and "runner" in str(box["err"])
        with pytest.raises(EngineDead):
            engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2})
        assert engine.group.wait_closed(10)
        assert left() == []
    finally:
        engine.shutdown()


def test_shutdown_fails_pending_requests_instead_of_hanging(tiny_llama):
    from ringserve.actors.frontend.engine import Engine
    from ringserve.actors.frontend.errors import EngineDead

    engine = Engine(str(tiny_llama), page_size=16, **SMALL)
    t, box = decoding_in_background(engine)
    engine.shutdown()
    t.join(10)
    assert not t.is_alive() and isinstance(box.get("err"), EngineDead)
    with pytest.raises(EngineDead):
        engine.generate(input_ids=[5, 6])


SCRIPT = """
from ringserve.actors.frontend.engine import Engine
e = Engine({path!r}, max_running_requests=4, context_length=128, max_prefill_tokens=64, max_total_tokens=2048)
print(e.generate(input_ids=[5, 6, 7], sampling_params={{"max_new_tokens": 4, "temperature": 0}})["meta_info"]["completion_tokens"])
e.shutdown()
"""


def test_engine_at_the_top_level_of_a_script_without_main_guard(tiny_llama, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "rollout.py"
    script.write_text(SCRIPT.format(path=str(tiny_llama)))
    r = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "4"

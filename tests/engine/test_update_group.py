"""SGLang's weight-update groups (actors/runner/weight_group.py): a trainer in another process
(bench/group_trainer.py: rank 0 as slime's and AReaL's update code makes it, over gloo)
broadcasts another checkpoint; afterwards greedy outputs equal a fresh engine's on it. A trainer
killed mid-broadcast leaves the old weights serving and the group left; a new group's update
then works. Bad arguments are ValueErrors naming the field, over the Engine and HTTP."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.engine.conftest import SMALL, assert_no_leak, random_prompts

pytest.importorskip("torch")

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 10}
PROMPTS = random_prompts(3, seed=61, lo=5, hi=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def greedy(engine) -> list:
    return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


class Trainer:
    """The trainer's process: joined once `engine_side()` (the engine's init call) returns."""

    def __init__(self, world_size: int, group: str, checkpoint: Path, *extra: str, dtype: str = "float32"):
        self.port, self.group, self.checkpoint = free_port(), group, checkpoint
        self.proc = subprocess.Popen([sys.executable, "-m", "ringserve.bench.group_trainer", str(self.port),
                                      str(world_size), group, str(checkpoint), "--dtype", dtype, *extra],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        from ringserve.bench.group_trainer import specs

        self.names, self.dtypes, self.shapes = specs(str(checkpoint), dtype)

    def join(self, init) -> dict:
        r = init(master_address="127.0.0.1", master_port=self.port, rank_offset=1,
                 world_size=self.world_size, group_name=self.group)  # fmt: skip
        assert self.proc.stdout is not None
        if r["success"]:
            assert self.proc.stdout.readline().strip() == "joined"
        return r

    @property
    def world_size(self) -> int:
        return int(self.proc.args[4])  # type: ignore[index]

    def send(self, update) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return update(names=self.names, dtypes=self.dtypes, shapes=self.shapes, group_name=self.group)

    def quit(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from ringserve.model.checkpoints.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("group")
    return [make_tiny_model(root / f"s{seed}", "llama", seed=seed) for seed in (0, 1)]


@pytest.fixture(scope="module")
def want(checkpoints):
    """Greedy outputs of a fresh engine on each checkpoint."""
    from ringserve import Engine

    out = []
    for ck in checkpoints:
        with Engine(str(ck), page_size=16, precompile=False, **SMALL) as e:
            out.append(greedy(e))
    assert out[0] != out[1]
    return out


@pytest.fixture(scope="module")
def engine(checkpoints):
    from ringserve import Engine

    e = Engine(str(checkpoints[0]), page_size=16, weight_group_timeout=60, **SMALL)
    yield e
    e.shutdown()


def test_a_trainer_broadcasts_another_checkpoint(engine, checkpoints, want):
    assert greedy(engine) == want[0]
    version = engine.get_server_info()["weight_version"]
    t = Trainer(2, "g1", checkpoints[1])
    try:
        r = t.join(engine.init_weights_update_group)
        assert r["success"], r
        assert "as rank 1 of 2 (gloo)" in r["message"]
        r = t.send(engine.update_weights_from_distributed)
        assert r["success"], r
        assert r["weight_version"] != version
        assert t.proc.stdout.readline().startswith("sent")  # type: ignore[union-attr]
        assert greedy(engine) == want[1]
        # the group stays for the next update, versioned by the caller
        r = t.send(lambda **kw: engine.update_weights_from_distributed(**kw, weight_version="again"))
        assert r["success"] and r["weight_version"] == "again", r
        assert greedy(engine) == want[1]
    finally:
        assert engine.destroy_weights_update_group("g1")["success"]
        t.quit()
    assert not engine.destroy_weights_update_group("g1")["success"]  # left already
    assert_no_leak(engine)


def test_a_trainer_killed_mid_broadcast_leaves_the_old_weights(engine, checkpoints, want):
    r = engine.update_weights_from_disk(str(checkpoints[0]))
    assert r["success"], r
    version = r["weight_version"]
    dying = Trainer(2, "g2", checkpoints[1], "--die-after", "3")
    r = dying.join(engine.init_weights_update_group)
    assert r["success"], r
    r = dying.send(engine.update_weights_from_distributed)
    assert not r["success"] and "the old weights keep serving" in r["message"], r
    assert r["weight_version"] == version
    dying.proc.wait(timeout=30)
    assert greedy(engine) == want[0]
    assert not engine.destroy_weights_update_group("g2")["success"]  # the failed group was left
    # a new trainer, a new group (the same name is free again): the next update works
    t = Trainer(2, "g2", checkpoints[1])
    try:
        assert t.join(engine.init_weights_update_group)["success"]
        r = t.send(engine.update_weights_from_distributed)
        assert r["success"], r
        assert greedy(engine) == want[1]
    finally:
        engine.destroy_weights_update_group("g2")
        t.quit()
    assert_no_leak(engine)


def test_a_trainer_that_stalls_past_the_timeout_leaves_the_old_weights(checkpoints, want):
    """A trainer alive but silent mid-broadcast: after --weight-group-timeout the runner leaves
    the group with a clear error; the old weights serve on."""
    from ringserve import Engine

    with Engine(str(checkpoints[0]), page_size=16, weight_group_timeout=3, precompile=False, **SMALL) as e:
        t = Trainer(2, "slow", checkpoints[1], "--stall-after", "2")
        try:
            assert t.join(e.init_weights_update_group)["success"]
            r = t.send(e.update_weights_from_distributed)
            assert not r["success"] and "the old weights keep serving" in r["message"], r
            assert greedy(e) == want[0]
            assert not e.destroy_weights_update_group("slow")["success"]  # left already
        finally:
            t.quit()
        assert_no_leak(e)


def test_a_refused_update_is_still_received_and_dropped(engine, checkpoints, want):
    """Busy (a request running, not paused): refused, yet the runner takes part in every
    broadcast (the trainer finishes) and the group stays usable."""
    from tests.engine.conftest import in_background

    r = engine.update_weights_from_disk(str(checkpoints[0]))
    assert r["success"], r
    t = Trainer(2, "g3", checkpoints[1])
    try:
        assert t.join(engine.init_weights_update_group)["success"]
        th, box = in_background(engine, PROMPTS[:1], 200)
        r = t.send(engine.update_weights_from_distributed)
        th.join()
        assert not r["success"] and "refused" in r["message"], r
        assert t.proc.stdout.readline().startswith("sent")  # type: ignore[union-attr]
        assert greedy(engine) == want[0]
        r = t.send(engine.update_weights_from_distributed)
        assert r["success"], r
        assert greedy(engine) == want[1]
    finally:
        engine.destroy_weights_update_group("g3")
        t.quit()


def test_bf16_over_the_wire(engine, checkpoints):
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import load_file

    t = Trainer(2, "g4", checkpoints[1], dtype="bfloat16")
    try:
        assert t.join(engine.init_weights_update_group)["success"]
        assert t.dtypes[0] == "bfloat16"
        r = t.send(engine.update_weights_from_distributed)
        assert r["success"], r
    finally:
        engine.destroy_weights_update_group("g4")
        t.quit()
    name = "model.layers.0.mlp.down_proj.weight"
    sent = load_file(next(Path(checkpoints[1]).glob("*.safetensors")))[name]
    got = np.asarray(engine.get_weights_by_name(name, 4), np.float32)
    np.testing.assert_array_equal(got, sent[:4].astype(ml_dtypes.bfloat16).astype(np.float32))
    assert not np.array_equal(got, sent[:4])  # (the values were rounded: bf16 arrived)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(master_port=0), "master_port=0 must be a port in [1, 65535]"),
        (dict(master_port="x"), "master_port='x' must be a port in [1, 65535]"),
        (dict(rank_offset=0), "rank_offset=0 must be an integer >= 1"),
        (dict(world_size=1), "world_size=1 must be at least rank_offset + the engine's 1 runner(s) = 2"),
        (dict(backend="mpi"), "backend='mpi': choose one of ['gloo', 'nccl']"),
        (dict(group_name=""), "group_name='' must be a non-empty string"),
    ],
)
def test_bad_group_arguments_name_the_field(engine, kw, message):
    args = dict(master_address="127.0.0.1", master_port=29555, rank_offset=1, world_size=2) | kw
    with pytest.raises(ValueError) as e:
        engine.init_weights_update_group(**args)
    assert message in str(e.value)


def test_a_delta_over_the_group_checks_its_base(engine, checkpoints, want):
    """base_weight_version: another base is refused (still received and dropped, so the trainer's
    broadcast completes); the right one applies."""
    r = engine.update_weights_from_disk(str(checkpoints[0]), weight_version="base-0")
    assert r["success"], r
    t = Trainer(2, "g5", checkpoints[1])
    try:
        assert t.join(engine.init_weights_update_group)["success"]
        r = t.send(lambda **kw: engine.update_weights_from_distributed(**kw, base_weight_version="other"))
        assert not r["success"] and "base_weight_version='other' but the engine serves 'base-0'" in r["message"], r
        assert t.proc.stdout.readline().startswith("sent")  # type: ignore[union-attr]
        assert greedy(engine) == want[0]
        r = t.send(lambda **kw: engine.update_weights_from_distributed(**kw, base_weight_version="base-0"))
        assert r["success"], r
        assert greedy(engine) == want[1]
    finally:
        engine.destroy_weights_update_group("g5")
        t.quit()
    with pytest.raises(ValueError, match=r"mode='sub'"):
        engine.update_weights_from_distributed(["a"], ["float32"], [[2]], mode="sub")


def test_bad_update_arguments_and_http(engine):
    """(Last: stopping the Servers stops the engine taking requests.)"""
    with pytest.raises(ValueError, match=r"dtypes: tensor 'a' has dtype 'int8'"):
        engine.update_weights_from_distributed(["a"], ["int8"], [[2]])
    with pytest.raises(ValueError, match=r"names, dtypes and shapes must have one entry per tensor \(got 2, 1, 1\)"):
        engine.update_weights_from_distributed(["a", "b"], ["float32"], [[2]])
    with pytest.raises(ValueError, match=r"shapes: tensor 'a' has shape \[-1\]"):
        engine.update_weights_from_distributed(["a"], ["float32"], [[-1]])
    # not joined: a refusal (nothing was sent), the weights unchanged
    r = engine.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]], group_name="nope")
    assert not r["success"] and "'nope' is not joined" in r["message"], r
    from ringserve import Servers

    with Servers(engine, ipc=False, port=0) as s:
        r = httpx.post(s.url + "/init_weights_update_group",
                       json={"master_address": "127.0.0.1", "master_port": "70000", "rank_offset": 1, "world_size": 2})
        assert r.status_code == 400 and "master_port=70000" in r.text, r.text
        r = httpx.post(s.url + "/destroy_weights_update_group", json={"group_name": "nope"})
        assert r.status_code == 400 and r.json()["success"] is False, r.text  # (SGLang: 400 when not success)

"""A trainer's JAX arrays update an Engine whose runner is a thread of the trainer's process
(`runner_in_process`) device to device (actors/frontend/weight_local.py, model/weights/
device_state.py): 4 CPU devices, the engine tp 2 on devices 0-1, the trainer's arrays split
tp 2 over devices 2-3 on the axis the engine does not split. Its greedy tokens afterwards are
those of the same tensors pushed through shared memory; the reply says device-to-device and
no shared-memory segment is made; a bad name or shape is refused and the weights served before
keep serving; a subset update reads back as sent; nothing stays lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, sys
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from ringserve import Engine
from ringserve.actors.frontend.weight_buckets import Segment
from ringserve.model.checkpoints.load import load_checkpoint
from ringserve.model.weights import handoff
from tests.engine.conftest import SMALL
from tests.model.test_device_state import new_weights

path = sys.argv[1]
segments = []
create = Segment.create.__func__
Segment.create = classmethod(lambda cls, *a, **k: segments.append(a[0]) or create(cls, *a, **k))
_, served = load_checkpoint(path)
new = new_weights(served, 5)
mesh = Mesh(np.array(jax.devices()[2:4]), ("fsdp",))
def trainer(a):  # split on dim 1 where it divides, else whole
    return jax.device_put(a, NamedSharding(mesh, P(None, "fsdp") if a.ndim == 2 and a.shape[1] % 2 == 0 else P()))
prompts = [[5, 17, 301, 42], list(range(7, 40))]
sp = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
out = {"n": len(new)}
with Engine(path, runner_in_process=True, tp_size=2, **SMALL) as e:
    greedy = lambda: [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=sp)]
    out["before"] = greedy()
    # trainer names, mapped to HF ones; one leaf the engine does not serve (mapped to None)
    arrays = {"trainer/" + n: trainer(a) for n, a in new.items()} | {"trainer/opt_state": trainer(np.zeros(4, np.float32))}
    name_map = lambda n: None if n == "trainer/opt_state" else n.removeprefix("trainer/")
    r = e.update_weights_from_tensor(arrays, weight_version="d2d", name_map=name_map)
    out["d2d"] = {k: r[k] for k in ("success", "message", "weight_version")}
    out["d2d_segments"] = len(segments)
    out["after_d2d"] = greedy()
    name = "model.layers.0.self_attn.q_proj.weight"
    for bad in ({"model.nope.weight": trainer(np.zeros((4, 4), np.float32))},
                {name: trainer(np.zeros((4, 4), np.float32))}):
        r = e.update_weights_from_tensor(bad)
        out.setdefault("refused", []).append([r["success"], r["message"], r["weight_version"]])
    out["after_refused"] = greedy()
    one = "model.layers.1.mlp.down_proj.weight"  # a subset: reads back as sent (the host copy)
    r = e.update_weights_from_tensor({one: trainer(new[one] * 2)})
    rows = np.asarray(e.get_weights_by_name(one, truncate_size=1 << 20), np.float32)
    want = np.asarray(np.asarray(new[one] * 2).astype(jax.numpy.dtype(e.runner_info["dtype"])), np.float32)
    out["subset"] = [r["success"], bool(np.array_equal(rows, want))]
    out["host"] = e.update_weights_from_tensor(new, weight_version="host")["message"]  # the push, same tensors
    out["host_segments"] = len(segments)
    out["after_host"] = greedy()
    out["lent"] = handoff.lent()
print(json.dumps(out))
"""


def test_a_trainers_sharded_arrays_update_an_in_process_engine_device_to_device(tiny_dir):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    env.pop("JAX_NUM_CPU_DEVICES", None)
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_dir("llama"))], env=env, capture_output=True, text=True,
                       timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["d2d"]["success"] and out["d2d"]["weight_version"] == "d2d", out["d2d"]
    assert out["d2d"]["message"] == f"updated {out['n']} tensors device-to-device", out["d2d"]
    assert out["d2d_segments"] == 0  # no shared memory on the way
    assert out["after_d2d"] != out["before"]  # new weights serve...
    assert (
        out["after_host"] == out["after_d2d"]
    )  # ...the same as the same tensors pushed through shared memory
    assert out["host_segments"] > 0 and out["host"].startswith("updated")
    (ok1, why1, v1), (ok2, why2, v2) = out["refused"]
    assert not ok1 and "'model.nope.weight' is not a weight of the served model" in why1 and v1 == "d2d"
    assert not ok2 and "'model.layers.0.self_attn.q_proj.weight' has shape (4, 4)" in why2 and v2 == "d2d"
    assert out["after_refused"] == out["after_d2d"]  # the refused updates changed nothing
    assert out["subset"] == [True, True]
    assert out["lent"] == []

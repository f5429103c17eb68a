"""The state built on the device from JAX arrays (model/weights/device_state.py) is the host
build's, leaf for leaf and bit for bit (f32, bf16, int8; layers scanned or unrolled; tp 1 and a
trainer's tp-2 mesh laid out otherwise than the engine's), it fits the compiled programs, and
the update through `WeightSync.load_local` swaps all or nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor
from ringserve.model.runtime.weight_sync import WeightError, WeightSync
from ringserve.model.weights import handoff

CFG = dict(page_size=16, num_pages=64, max_context_len=128, max_batch=4, max_extend_tokens=64, precompile=False,
           cpu_matmul="xla")  # fmt: skip


def new_weights(served: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """Other values of every served tensor (float32), as a trainer's next step would give."""
    rng = np.random.default_rng(seed)
    return {
        n: (np.asarray(a, np.float32) + rng.normal(0, 0.02, np.shape(a))).astype(np.float32)
        for n, a in served.items()
    }


def assert_same_state(got, want) -> None:
    g, w = jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves_with_path(want)
    assert [p for p, _ in g] == [p for p, _ in w]
    for (path, a), (_, b) in zip(g, w, strict=True):
        assert a.dtype == b.dtype and a.sharding == b.sharding, path
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


@pytest.mark.parametrize("dtype, loop, quant", [("float32", "scan", None), ("bfloat16", "unrolled", None),
                                                ("bfloat16", "scan", "int8"), ("float32", "unrolled", "int8")])  # fmt: skip
def test_device_build_equals_host_build(tiny_dir, dtype, loop, quant):
    ex = ModelExecutor(
        tiny_dir("llama"), ExecutorConfig(**CFG, dtype=dtype, layer_loop=loop, quantization=quant)
    )
    host = new_weights(ex.host_tensors, 1)
    want = ex.build_params(host)
    got = ex.build_params_on_device({n: jnp.asarray(a) for n, a in host.items()})
    assert_same_state(got, want)
    assert ex._fits(got)


def test_load_local_swaps_all_or_nothing_and_keeps_host_copies(tiny_dir):
    ex = ModelExecutor(tiny_dir("llama"), ExecutorConfig(**CFG, dtype="bfloat16"))
    sync = WeightSync(ex)
    served = dict(ex.host_tensors)
    new = new_weights(served, 2)
    subset = {n: jnp.asarray(a) for n, a in new.items() if ".layers.1." in n}
    with handoff.lend("u1", subset):
        assert sync.load_local("u1") == f"updated {len(subset)} tensors device-to-device"
    assert handoff.lent() == []
    assert_same_state(ex.params, ex.build_params({**served, **{n: new[n] for n in subset}}))
    for n in subset:  # the host copy serves reads and later subset updates
        assert isinstance(ex.host_tensors[n], np.ndarray)
        np.testing.assert_array_equal(ex.host_tensors[n], new[n])
    before = jax.tree.map(np.asarray, ex.params)
    name = "model.layers.0.self_attn.q_proj.weight"
    for bad, why in [({"model.nope.weight": jnp.zeros(3)}, "'model.nope.weight' is not a weight"),
                     ({name: jnp.zeros((3, 3))}, f"tensor {name!r} has shape"),
                     ({name: jnp.zeros(served[name].shape, jnp.int32)}, f"tensor {name!r} has dtype int32")]:  # fmt: skip
        with handoff.lend("bad", {**subset, **bad}), pytest.raises(WeightError, match=why):
            sync.load_local("bad")
        jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, ex.params), before)
    with pytest.raises(WeightError, match="no arrays handed over in this process"):
        sync.load_local("gone")


TP2 = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor
from tests.model.test_device_state import CFG, new_weights
path, loop, quant, where = sys.argv[1], sys.argv[2], sys.argv[3] or None, sys.argv[4]
ex = ModelExecutor(path, ExecutorConfig(**CFG, tp_size=2, layer_loop=loop, quantization=quant, dtype="bfloat16"))
host = new_weights(ex.host_tensors, 3)
devs = jax.devices()[2:4] if where == "other" else jax.devices()[1::-1]  # other devices, or ours reversed
mesh = Mesh(np.array(devs), ("fsdp",))
def trainer(a):  # the trainer's layout: split on the axis the engine does not split (dim 1), else whole
    spec = P(None, "fsdp") if a.ndim == 2 and a.shape[1] % 2 == 0 else P()
    return jax.device_put(a, NamedSharding(mesh, spec))
arrays = {n: trainer(a) for n, a in host.items()}
import jax._src.array as jarray  # every device-to-host read of an array goes through its _value
host_reads, value = [], jarray.ArrayImpl._value
jarray.ArrayImpl._value = property(lambda self: host_reads.append(1) or value.fget(self))
got = jax.block_until_ready(ex.build_params_on_device(arrays))
jarray.ArrayImpl._value = value
want = ex.build_params(host)
same = all(a.sharding == b.sharding and np.array_equal(np.asarray(a), np.asarray(b))
           for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
print(json.dumps({"same": same, "fits": ex._fits(got), "host_reads": len(host_reads), "devices": sorted(d.id for d in got["norm"]["weight"].devices())}))
"""


@pytest.mark.parametrize("loop, quant, where", [("unrolled", "", "other"), ("scan", "int8", "ours")])
def test_a_trainers_tp2_arrays_reach_the_engines_tp2_layout(tiny_dir, loop, quant, where):
    """4 CPU devices: the engine tp 2 on devices 0-1; the trainer's arrays split on dim 1 over
    devices 2-3 (or over 1, 0: ours in another order). No array is read back to the host on the
    way (JAX's device_put would, for a reshard across device sets: `onto` never asks it to)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    env.pop("JAX_NUM_CPU_DEVICES", None)
    r = subprocess.run([sys.executable, "-c", TP2, str(tiny_dir("llama")), loop, quant, where], env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {
        "same": True,
        "fits": True,
        "host_reads": 0,
        "devices": [0, 1],
    }

"""The KV pool's zeros on CPU (model/compute/kernels/cpu_memory.py): zeros whatever the memory held
before, pages left to their first write, donated in place, sharded per device, and populated
in the background without changing what the pages hold."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ringserve.model.compute.kernels import cpu_memory

pytestmark = pytest.mark.skipif(cpu_memory.reason() is not None, reason=f"no custom call: {cpu_memory.reason()}")


def _aval(shape, dtype=jnp.float32, spec=PartitionSpec()) -> jax.ShapeDtypeStruct:
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("shape,dtype", [((3, 1_000_003), jnp.float32), ((5, 4097), jnp.bfloat16), ((7,), jnp.int32)])
def test_zeros_over_memory_that_held_something(shape, dtype):
    """Buffers freed full of sevens are what the allocator hands out next: every byte reads
    zero, the ragged ends (written) and the whole pages (handed back) alike."""
    for _ in range(3):
        full = jax.jit(lambda: jnp.full(shape, 7, dtype))()
        full.block_until_ready()
        del full
        z = cpu_memory.zeros(_aval(shape, dtype))
        assert z.shape == shape and z.dtype == dtype
        assert not np.asarray(z).any()


def test_pages_come_on_first_write_and_populate_keeps_them():
    """256 MiB of zeros leave RSS where it was (XLA's zeros would add all of it); a step writes
    into them in place; `populate` brings every page in and the written values stay."""
    n = 64 << 20  # f32: 256 MiB
    before = _rss()
    z = cpu_memory.zeros(_aval((n,)))
    z.block_until_ready()
    assert _rss() - before < 32 << 20
    ptr = z.unsafe_buffer_pointer()
    z = jax.jit(lambda x: x.at[jnp.array([0, n // 2, n - 1])].set(jnp.array([1.0, 2.0, 3.0])), donate_argnums=0)(z)
    assert z.unsafe_buffer_pointer() == ptr  # donated: the same memory
    t = cpu_memory.populate([z], stop=lambda: False)
    assert t is not None
    t.join(60)
    assert not t.is_alive()
    assert _rss() - before > 200 << 20
    host = np.asarray(z)
    assert host[0] == 1.0 and host[n // 2] == 2.0 and host[n - 1] == 3.0 and host.sum() == 6.0


def test_populate_stops_when_told():
    z = cpu_memory.zeros(_aval((64 << 20,)))
    told = threading.Event()
    told.set()
    before = _rss()
    t = cpu_memory.populate([z], stop=told.is_set)
    t.join(10)
    assert not t.is_alive()
    assert _rss() - before < 32 << 20
    assert not np.asarray(z[:1000]).any()


def test_sharded_over_devices():
    """On a `tp` mesh each device's shard comes from the custom call (shard_map), zeros."""
    code = (
        "import numpy as np, jax, jax.numpy as jnp\n"
        "from jax.sharding import Mesh, NamedSharding, PartitionSpec as P\n"
        "from ringserve.model.compute.kernels import cpu_memory\n"
        "mesh = Mesh(np.array(jax.devices()), ('tp',))\n"
        "for spec in (P('tp', None), P()):\n"
        "    a = jax.ShapeDtypeStruct((4, 300001), jnp.bfloat16, sharding=NamedSharding(mesh, spec))\n"
        "    z = cpu_memory.zeros(a)\n"
        "    assert z.sharding == a.sharding and len(z.addressable_shards) == 2, z.sharding\n"
        "    assert z.addressable_shards[0].data.shape == ((2, 300001) if spec else (4, 300001))\n"
        "    cpu_memory.populate([z], stop=lambda: False).join(60)\n"
        "    assert not np.asarray(z.astype(jnp.float32)).any()\n"
        "print('ok')\n"
    )  # fmt: skip
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_an_executor_that_fails_to_start_is_not_kept_by_its_populating_thread(tiny_dir, monkeypatch):
    """The pool's pages are brought in once the executor serves; one whose start failed after
    its pool was made (here: its state refused) never serves, and the thread, waiting, must
    neither keep it and its pool alive nor wait forever."""
    import gc
    import weakref

    from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor

    made = []
    monkeypatch.setattr(ModelExecutor, "_fits", lambda self, params: made.append(weakref.ref(self)) or False)
    cfg = ExecutorConfig(page_size=16, num_pages=8, max_context_len=64, max_batch=2, max_extend_tokens=64,
                         extend_block=16, precompile=False)  # fmt: skip

    def start() -> str:  # the exception (and its frames, which hold the executor) dropped here
        try:
            ModelExecutor(tiny_dir("llama"), cfg)
        except RuntimeError as e:
            return str(e)
        return "started"

    assert "does not match its avals" in start()
    for t in [t for t in threading.enumerate() if t.name.startswith("ringserve-load")]:
        t.join(30)  # the pool is made on the load thread, which lets the executor go when done
    gc.collect()
    assert made and made[0]() is None
    for t in [t for t in threading.enumerate() if t.name == "ringserve-kv-populate"]:
        t.join(10)
        assert not t.is_alive()


def test_populate_waits_for_its_gate_and_gives_up_when_told():
    """`after()`: False keeps the pages where they are, True starts the pass (`began`), None ends
    the thread without a page brought in."""
    z = cpu_memory.zeros(_aval((16 << 20,)))
    go = threading.Event()
    t = cpu_memory.populate([z], stop=lambda: False, after=lambda: go.is_set())
    assert t is not None
    t.join(0.3)
    assert t.is_alive() and t.began is None
    opened = time.monotonic()
    go.set()
    t.join(30)
    assert not t.is_alive() and t.began is not None and t.began >= opened
    t = cpu_memory.populate([z], stop=lambda: False, after=lambda: None)
    t.join(10)
    assert not t.is_alive() and t.began is None


def _served_executor(tiny_dir):
    from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor

    cfg = ExecutorConfig(page_size=16, num_pages=64, max_context_len=64, max_batch=2, max_extend_tokens=16,
                         extend_block=16)  # fmt: skip
    return ModelExecutor(tiny_dir("llama"), cfg)


def test_the_pool_pages_come_after_its_first_step(tiny_dir, monkeypatch):
    """The KV pool's pages are brought in once the pool's first step is done (beside it, that
    step, usually the server's first request, shared the cores with the pass), not as the
    executor starts serving."""
    import ringserve.model.runtime.kv_pool as kv_pool
    from ringserve.model.compute.step_inputs import DeviceRow

    monkeypatch.setattr(kv_pool, "FIRST_STEP_WAIT_S", 60.0)  # (a slow machine: no idle start here)
    ex = _served_executor(tiny_dir)
    t = ex.kv_pool.populating
    assert t is not None
    time.sleep(0.3)
    assert t.began is None  # serving, no step yet
    before = time.monotonic()
    out, _, _ = ex.run([DeviceRow(np.arange(3, 8, dtype=np.int32), 0, np.array([1], np.int32))])
    out.tokens.block_until_ready()
    t.join(30)
    assert not t.is_alive() and t.began is not None and t.began >= before


def test_an_idle_pool_pages_come_anyway(tiny_dir, monkeypatch):
    """No step within FIRST_STEP_WAIT_S of serving: the pages are brought in all the same."""
    import ringserve.model.runtime.kv_pool as kv_pool

    monkeypatch.setattr(kv_pool, "FIRST_STEP_WAIT_S", 0.2)
    ex = _served_executor(tiny_dir)
    t = ex.kv_pool.populating
    assert t is not None
    t.join(30)
    assert not t.is_alive() and t.began is not None

"""Step programs read back from disk (model/runtime/program_cache.py): the same samples and logprobs as
traced ones, no trace on a hit, keys that move with what shapes a trace, private files, and
anything unreadable taken as a miss."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ringserve.model.compute.step_inputs import DeviceRow, DeviceSampling
from ringserve.model.runtime import program_cache
from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor
from ringserve.model.runtime.program_cache import ProgramCache

CFG = dict(page_size=16, num_pages=64, max_context_len=256, max_batch=4, max_extend_tokens=64, top_logprobs_num=2,
           token_ids_logprob_num=2)  # fmt: skip


def counting_traces(make_step):
    """`make_step` whose steps count their traces, and the list they count in (one 1 a trace)."""
    calls: list[int] = []

    def counting(*a, **k):
        step = make_step(*a, **k)

        def traced_step(*args):
            calls.append(1)
            return step(*args)

        return traced_step

    return counting, calls


def _decode(ex: ModelExecutor) -> tuple[list, list, list]:
    """Tokens, their logprobs and the top-2 logprobs of a prefill of two rows, then 4 decode steps
    (one row sampled at temperature 1 with a seed: the seeded path too)."""
    pages = [np.arange(1, 4, dtype=np.int32), np.arange(4, 7, dtype=np.int32)]
    prompts = [np.arange(3, 20, dtype=np.int32), np.arange(40, 45, dtype=np.int32)]
    sampling = [DeviceSampling(), DeviceSampling(temperature=1.0, seed=7)]
    rows = [DeviceRow(p, 0, t, s) for p, t, s in zip(prompts, pages, sampling, strict=True)]
    toks, lps, tops = [], [], []
    lens = [len(p) for p in prompts]
    for _ in range(5):
        out, _, _ = ex.run(rows)
        t = np.asarray(out.tokens)[:2].tolist()
        toks.append(t)
        lps.append(np.asarray(out.logprobs)[:2].tolist())
        tops.append(np.asarray(out.top_logprobs)[:2].tolist())
        rows = [DeviceRow(np.array([t[i]], np.int32), lens[i], pages[i], sampling[i]) for i in range(2)]
        lens = [n + 1 for n in lens]
    return toks, lps, tops


def test_programs_read_back_compute_what_traced_ones_do(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(program_cache, "directory", lambda: tmp_path / "programs")
    traced = ModelExecutor(tiny_dir("llama"), ExecutorConfig(**CFG))
    assert traced._on_disk is None  # off unless asked (the server's runner asks)
    want = _decode(traced)
    del traced

    first = ModelExecutor(tiny_dir("llama"), ExecutorConfig(**CFG, program_cache=True))
    n = first.num_programs
    assert (first._on_disk.hits, first._on_disk.misses, first.trace_count) == (0, n, n)
    files = sorted((tmp_path / "programs").iterdir())
    assert len(files) == n
    assert stat.S_IMODE((tmp_path / "programs").stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert _decode(first) == want
    del first

    import ringserve.model.runtime.executor as mx

    counting, calls = counting_traces(mx.make_step)
    monkeypatch.setattr(mx, "make_step", counting)
    again = ModelExecutor(tiny_dir("llama"), ExecutorConfig(**CFG, program_cache=True))
    assert (again._on_disk.hits, again._on_disk.misses) == (n, 0)
    assert calls == []  # nothing traced: every program read back
    assert again.trace_count == n  # counted as the traces they replace (serving still never traces)
    kv = jax.tree.leaves((again.kv_pool.kv, again.kv_pool.future))
    assert _decode(again) == want
    assert all(x.is_deleted() for x in kv)  # donated to the programs read back, as to traced ones


def test_a_step_loads_its_own_program_from_disk_rather_than_run_padded(tiny_dir, tmp_path, monkeypatch):
    """While the background compile is held, a step that a larger compiled program would hold
    (padded) loads its own exact program where it is on disk (a load, not a compile), on the
    caller's thread, as does a step no compiled program holds (a prefill longer than the lead's;
    tests/model/test_step.py: compiled there where it is not on disk)."""
    import threading

    from ringserve.model.compute.step_inputs import StepShape

    monkeypatch.setattr(program_cache, "directory", lambda: tmp_path / "programs")
    cfg = dict(CFG, top_logprobs_num=0, token_ids_logprob_num=0, program_cache=True, background_compile=True)
    first = ModelExecutor(tiny_dir("llama"), ExecutorConfig(**cfg))  # the same configuration: the same keys
    assert first.wait_compiled(300)  # every program on disk
    del first
    gate = threading.Event()

    class Gated(ModelExecutor):
        def _compile(self, key):
            if threading.current_thread().name == "ringserve-compile":
                assert gate.wait(120)
            return super()._compile(key)

    ex = Gated(tiny_dir("llama"), ExecutorConfig(**cfg))
    try:
        assert ex.num_programs == 2 and ex.programs.pending == ex.num_programs_total - 2
        pages = np.arange(1, 5, dtype=np.int32)
        row = DeviceRow(np.arange(3, 43, dtype=np.int32), 0, pages)  # 40 tokens: no compiled program holds it
        assert ex.prepare([row]).shape[:3] == (16, 64, 4)  # its own, at once (from disk: a load)
        row = DeviceRow(np.arange(3, 23, dtype=np.int32), 0, pages)  # 20: the 64-token program holds it, padded
        assert ex.prepare([row]).shape[:3] == (16, 32, 4)  # its own, loaded here
        assert ex.num_programs == 4 and ex.programs.pending == ex.num_programs_total - 4
        (tmp_path / "programs").rename(tmp_path / "gone")  # nothing on disk any more
        row = DeviceRow(np.arange(3, 10, dtype=np.int32), 0, pages)  # 7 tokens: the 16-token lead, exactly
        assert ex.prepare([row]).shape[:3] == (16, 16, 4)
        rows = [DeviceRow(np.array([5], np.int32), 20, pages), DeviceRow(np.array([6], np.int32), 20, pages)]
        assert ex.prepare(rows).shape[:3] == (1, 2, 2)  # two decode rows: the decode lead, exactly
        assert ex.num_programs == 4 and StepShape(1, 2, 2) == ex.prepare(rows[:1]).shape._replace(context=0)
    finally:
        gate.set()
        ex.wait_compiled(300)


def _key(cache: ProgramCache, rows: int = 4, top_n: int = 2, dtype=jnp.float32) -> str:
    args = ({"w": jax.ShapeDtypeStruct((8, 8), dtype)}, jax.ShapeDtypeStruct((rows,), jnp.int32), None)
    return cache.key(args, (top_n, 0))


def test_keys_move_with_what_shapes_a_trace(tmp_path, monkeypatch):
    base = ProgramCache({"executor": {"max_batch": 4}}, tmp_path)
    k = _key(base)
    assert k == _key(ProgramCache({"executor": {"max_batch": 4}}, tmp_path))  # stable across instances
    assert k != _key(base, rows=8) and k != _key(base, top_n=3) and k != _key(base, dtype=jnp.bfloat16)
    assert k != _key(ProgramCache({"executor": {"max_batch": 8}}, tmp_path))
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    assert k != _key(ProgramCache({"executor": {"max_batch": 4}}, tmp_path))
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.setattr(program_cache, "source_digest", lambda: "another source tree")
    assert k != _key(ProgramCache({"executor": {"max_batch": 4}}, tmp_path))


def test_the_source_digest_moves_with_the_model_and_kvmem_sources(tmp_path):
    (tmp_path / "model" / "compute" / "kernels").mkdir(parents=True)
    (tmp_path / "model" / "runtime").mkdir()
    (tmp_path / "kvmem").mkdir()
    (tmp_path / "model" / "runtime" / "step.py").write_text("x = 1\n")
    (tmp_path / "model" / "compute" / "kernels" / "k.cc").write_text("int f();\n")
    (tmp_path / "kvmem" / "pool.py").write_text("y = 2\n")
    d = program_cache.tree_digest(tmp_path)
    (tmp_path / "model" / "notes.txt").write_text("not a source")
    (tmp_path / "model" / "__pycache__").mkdir()
    (tmp_path / "model" / "__pycache__" / "step.py").write_text("z = 3\n")
    (tmp_path / "actors").mkdir()
    (tmp_path / "actors" / "other.py").write_text("w = 4\n")
    assert program_cache.tree_digest(tmp_path) == d
    for f in ("model/compute/kernels/k.cc", "kvmem/pool.py", "model/runtime/step.py"):
        before = (tmp_path / f).read_text()
        (tmp_path / f).write_text(before + "// changed\n")
        assert program_cache.tree_digest(tmp_path) != d, f
        (tmp_path / f).write_text(before)
    (tmp_path / "model" / "runtime" / "step.py").rename(tmp_path / "model" / "runtime" / "step2.py")  # a path is part of it
    assert program_cache.tree_digest(tmp_path) != d


def test_an_unreadable_entry_is_a_miss_and_is_written_again(tmp_path):
    cache = ProgramCache({}, tmp_path / "programs")
    x = jax.ShapeDtypeStruct((4,), jnp.float32)
    key = cache.key((x,), ())
    cache.dir.mkdir()
    (cache.dir / f"{key}.exported").write_bytes(b"not a flatbuffer")
    assert cache.load(key) is None
    out_tree = jax.tree.structure((0, 0))
    prog = cache.compile(lambda a: (a * 2, a + 1), (x,), (), out_tree, donate_argnums=(), custom_calls=())
    assert cache.misses == 1 and cache.load(key) is not None
    np.testing.assert_array_equal(prog(jnp.arange(4.0))[0], [0, 2, 4, 6])
    again = ProgramCache({}, tmp_path / "programs")
    prog = again.compile(lambda a: (a * 2, a + 1), (x,), (), out_tree, donate_argnums=(), custom_calls=())
    assert again.hits == 1
    np.testing.assert_array_equal(prog(jnp.arange(4.0))[1], [1, 2, 3, 4])


def test_a_step_returning_another_structure_is_refused(tmp_path):
    cache = ProgramCache({}, tmp_path)
    x = jax.ShapeDtypeStruct((4,), jnp.float32)
    with pytest.raises(RuntimeError, match="program cache: the step returns"):
        cache.compile(
            lambda a: (a, (a, a)), (x,), (), jax.tree.structure((0, 0)), donate_argnums=(), custom_calls=()
        )


def test_used_on_one_cpu_device_unless_turned_off(monkeypatch):
    from ringserve.model.compute.plan import ComputePlan

    assert jax.config.jax_compilation_cache_dir  # (tests/conftest.py turns XLA's cache on)
    assert program_cache.usable() and ComputePlan(platform="cpu").program_cache(1)
    assert not ComputePlan(platform="cpu").program_cache(2) and not ComputePlan(platform="gpu").program_cache(1)
    monkeypatch.setenv(program_cache.ENV, "0")
    assert not program_cache.usable()
    assert os.environ[program_cache.ENV] == "0"


def test_the_least_recently_used_entries_are_pruned(tmp_path, monkeypatch):
    monkeypatch.setattr(program_cache, "MAX_ENTRIES", 2)
    cache = ProgramCache({}, tmp_path / "programs")
    out_tree = jax.tree.structure(0)
    keys = []
    for i, n in enumerate((4, 5, 6)):
        x = jax.ShapeDtypeStruct((n,), jnp.float32)
        keys.append(cache.key((x,), ()))
        if i == 2:  # the first entry is read again: the second is now the least recently used
            os.utime(cache._path(keys[0]), (1, 1))
            os.utime(cache._path(keys[1]), (2, 2))
            assert cache.load(keys[0]) is not None
        cache.compile(lambda a: a + 1, (x,), (), out_tree, donate_argnums=(), custom_calls=())
    assert sorted(p.name for p in cache.dir.iterdir()) == sorted(f"{k}.exported" for k in (keys[0], keys[2]))


_FRESH_START = """
import json, sys
import jax
jax.config.update("jax_compilation_cache_dir", sys.argv[2])
import ringserve.model.runtime.executor as mx
from tests.model.test_program_cache import counting_traces
mx.make_step, traced = counting_traces(mx.make_step)
cfg = json.loads(sys.argv[3])
ex = mx.ModelExecutor(sys.argv[1], mx.ExecutorConfig(**cfg))
print(json.dumps({"hits": ex._on_disk.hits, "misses": ex._on_disk.misses, "traced": len(traced), "dot": ex.plan.dot.name}))
"""


def test_a_fresh_bf16_process_reads_back_every_program(tiny_dir, tmp_path):
    """A warm start is a new process: every custom call its programs call (the bf16 norms' too,
    whose first use is otherwise in a trace) is registered before the first is read back, so
    that none is traced again."""
    import json
    import subprocess
    import sys

    from ringserve.model.compute.kernels import cpu_matmul, cpu_norm

    if cpu_norm.reason() is not None or cpu_matmul.reason("bfloat16") is not None:
        pytest.skip(f"no bf16 kernels here: {cpu_norm.reason() or cpu_matmul.reason('bfloat16')}")
    cfg = dict(CFG, dtype="bfloat16", top_logprobs_num=0, token_ids_logprob_num=0, program_cache=True)
    cmd = [sys.executable, "-c", _FRESH_START, str(tiny_dir("llama")), str(tmp_path / "xla"), json.dumps(cfg)]
    root = Path(__file__).resolve().parents[2]  # (the script imports tests.model)
    runs = [json.loads(subprocess.run(cmd, cwd=root, capture_output=True, text=True, check=True,
                                      timeout=600).stdout.splitlines()[-1]) for _ in range(2)]  # fmt: skip
    assert runs[0]["dot"].startswith("kernel")
    n = runs[0]["misses"]
    assert n > 0 and runs[0]["hits"] == 0
    assert runs[1] == {"hits": n, "misses": 0, "traced": 0, "dot": runs[0]["dot"]}

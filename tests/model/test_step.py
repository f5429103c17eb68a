"""The bucketed step: every bucket compiled at start-up, nothing traced again while serving;
the future buffer; tensor parallelism on forced CPU devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ringserve.model.compute.step_inputs import DeviceRow, NoProgramYet
from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor

PAGE = 16


def test_all_buckets_compiled_once_and_never_again(tiny_dir):
    cfg = ExecutorConfig(page_size=PAGE, num_pages=64, max_context_len=256, max_batch=4, max_extend_tokens=64, extend_block=16,
                         top_logprobs_num=2, token_ids_logprob_num=4)  # fmt: skip
    ex = ModelExecutor(tiny_dir("llama"), cfg)
    # decode NB 2,4 + extend T 16,32,64 (NB 1,2,4 at block 16)
    assert ex.num_programs == 5
    traced = ex.trace_count
    assert traced == 5
    rng = np.random.default_rng(0)
    pages = [np.arange(1 + 8 * i, 9 + 8 * i, dtype=np.int32) for i in range(4)]
    for n_req in (1, 2, 3, 4):
        for n_tok in (1, 5, 16, 17):
            segs = [DeviceRow(rng.integers(3, 2000, n_tok).astype(np.int32), 0, pages[i]) for i in range(n_req)]
            if n_req * -(-n_tok // 16) * 16 > 64:
                continue
            ex.run(segs)
    assert ex.trace_count == traced and ex.num_programs == 5
    # prompt logprobs and token_ids_logprob are inputs of the same programs: nothing is traced
    # for them, a step of one-token rows that wants a position runs an extend program
    ids = np.array([1, 2, 3], np.int32)
    for n_tok in (1, 5, 16, 40):
        toks = rng.integers(3, 2000, n_tok).astype(np.int32)
        rows = [DeviceRow(toks, 0, pages[0], logprob_targets=toks[1:] if n_tok > 1 else toks, logprob_ids=ids),
                DeviceRow(toks[:1], 0, pages[1], logprob_ids=ids)]  # fmt: skip
        so = ex.run_step(rows)
        assert so.num_positions == len(rows[0].logprob_targets) and np.asarray(so.out.ids_logprobs).shape[1] == 4
        assert ex.prepare(rows).shape.block == 16  # an extend program, also for n_tok == 1
    assert ex.prepare([DeviceRow(ids[:1], 0, pages[0], logprob_ids=ids)]).shape.block == 1  # ids alone: decode
    assert ex.trace_count == traced and ex.num_programs == 5
    with pytest.raises(ValueError, match="largest bucket"):
        ex.run([DeviceRow(np.zeros(1, np.int32), 0, pages[0]) for _ in range(5)])
    with pytest.raises(ValueError, match="largest bucket 64"):
        ex.run([DeviceRow(np.zeros(65, np.int32), 0, pages[0])])


def test_compile_order_covers_first_then_splits_the_widest_gap():
    from ringserve.model.runtime.programs import widest_gap_first as _widest_gap_first

    for n in range(1, 12):
        order = _widest_gap_first(n)
        assert sorted(order) == list(range(n)) and order[0] == n - 1 and (n == 1 or order[1] == 0)
    assert _widest_gap_first(6) == [5, 0, 3, 2, 1, 4]


def test_the_smallest_programs_lead_where_padding_costs_as_real_rows():
    from ringserve.model.compute.step_inputs import Buckets, StepShape
    from ringserve.model.runtime.programs import compile_order

    b = Buckets.make(4, 64, 16)
    order, lead = compile_order(b, [0], 0, 5)  # an accelerator: the covering programs alone
    assert [k[0] for k in order[:lead]] == [StepShape(1, 4, 4), StepShape(16, 64, 4)]
    cpu_order, lead = compile_order(b, [0], 0, 5, small_leads=True)  # the largest two: first after
    assert [k[0] for k in cpu_order[: lead + 2]] == [StepShape(1, 2, 2), StepShape(16, 16, 4), StepShape(1, 4, 4),
                                                     StepShape(16, 64, 4)]  # fmt: skip
    assert lead == 2 and sorted(cpu_order) == sorted(order) and len(set(order)) == len(order)


def test_bucket_families_lead_with_their_largest_and_shapes_are_unique():
    from ringserve.model.compute.step_inputs import Buckets, StepShape

    for block in (16, 1):  # with block 1 the decode shape (1, 4, 4) is also an extend shape
        b = Buckets.make(4, 64, block)
        dec, ext = b.families()
        assert dec[-1] == StepShape(1, 4, 4) and ext[-1] == StepShape(block, 64, 4)
        shapes = b.shapes()
        assert len(shapes) == len(set(shapes)) and set(shapes) == set(dec) | set(ext)
        lead = {dec[-1], ext[-1]}.__contains__  # only the covering programs compiled so far
        assert b.pick(True, 1, 1, ok=lead) == StepShape(1, 4, 4)
        assert b.pick(False, 1, 5, ok=lead) == StepShape(block, 64, 4)
        assert b.pick(False, 1, 5) == StepShape(block, 16 if block == 16 else 8, 4)
        with pytest.raises(NoProgramYet) as e:  # none accepted: which one would hold the step best
            b.pick(False, 1, 5, ok=lambda s: False)
        assert e.value.smallest == StepShape(block, 16 if block == 16 else 8, 4)


def test_a_step_padded_by_ok_names_its_smallest_shape():
    """build_batch records the shape that would hold the step best beside the one `ok` let it
    run in (the executor then loads that program where it is on disk)."""
    from ringserve.model.compute.step_inputs import Buckets, StepShape, build_batch

    b = Buckets.make(4, 64, 16)
    row = DeviceRow(np.arange(5, dtype=np.int32), 0, np.array([1], np.int32))
    padded = build_batch([row], b, 16, 4, 4, ok={StepShape(16, 64, 4)}.__contains__)
    assert padded.shape == StepShape(16, 64, 4) and padded.smallest == StepShape(16, 16, 4)
    exact = build_batch([row], b, 16, 4, 4)
    assert exact.shape == exact.smallest == StepShape(16, 16, 4)


def test_decode_buckets_step_past_powers_of_two():
    """Decode batches: powers of two up to 2 x step, then every step (SGLang's CUDA graph sizes);
    a batch runs in the smallest that holds it."""
    from ringserve.model.compute.step_inputs import Buckets, StepShape

    assert Buckets.make(64, 1024, 16, 8).decode_batches == (2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert Buckets.make(64, 1024, 16, 0).decode_batches == (2, 4, 8, 16, 32, 64)
    assert Buckets.make(64, 1024, 16, 16).decode_batches == (2, 4, 8, 16, 32, 48, 64)
    assert Buckets.make(20, 1024, 16, 8).decode_batches == (2, 4, 8, 16, 20)
    assert Buckets.make(16, 1024, 16, 8).decode_batches == (2, 4, 8, 16)  # the tests' engines: unchanged
    b = Buckets.make(64, 1024, 16, 8)
    assert b.pick(True, 33, 33) == StepShape(1, 40, 40) and b.pick(True, 49, 49) == StepShape(1, 56, 56)


@pytest.mark.parametrize("backend", ["native", "bucketed"])
def test_serves_while_the_other_programs_compile(tiny_dir, backend):
    """background_compile: the executor is ready once the smallest decode program (at the
    longest context bucket) and the smallest extend program are compiled (a short prompt's
    prefill is not padded to the largest, nor one request's decode); until the others are, a step runs in the smallest
    compiled program that holds it (padded), with the tokens the exact program gives, and a
    prefill none holds has its own program compiled at once, on the caller's thread (not in the
    background's order, where the largest extend program comes first); then every program is
    there, each traced once, and steps use the exact ones."""
    import threading

    from ringserve.model.compute.step_inputs import StepShape

    gate = threading.Event()

    class Gated(ModelExecutor):  # the background compile waits for the gate
        def _compile(self, key):
            if threading.current_thread().name == "ringserve-compile":
                assert gate.wait(120)
            return super()._compile(key)

    nb, nt = (4, 64) if backend == "native" else (2, 32)  # bucketed: x2 context buckets (128, 256)
    cfg = ExecutorConfig(page_size=PAGE, num_pages=64, max_context_len=256, max_batch=nb, max_extend_tokens=nt,
                         context_bucket_min=128, attention_backend=backend, background_compile=True)  # fmt: skip
    ex = Gated(tiny_dir("llama"), cfg)
    top, low = max(ex.attn.context_buckets()), ex.attn.context_for(16)
    keys, lead = ex.programs.order, ex.programs.lead
    total = ex.num_programs_total
    assert len(keys) == total == (5 if backend == "native" else 6)
    then = [StepShape(1, nb, nb, top)] if nb > 2 else []  # the largest decode program, where it is another
    then.append(StepShape(16, nt, nb, top))
    assert [k[0] for k in keys[: lead + len(then)]] == [StepShape(1, 2, 2, top), StepShape(16, 16, nb, low), *then]
    assert ex.num_programs == 2 and ex.programs.pending == total - 2
    status = ex.compile_status()
    assert (status["programs_compiled"], status["programs_total"], status["programs_pending"]) == (2, total, total - 2)

    rng = np.random.default_rng(1)
    prompt = rng.integers(3, 2000, 5).astype(np.int32)
    pages = np.arange(1, 9, dtype=np.int32)

    def generate(prompt=prompt) -> tuple[list[int], list[StepShape]]:
        ex.kv_pool.new()
        rows = [DeviceRow(prompt, 0, pages, future_slot=0)]
        shapes, toks = [ex.prepare(rows).shape], []
        out, idx, _ = ex.run(rows)
        toks.append(int(out.tokens[idx[0]]))
        for i in range(6):
            rows = [DeviceRow(np.array([toks[-1]], np.int32), len(prompt) + i, pages, future_slot=0)]
            shapes.append(ex.prepare(rows).shape)
            out, idx, _ = ex.run(rows)
            toks.append(int(out.tokens[idx[0]]))
        return toks, shapes

    padded, shapes = generate()
    assert shapes[0] == StepShape(16, 16, nb, low) and set(shapes[1:]) == {StepShape(1, 2, 2, top)}
    assert ex.trace_count == 2
    long_prompt = rng.integers(3, 2000, 20).astype(np.int32)  # no compiled program holds its prefill
    waited = generate(long_prompt)  # the background compile is still held at the gate
    assert waited[1][0] == StepShape(16, 32, nb, low)  # its own program, compiled here
    assert ex.trace_count == 3 and ex.programs.pending == total - 3
    gate.set()
    assert ex.wait_compiled(300) and ex.programs.pending == 0 and ex.programs.error is None
    assert ex.num_programs == ex.trace_count == total  # the background skipped the one compiled here
    exact, shapes = generate()
    assert shapes[0] == StepShape(16, 16, nb, low) and set(shapes[1:]) == {StepShape(1, 2, 2, low)}
    assert exact == padded
    assert generate(long_prompt)[0] == waited[0]
    assert ex.trace_count == total


def test_no_program_copies_the_kv_cache(tiny_dir):
    """Donation must make the KV update in place in every bucket: a whole-cache copy per step
    (what XLA CPU did for 1-token programs) costs ~30x the step."""
    import re

    cfg = ExecutorConfig(page_size=PAGE, num_pages=64, max_context_len=1024, max_batch=8, max_extend_tokens=64, extend_block=16)
    ex = ModelExecutor(tiny_dir("llama"), cfg)
    kv_shape = "f32[{}]".format(",".join(map(str, ex.kv_pool.kv[0].shape)))  # the stacked K cache
    for key, prog in ex.programs.compiled.items():
        copies = [ln for ln in prog.as_text().splitlines() if re.search(re.escape(kv_shape) + r"\{[^}]*\} copy\(", ln)]
        assert not copies, (key, copies[:2])


def test_future_index_reads_previous_sample_on_device(tiny_dir):
    """Batch N+1 carries -(slot+1) instead of the token batch N sampled: same tokens result."""
    cfg = ExecutorConfig(page_size=PAGE, num_pages=64, max_context_len=256, max_batch=4, max_extend_tokens=64, precompile=False)
    prompt = np.random.default_rng(3).integers(3, 2000, 20).astype(np.int32)
    pages = np.arange(1, 9, dtype=np.int32)

    def generate(use_future: bool) -> list[int]:
        ex = ModelExecutor(tiny_dir("llama"), cfg)
        out, rows, _ = ex.run([DeviceRow(prompt, 0, pages, future_slot=2)])
        toks = [int(out.tokens[rows[0]])]
        for i in range(8):
            inp = -3 if use_future else toks[-1]
            out, rows, _ = ex.run([DeviceRow(np.array([inp], np.int32), len(prompt) + i, pages, future_slot=2)])
            toks.append(int(out.tokens[rows[0]]))
        return toks

    assert generate(True) == generate(False)


def test_extend_programs_sample_only_the_rows_that_produce_a_token(tiny_dir):
    """A chunked prefill's middle chunk (its sample goes to the sink) counts for nothing: the
    producing rows go first and the loop of 16-row groups (CPU's) runs over them alone, so
    17 middle chunks before the one producing row make one group, not two (the group's 15
    other rows are middle chunks, sampled; the last two are not: zeros), and the producing
    row draws what it draws when every row produces."""
    from ringserve.model.compute.step_inputs import DeviceSampling

    cfg = ExecutorConfig(page_size=PAGE, num_pages=64, max_context_len=256, max_batch=32, max_extend_tokens=512,
                         extend_block=16, precompile=False, top_logprobs_num=2)  # fmt: skip
    ex = ModelExecutor(tiny_dir("llama"), cfg)
    assert ex.plan.sample_group == 16
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 2000, 3 if i < 17 else 12).astype(np.int32) for i in range(18)]
    sampling = DeviceSampling(temperature=0.8, seed=11)

    def step(keep_all: bool):
        rows = [DeviceRow(p, 0, np.array([1 + i], np.int32), sampling, future_slot=i if keep_all or i == 17 else -1)
                for i, p in enumerate(prompts)]  # fmt: skip
        so = ex.run_step(rows)
        assert so.num_samples == 18 and ex.prepare(rows).shape.rows == 32  # an extend program of 32 rows
        return np.asarray(so.out.tokens)[:18], np.asarray(so.out.logprobs)[:18], np.asarray(so.out.top_logprobs)[:18]

    tokens, logprobs, top = step(keep_all=False)
    assert top[:15].any(axis=1).all() and not tokens[15:17].any() and not logprobs[15:17].any() and not top[15:17].any()
    assert logprobs[17] < 0 and top[17, 0] < 0
    all_tokens, all_logprobs, all_top = step(keep_all=True)
    assert all_top.any(axis=1).all()  # two groups: every row sampled
    assert tokens[17] == all_tokens[17] and logprobs[17] == all_logprobs[17] and (top[17] == all_top[17]).all()


TP_SCRIPT = r"""
import json, sys
import numpy as np
from ringserve.model.compute.step_inputs import DeviceRow
from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor
from tests.model.test_hf_parity import greedy_with_cached_prefix, prompts_with_shared_prefix
path, tp, loop = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cfg = ExecutorConfig(page_size=16, num_pages=128, max_context_len=512, max_batch=8, max_extend_tokens=256, tp_size=tp,
                     precompile=False, layer_loop=loop)
ex = ModelExecutor(path, cfg)
prompts = prompts_with_shared_prefix(32, [3, 20, 50])
shards = {repr(tuple(l.sharding.spec)) for l in __import__("jax").tree_util.tree_leaves(ex.params)}
print(json.dumps({"tokens": greedy_with_cached_prefix(ex, prompts, 32, 16), "specs": sorted(shards), "kv": repr(tuple(ex.kv_pool.kv[0].sharding.spec))}))
"""


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen3", marks=pytest.mark.sweep)])  # CI's 45 minutes
def test_tensor_parallel_matches_tp1(tiny_dir, family):
    path = str(tiny_dir(family))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    results = {}
    # CPU runs its layers unrolled (per-layer weights); accelerators scan stacked ones: both split
    for tp, loop in ((1, "unrolled"), (2, "unrolled"), (4, "unrolled"), (4, "scan")):
        r = subprocess.run([sys.executable, "-c", TP_SCRIPT, path, str(tp), loop], env=env, capture_output=True, text=True,
                           timeout=600)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        results[tp, loop] = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ((2, "unrolled"), (4, "unrolled"), (4, "scan")):
        assert results[key]["tokens"] == results[1, "unrolled"]["tokens"], key
    # per-layer [in, out] weights; stacked [L, in, out], the layer axis never split
    assert "(None, 'tp')" in results[4, "unrolled"]["specs"]  # column-parallel: really sharded
    assert "('tp', None)" in results[4, "unrolled"]["specs"]  # row-parallel
    assert "(None, None, 'tp')" in results[4, "scan"]["specs"]
    assert "(None, 'tp', None)" in results[4, "scan"]["specs"]
    assert results[4, "unrolled"]["kv"].startswith("('tp',")  # KV cache split by KV head


def test_a_program_compiled_between_the_failed_pick_and_the_wait_is_not_missed():
    """The runner counts the compiled programs before it picks; a wait after the last one
    landed returns at once with True (retry), and False only when no more will come."""
    import threading

    from ringserve.model.runtime.programs import ProgramSet

    gate = threading.Event()

    def compile_one(key):
        if threading.current_thread().name == "ringserve-compile":
            assert gate.wait(60)
        return key

    ps = ProgramSet(compile_one, ["lead", "rest"], 1, [0])
    ps.compile_all(background=True)
    seen = len(ps.compiled)
    assert seen == 1 and ps.pending == 1
    gate.set()
    assert ps.wait(60) and ps.pending == 0  # the last program landed before the wait
    assert ps.wait_for_more(seen) is True
    assert ps.wait_for_more(len(ps.compiled)) is False


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread niceness here")
def test_the_background_compile_runs_at_the_lowest_priority():
    """Serving steps come first: the lead programs compile at the caller's priority, the rest
    on a thread the OS schedules only where the steps leave a core (Linux: niceness 19)."""
    import threading

    from ringserve.model.runtime.programs import BACKGROUND_NICE, ProgramSet

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    seen: dict[str, int] = {}

    def compile_one(key):
        seen[key] = nice()
        return key

    before = nice()
    ps = ProgramSet(compile_one, ["lead", "rest", "more"], 1, [0])
    ps.compile_all(background=True)
    assert ps.wait(60)
    assert seen == {"lead": before, "rest": max(before, BACKGROUND_NICE), "more": max(before, BACKGROUND_NICE)}
    assert nice() == before  # the caller's own priority is untouched

"""The sliding layers' own KV page space (ProgramShapes.local_pages, model/compute/attention/base.py):
every backend reads and writes a sliding layer through the local page table, and gives the same
logits as the shared page ids (local_pages 0), on Gemma 2 (windows 24, 0, 24, 0; soft cap 4) and
Gemma 3 (24, 24, 0, 24) tiny checkpoints, and as transformers does.

The local ids are handed out as kvmem would (`LocalBook`): a row's page gets a fresh id when its
first token is written, and goes back to the free list as soon as it lies wholly before the
window of every query of the step (and so of every later step); the list is last in, first out,
so the other row takes it at once and writes its own K/V there. The row's table keeps the stale
id: its local layers then read another request's keys there, which must get no weight. Every
cache entry starts at a large finite value (`GARBAGE`), so a key read but not masked shows.

Scenario: two rows, prompts of 120 and 90 tokens (5 and 3.75 windows), prefilled in chunks of
16 tokens (smaller than the window: a chunk's queries see keys of earlier chunks only partly)
side by side, then 20 decode steps of both (the greedy tokens fed back), each crossing pages.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from ringserve.model.compute.step_inputs import DeviceRow
from ringserve.model.runtime.executor import ModelExecutor
from tests.hf_ref import hf_logits
from tests.model import test_hf_parity as parity

PAGE, WINDOW, CHUNK, DECODE = 16, 24, 16, 20
LOCAL_PAGES = 16  # the sink and 15: two rows hold at most 5 live pages each here
GARBAGE = 30.0  # every cache entry before the first write (large and finite: masked keys get no weight)
PROMPTS = [np.random.default_rng(11).integers(3, 2000, n).tolist() for n in (120, 90)]
GLOBAL = [np.arange(1, 12, dtype=np.int32), np.arange(20, 31, dtype=np.int32)]  # 176 tokens each
TOL = 1e-5  # of the logit scale, as tests/model/test_hf_parity.py


class LocalBook:
    """Local page ids for the rows, handed out and freed as the scheduler would (module docstring)."""

    def __init__(self, rows: int) -> None:
        self.free = list(range(LOCAL_PAGES - 1, 0, -1))  # page 0 is the sink; pop() takes 1 first
        self.tables = [np.zeros(GLOBAL[0].shape, np.int32) for _ in range(rows)]
        self.live = [set() for _ in range(rows)]
        self.stale = 0  # entries left behind (counted: the test must exercise them)

    def step(self, row: int, first: int, end: int) -> np.ndarray:
        """The row's local table for a step whose queries sit at [first, end): its pages
        wholly before the first query's window freed, its new tokens' pages taken."""
        for i in sorted(self.live[row]):
            if (i + 1) * PAGE <= first - WINDOW + 1:  # every key of page i is out of every window
                self.free.append(int(self.tables[row][i]))
                self.live[row].discard(i)
                self.stale += 1
        for i in range(first // PAGE, (end - 1) // PAGE + 1):
            if i not in self.live[row]:
                self.tables[row][i] = self.free.pop()
                self.live[row].add(i)
        return self.tables[row].copy()


def run(ex: ModelExecutor, local: bool) -> tuple[list[np.ndarray], list[list[int]]]:
    """Per step, the rows' last-token logits; and each row's greedy decode tokens."""
    ex.kv_pool.kv = tuple(jnp.full_like(a, GARBAGE) for a in ex.kv_pool.kv)
    book = LocalBook(len(PROMPTS)) if local else None
    done, steps, out = [0] * len(PROMPTS), [], [[] for _ in PROMPTS]

    def row(r: int, ids: list[int]) -> DeviceRow:
        lp = None if book is None else book.step(r, done[r], done[r] + len(ids))
        return DeviceRow(np.array(ids, np.int32), done[r], GLOBAL[r], local_pages=lp)

    while any(done[r] < len(p) for r, p in enumerate(PROMPTS)):
        rows = [(r, p[done[r] : done[r] + CHUNK]) for r, p in enumerate(PROMPTS) if done[r] < len(p)]
        logits, _ = ex.logits([row(r, ids) for r, ids in rows])
        steps.append(logits)
        for (r, ids), lg in zip(rows, logits, strict=True):
            done[r] += len(ids)
            if done[r] == len(PROMPTS[r]):
                out[r].append(int(lg.argmax()))
    for _ in range(DECODE):
        logits, _ = ex.logits([row(r, [out[r][-1]]) for r in range(len(PROMPTS))])
        steps.append(logits)
        for r in range(len(PROMPTS)):
            done[r] += 1
            out[r].append(int(logits[r].argmax()))
    if book is not None:
        assert book.stale >= 6, book.stale  # stale entries were read past (and their pages reused)
    return steps, out


def assert_close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        scale = np.abs(w).max()
        err = np.abs(g - w).max(axis=-1)
        assert (err <= TOL * scale).all(), (step, err, scale)


CFG = dataclasses.replace(parity.CFG, max_batch=2, max_extend_tokens=64)


def executor(path, backend: str, layer_loop: str, local_pages: int) -> ModelExecutor:
    return ModelExecutor(path, dataclasses.replace(CFG, attention_backend=backend, layer_loop=layer_loop,
                                                   attention_interpret=backend.startswith("pallas"),
                                                   local_pages=local_pages))  # fmt: skip


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """reference(family): the native backend's run on the shared page ids (local_pages 0)."""
    made: dict[str, tuple] = {}

    def get(family: str):
        if family not in made:
            made[family] = run(executor(tiny_dir(family), "native", "unrolled", 0), local=False)
        return made[family]

    return get


CASES = [("gemma2", "native", "unrolled"), ("gemma3", "native", "scan"), ("gemma2", "cpu_kernel", "scan"),
         ("gemma3", "cpu_kernel", "unrolled"), ("gemma2", "bucketed", "scan"), ("gemma3", "pallas_ragged", "scan"),
         ("gemma2", "pallas", "scan"), ("gemma3", "pallas_gpu", "scan")]  # fmt: skip


@pytest.mark.parametrize("family, backend, layer_loop", CASES)
def test_local_pages_match_the_shared_ids(tiny_dir, reference, family, backend, layer_loop):
    if backend == "cpu_kernel":
        from ringserve.model.compute.kernels import cpu_attention

        if (why := cpu_attention.reason()) is not None:
            pytest.skip(f"the C++ attention kernel: {why}")
    ex = executor(tiny_dir(family), backend, layer_loop, LOCAL_PAGES)
    g = ex.attn.geo
    assert g.total_pages == sum(LOCAL_PAGES if w else CFG.shapes.num_pages for w in g.windows)
    steps, tokens = run(ex, local=True)
    want_steps, want_tokens = reference(family)
    assert_close(steps, want_steps)
    assert tokens == want_tokens


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_reference_matches_hf(tiny_dir, reference, family):
    """The shared-ids run the local ones are held to is transformers' (prefill chunks' last
    logits and the greedy decode)."""
    steps, tokens = reference(family)
    prompt, n = PROMPTS[0], len(PROMPTS[0])
    seq = prompt + tokens[0][:DECODE]
    ref = hf_logits(tiny_dir(family), seq)
    assert_close([steps[-1][0:1]], [ref[n + DECODE - 1][None]])
    assert tokens[0][:DECODE] == [int(ref[i].argmax()) for i in range(n - 1, n + DECODE - 1)]


def test_geometry_layout():
    from ringserve.model.compute.attention.base import AttnGeometry

    geo = AttnGeometry(num_layers=4, num_pages=100, page_size=PAGE, num_heads=4, num_kv_heads=2, head_dim=32,
                       max_pages=8, dtype=jnp.float32, windows=(8, 0, 8, 0), local_pages=10)  # fmt: skip
    assert geo.total_pages == 220 and [geo.layer_base(i) for i in range(4)] == [0, 10, 110, 120]
    assert [int(geo.layer_base(jnp.int32(i))) for i in range(4)] == [0, 10, 110, 120]
    assert [geo.is_local(i) for i in range(4)] == [True, False, True, False]
    shared = dataclasses.replace(geo, local_pages=0)
    assert shared.total_pages == 400 and [shared.layer_base(i) for i in range(4)] == [0, 100, 200, 300]
    with pytest.raises(ValueError, match="mix sliding"):
        dataclasses.replace(geo, windows=(8, 8, 8, 8))
    with pytest.raises(ValueError, match="mix sliding"):
        dataclasses.replace(geo, windows=None)


def test_multistep_decode_writes_and_reads_the_local_space(tiny_dir, reference):
    """Multi-step decode (4 steps a program, model/runtime/step.py `multi_step`) on the local page
    space: each step's token location is its own (local_out_loc[at]); the greedy tokens are the
    shared-ids run's plain decoding's."""
    from ringserve.model.compute.kernels import cpu_attention

    if (why := cpu_attention.reason()) is not None:
        pytest.skip(f"the C++ attention kernel: {why}")
    k = 4
    cfg = dataclasses.replace(CFG, attention_backend="cpu_kernel", layer_loop="scan", local_pages=LOCAL_PAGES,
                              decode_steps=k, decode_steps_rows=2)  # fmt: skip
    ex = ModelExecutor(tiny_dir("gemma3"), cfg)
    ex.kv_pool.kv = tuple(jnp.full_like(a, GARBAGE) for a in ex.kv_pool.kv)
    book, done, got = LocalBook(len(PROMPTS)), [0, 0], [[], []]
    while any(done[r] < len(p) for r, p in enumerate(PROMPTS)):  # the prompts, as `run` prefills them
        rows = [(r, p[done[r] : done[r] + CHUNK]) for r, p in enumerate(PROMPTS) if done[r] < len(p)]
        so = ex.run_step([DeviceRow(np.array(ids, np.int32), done[r], GLOBAL[r], future_slot=r,
                                    local_pages=book.step(r, done[r], done[r] + len(ids))) for r, ids in rows])  # fmt: skip
        for i, (r, ids) in enumerate(rows):
            done[r] += len(ids)
            if done[r] == len(PROMPTS[r]):
                got[r].append(int(so.out.tokens[i]))
    while len(got[0]) < DECODE:
        batch = [DeviceRow(np.array([-(r + 1)] + [-1] * (k - 1), np.int32), done[r], GLOBAL[r], future_slot=r,
                           local_pages=book.step(r, done[r], done[r] + k)) for r in range(2)]  # fmt: skip
        hb = ex.prepare(batch, k, multistep=True)
        assert hb.shape.multistep
        out = np.asarray(ex.run_host_batch(hb)[0].tokens)[: 2 * k].reshape(2, k)
        for r in range(2):
            got[r] += out[r].tolist()
            done[r] += k
    assert book.stale >= 6, book.stale
    want = reference("gemma3")[1]
    assert [g[:DECODE] for g in got] == [w[:DECODE] for w in want]


def test_a_verify_round_moves_its_local_token_locations_too():
    """model/runtime/step.py `at_true_positions`: a verify round planned at a bound moves down to
    the slot's true length; its tokens' local locations are read from the local table at the
    moved positions, as the global ones are from theirs."""
    from types import SimpleNamespace

    from ringserve.model.compute.step_inputs import ForwardBatch
    from ringserve.model.runtime.step import at_true_positions

    ps, k1 = 4, 3
    pages = np.array([[1, 2, 3, 4]], np.int32)
    local = np.array([[7, 5, 9, 6]], np.int32)
    pos = np.arange(9, 9 + k1, dtype=np.int32)  # planned at a bound of 9 tokens; the slot holds 6
    loc = lambda table, p: table[0, p // ps] * ps + p % ps  # noqa: E731
    fb = ForwardBatch(jnp.zeros(k1, jnp.int32), jnp.asarray(pos), jnp.asarray(loc(pages, pos)),
                      jnp.asarray([0, k1], jnp.int32), jnp.asarray([9 + k1], jnp.int32), jnp.asarray(pages),
                      jnp.asarray([1], jnp.int32), jnp.arange(k1, dtype=jnp.int32), jnp.asarray([0], jnp.int32), {},
                      jnp.asarray(local), jnp.asarray(loc(local, pos)))  # fmt: skip
    model = SimpleNamespace(attn=SimpleNamespace(geo=SimpleNamespace(page_size=ps), shift_plan=lambda p, s: p))
    moved = at_true_positions(model, fb, jnp.asarray([6], jnp.int32))
    true = np.arange(6, 6 + k1)
    assert np.asarray(moved.positions).tolist() == true.tolist()
    assert np.asarray(moved.out_loc).tolist() == loc(pages, true).tolist()
    assert np.asarray(moved.local_out_loc).tolist() == loc(local, true).tolist()


def test_a_model_that_does_not_mix_windows_refuses_a_local_space(tiny_dir):
    with pytest.raises(ValueError, match="mix sliding-window and global layers"):
        ModelExecutor(tiny_dir("mistral"), dataclasses.replace(CFG, local_pages=LOCAL_PAGES))

"""ringserve's JAX runtime against Hugging Face transformers on the same tiny checkpoints.

Tolerance: prefill logits agree to 1e-5 of the logit scale (max |logit| ~50; measured max error
~8e-5 absolute, 1.5e-6 relative, at 200 tokens) - float32 on both
sides, different summation orders. Greedy is well defined on these checkpoints because their
init keeps the top-2 logit gap >= ~0.03 (see model/checkpoints/tiny.py), far above that error.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ringserve.model.compute.step_inputs import DeviceRow
from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor
from tests.hf_ref import hf_greedy, hf_logits, hf_logprobs

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
PAGE = 16
CFG = ExecutorConfig(
    page_size=PAGE, num_pages=128, max_context_len=512, max_batch=8, max_extend_tokens=256,
    extend_block=16, precompile=False,
)  # fmt: skip


def prompts_with_shared_prefix(n_prefix: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 2000, n_prefix).tolist()
    return [prefix + rng.integers(3, 2000, n).tolist() for n in lengths]


class PageBook:
    """Hands out fresh pages (1, 2, ...) for the tests; page 0 is the sink."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def greedy_with_cached_prefix(ex: ModelExecutor, prompts: list[list[int]], n_prefix: int, n_new: int):
    """Prefill the shared prefix once (request 0), extend every prompt's remainder in one batch
    reusing the prefix pages, then decode all prompts together for n_new - 1 steps."""
    book = PageBook()
    prefix_pages = book.take(n_prefix // PAGE)
    ex.run([DeviceRow(np.array(prompts[0][:n_prefix], np.int32), 0, np.array(prefix_pages, np.int32))])
    tables = []
    for p in prompts:
        need = -(-(len(p) + n_new) // PAGE)
        tables.append(np.array(prefix_pages + book.take(need - len(prefix_pages)), np.int32))
    segs = [DeviceRow(np.array(p[n_prefix:], np.int32), n_prefix, t) for p, t in zip(prompts, tables, strict=True)]
    out, rows, _ = ex.run(segs)
    toks = np.asarray(out.tokens)
    gen = [[int(toks[r])] for r in rows]
    for _ in range(n_new - 1):
        segs = [
            DeviceRow(np.array([g[-1]], np.int32), len(p) + len(g) - 1, t)
            for p, g, t in zip(prompts, gen, tables, strict=True)
        ]
        out, rows, _ = ex.run(segs)
        toks = np.asarray(out.tokens)
        for g, r in zip(gen, rows, strict=True):
            g.append(int(toks[r]))
    return gen


def test_cpu_scans_its_layers_where_the_custom_calls_read_the_stack():
    """auto: accelerators scan; CPU scans with ringserve's kernel or oneDNN's custom call (each
    reads a layer's weights in place from the stack), and runs unrolled where XLA's dot alone
    (or the deterministic mode's) would copy a slice every step."""
    from ringserve.model.compute.plan import resolve_layer_loop

    assert resolve_layer_loop("auto", "tpu") == resolve_layer_loop("auto", "gpu", "xla") == "scan"
    for dot in ("kernel", "kernel+onednn", "onednn"):
        assert resolve_layer_loop("auto", "cpu", dot) == "scan", dot
    for dot in ("xla", "invariant"):
        assert resolve_layer_loop("auto", "cpu", dot) == "unrolled", dot
    assert resolve_layer_loop("unrolled", "cpu", "kernel") == "unrolled"
    with pytest.raises(ValueError, match="layer_loop='loop'"):
        resolve_layer_loop("loop", "cpu")


@pytest.mark.parametrize("layer_loop", ["unrolled", "scan"])  # both on CPU (by the dot), accelerators scan
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_hf(tiny_dir, family, layer_loop):
    path = tiny_dir(family)
    ex = ModelExecutor(path, dataclasses.replace(CFG, layer_loop=layer_loop))
    per_layer = list(ex.params["layers"]) == list(range(4))  # the state's layers: {0: ..., 3: ...} or stacked
    assert per_layer == (layer_loop == "unrolled")
    prompt = np.random.default_rng(7).integers(3, 2000, 45).tolist()
    ours, _ = ex.logits([DeviceRow(np.array(prompt, np.int32), 0, np.arange(1, 5, dtype=np.int32))])
    ref = hf_logits(path, prompt)[-1]
    scale = np.abs(ref).max()
    assert np.abs(ours[0] - ref).max() <= 1e-5 * scale, (np.abs(ours[0] - ref).max(), scale)
    assert ours[0].argmax() == ref.argmax()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_32_tokens_match_hf_with_cached_prefix(tiny_dir, family):
    path = tiny_dir(family)
    ex = ModelExecutor(path, CFG)
    prompts = prompts_with_shared_prefix(32, [1, 7, 16, 40, 90])
    ours = greedy_with_cached_prefix(ex, prompts, 32, 32)
    ref = hf_greedy(path, prompts, 32)
    assert ours == ref
    assert all(len(set(r)) > 3 for r in ref), "degenerate reference: the test would prove little"


def prompt_logprobs(ex: ModelExecutor, prompts: list[list[int]], chunk: int | None, ids: list[int], cached: int = 0):
    """The prompts' logprobs as the extend steps compute them, the prompts side by side (one row
    each per step, each in its own pages) in rows of `chunk` tokens (None: one row), from
    position `cached` on: the tokens before it were written by an earlier step that wanted no
    logprobs, as a cached prefix is. Per prompt: (logprob of token p + 1 at each position
    cached <= p < len - 1, [.., 3] top logprobs, [.., 3] top ids, [.., len(ids)]
    token_ids_logprob, (logprob, id) of the first output)."""
    book, k = PageBook(), np.asarray(ids, np.int32)
    arrs = [np.asarray(p, np.int32) for p in prompts]
    tables = [np.asarray(book.take(-(-len(p) // PAGE)), np.int32) for p in prompts]
    if cached:
        ex.run([DeviceRow(p[:cached], 0, t) for p, t in zip(arrs, tables, strict=True)])
    got: list[list[list[np.ndarray]]] = [[[], [], [], []] for _ in prompts]
    firsts: list[tuple[float, int]] = [(0.0, 0)] * len(prompts)
    lo, step = cached, chunk or max(map(len, prompts))
    while any(lo < len(p) for p in prompts):
        live = [i for i, p in enumerate(prompts) if lo < len(p)]
        rows = []
        for i in live:
            p, n = arrs[i], len(arrs[i])
            hi = min(n, lo + step)
            want = min(hi, n - 1) - lo  # positions of this row with a prompt token after them
            rows.append(DeviceRow(p[lo:hi], lo, tables[i], logprob_start=0, logprob_targets=p[lo + 1 : lo + 1 + want],
                                  logprob_ids=k))  # fmt: skip
        so = ex.run_step(rows)
        assert so.num_positions == sum(len(r.logprob_targets) for r in rows)
        pl, at = so.prompt, 0
        for j, (i, r) in enumerate(zip(live, rows, strict=True)):
            want = len(r.logprob_targets)
            for acc, a in zip(got[i], (pl.logprobs, pl.top_logprobs, pl.top_ids, pl.ids_logprobs), strict=True):
                acc.append(np.asarray(a)[at : at + want])
            at += want
            if lo + r.extend_len == len(prompts[i]):  # its last row: the first output
                firsts[i] = float(np.asarray(so.out.logprobs)[j]), int(np.asarray(so.out.tokens)[j])
        lo += step
    return [(*(np.concatenate(a) for a in g), f) for g, f in zip(got, firsts, strict=True)]


def check_prompt_logprobs(path, ex: ModelExecutor, prompts: list[list[int]], chunk: int | None, cached: int = 0) -> None:
    """Prompt logprobs, top-3 and token_ids_logprob equal HF's log-softmax within float32 error
    (1e-5 of the logit scale, as the logits above)."""
    ids = [0, 5, 17, 1999]
    for prompt, (lp, top, top_ids, id_lp, (first_lp, first)) in zip(
        prompts, prompt_logprobs(ex, prompts, chunk, ids, cached), strict=True
    ):
        ref = hf_logprobs(path, prompt)[cached:]  # positions cached, cached + 1, ...
        tol = 1e-5 * np.abs(hf_logits(path, prompt)).max()
        assert len(lp) == len(prompt) - 1 - cached
        assert np.abs(lp - ref[np.arange(len(lp)), prompt[cached + 1 :]]).max() <= tol
        assert np.abs(id_lp - ref[:-1][:, ids]).max() <= tol
        assert np.abs(top - np.sort(ref[:-1], axis=-1)[:, ::-1][:, :3]).max() <= tol
        np.testing.assert_array_equal(top_ids[:, 0], ref[:-1].argmax(-1))
        assert first == ref[-1].argmax() and abs(first_lp - ref[-1, first]) <= tol


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logprobs_match_hf_chunked_and_not(tiny_dir, family):
    """The logprob of every prompt token given the ones before it, computed by the extend steps
    that run anyway, equals HF's log-softmax; so do the top-3 and the logprobs of given token ids
    at each position. Two prompts side by side in each step (their positions packed row after
    row), chunked at 16 or in one row, cold or after a cached prefix of 32 tokens."""
    path = tiny_dir(family)
    ex = ModelExecutor(path, dataclasses.replace(CFG, top_logprobs_num=3, token_ids_logprob_num=4))
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 2000, n).tolist() for n in (45, 70)]
    for chunk in (16, None):
        for cached in (0, 32):
            check_prompt_logprobs(path, ex, prompts, chunk, cached)

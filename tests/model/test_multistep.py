"""Multi-step decode on the device (model/runtime/step.py `multi_step`): rows laid out as verify rounds of
NO_DRAFT places, k decode steps run one after another in one program, each step's sample the
next one's input. Every token, its logprob and the FutureMap afterwards must equal k plain
decode steps', greedy and seeded, with padding rows in the program."""

from __future__ import annotations

import numpy as np
import pytest

from ringserve.model.compute.step_inputs import Buckets, DeviceRow, DeviceSampling
from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor
from ringserve.model.runtime.programs import compile_order

PAGE, K = 16, 4


def needs_the_kernel() -> None:
    from ringserve.model.compute.kernels import cpu_attention

    if (why := cpu_attention.reason()) is not None:
        pytest.skip(f"the C++ attention kernel: {why}")


@pytest.fixture(scope="module")
def ex(tiny_dir):
    needs_the_kernel()
    cfg = ExecutorConfig(page_size=PAGE, num_pages=64, max_context_len=256, max_batch=4, max_extend_tokens=64,
                         extend_block=16, precompile=False, decode_steps=K, decode_steps_rows=4,
                         top_logprobs_num=3, attention_backend="cpu_kernel")  # fmt: skip
    return ModelExecutor(tiny_dir("llama"), cfg)


def plain(ex: ModelExecutor, prompts: list[np.ndarray], slots: list[int], pages: list[np.ndarray],
          sps: list[DeviceSampling], n: int) -> tuple[list[list[int]], list[list[float]]]:  # fmt: skip
    """n tokens of each row by plain decode steps (all rows in one batch), with their logprobs."""
    so = ex.run_step([DeviceRow(p, 0, pages[s], sp, future_slot=s) for p, s, sp in zip(prompts, slots, sps, strict=True)])
    toks = [[int(t)] for t in np.asarray(so.out.tokens)[: len(prompts)]]
    lps = [[float(x)] for x in np.asarray(so.out.logprobs)[: len(prompts)]]
    while len(toks[0]) < n:
        rows = [DeviceRow(np.array([-(s + 1)], np.int32), len(p) + len(toks[0]) - 1, pages[s], sp, future_slot=s)
                for p, s, sp in zip(prompts, slots, sps, strict=True)]  # fmt: skip
        so = ex.run_step(rows)
        for i in range(len(prompts)):
            toks[i].append(int(so.out.tokens[i]))
            lps[i].append(float(so.out.logprobs[i]))
    return toks, lps


@pytest.mark.parametrize("rows", [1, 3])  # a program of 2 and of 4 rows, each with padding rows
def test_multistep_rounds_equal_plain_decoding(ex, rows):
    rng = np.random.default_rng(rows)
    prompts = [rng.integers(3, 2000, int(n)).astype(np.int32) for n in rng.integers(3, 30, rows)]
    pages = [np.arange(1 + 15 * i, 16 + 15 * i, dtype=np.int32) for i in range(4)]
    sps = [DeviceSampling(logprobs=True), DeviceSampling(0.9, 40, 0.95, seed=11, logprobs=True),
           DeviceSampling(0.7, seed=5, logprobs=True)][:rows]  # fmt: skip
    n = 1 + 5 * K
    want, want_lp = plain(ex, prompts, [0, 1, 2][:rows], pages, sps, n + 1)

    slots = [3, 2, 1][:rows]  # the same prompts on other slots, then multi-step rounds
    got, got_lp = plain(ex, prompts, slots, pages, sps, 1)  # (the reference's pages: it is done)
    shape = None
    while len(got[0]) < n:
        batch = [DeviceRow(np.array([-(s + 1)] + [-1] * (K - 1), np.int32), len(p) + len(got[0]) - 1, pages[s], sp,
                           future_slot=s) for p, s, sp in zip(prompts, slots, sps, strict=True)]  # fmt: skip
        hb = ex.prepare(batch, K, multistep=True)
        shape = hb.shape
        out, accepted, _, _, _ = ex.run_host_batch(hb)
        toks = np.asarray(out.tokens)[: rows * K].reshape(rows, K)
        lps = np.asarray(out.logprobs)[: rows * K].reshape(rows, K)
        assert np.asarray(accepted)[:rows].tolist() == [K - 1] * rows
        for i in range(rows):
            got[i] += toks[i].tolist()
            got_lp[i] += lps[i].tolist()
    assert shape is not None and shape.multistep and shape.rows == Buckets.make(4, 64, 16).decode_batches[rows > 2]
    for i in range(rows):
        assert got[i] == want[i][:n], i
        np.testing.assert_allclose(got_lp[i], want_lp[i][:n], rtol=1e-5, atol=1e-5)
    # the FutureMap and the KV after the rounds are plain decoding's: one plain step continues them
    cont = [DeviceRow(np.array([-(s + 1)], np.int32), len(p) + n - 1, pages[s], sp, future_slot=s)
            for p, s, sp in zip(prompts, slots, sps, strict=True)]  # fmt: skip
    so = ex.run_step(cont)
    assert np.asarray(so.out.tokens)[:rows].tolist() == [w[n] for w in want]


def test_multistep_needs_a_backend_without_host_plans(tiny_dir):
    cfg = ExecutorConfig(page_size=PAGE, num_pages=64, max_context_len=256, max_batch=4, max_extend_tokens=64,
                         extend_block=16, precompile=False, decode_steps=K, attention_backend="native")  # fmt: skip
    with pytest.raises(ValueError, match="decode_steps=4.*native"):
        ModelExecutor(tiny_dir("llama"), cfg)


def test_multistep_programs_compiled_at_start_up_up_to_their_rows():
    b = Buckets.make(16, 64, 16)
    multi = b.families(0, K, 4)[-1]
    assert [(s.rows, s.tokens, s.verify, s.multistep) for s in multi] == [(2, 2 * K, K, True), (4, 4 * K, K, True)]
    assert b.fits(True, 3, 3 * K, K, multistep=True)[0] == multi[1]
    assert len(b.families(0, 1, 4)) == 2  # decode_steps 1: none
    assert [s.rows for s in b.families(0, K, 3)[-1]] == [2, 4]  # 3 rows run in the 4-row program
    assert [s.rows for s in b.families(0, K, 1)[-1]] == [2]
    order, lead = compile_order(b, [0], 0, 5, small_leads=True, steps=K, steps_rows=4)
    assert (multi[0], 5) in order[:lead] and (multi[1], 5) not in order[:lead]  # CPU: one stream's leads
    assert (multi[1], 5) in order[lead : lead + 3]  # the largest of each family right after
    order, lead = compile_order(b, [0], 0, 5, steps=K, steps_rows=4)
    assert (multi[1], 5) in order[:lead]


def test_multistep_program_converts_no_whole_weight_out_of_its_loop(tiny_dir):
    """XLA:CPU gathers bf16 embedding rows through f32; with the weights closed over, it hoisted
    that convert of the whole table out of the steps' loop (SmolLM2 bf16: 113 MB each call, 12.3
    -> 19 ms a token). The weights ride in the loop's carry through a barrier instead."""
    needs_the_kernel()
    cfg = ExecutorConfig(page_size=PAGE, num_pages=64, max_context_len=256, max_batch=4, max_extend_tokens=64,
                         extend_block=16, precompile=False, decode_steps=K, dtype="bfloat16")  # fmt: skip
    ex = ModelExecutor(tiny_dir("llama"), cfg)
    row = DeviceRow(np.array([-1] * K, np.int32), 10, np.arange(1, 5, dtype=np.int32), future_slot=0)
    hb = ex.prepare([row], K, multistep=True)
    text = ex.programs.get((hb.shape, ex.cfg.shapes.top_logprobs_num)).as_text()
    entry = text[text.index("\nENTRY") :]
    v, h = ex.model_config.vocab_size, ex.model_config.hidden_size
    assert not [line for line in entry.splitlines() if f"f32[{v},{h}]" in line], "a whole f32 table in the entry"

"""Verify steps (speculative decoding) on the device: rounds of k + 1 tokens planned at a bound
on each slot's length (its rounds in flight taken as all accepted), the true position read from
the FutureMap, the leading drafts equal to their targets accepted. Greedy tokens must equal plain
decoding whatever the drafts and the bounds, and the slot's KV must be right afterwards (a plain
decode row at the exact length continues it: a session's next turn)."""

from __future__ import annotations

import numpy as np
import pytest

from ringserve.model.compute.step_inputs import DeviceRow, DeviceSampling
from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor

PAGE, K = 16, 4


def executor(tiny_dir, backend: str) -> ModelExecutor:
    cfg = ExecutorConfig(page_size=PAGE, num_pages=64, max_context_len=256, max_batch=4, max_extend_tokens=64,
                         extend_block=16, precompile=False, verify_tokens=K + 1, attention_backend=backend)  # fmt: skip
    return ModelExecutor(tiny_dir("llama"), cfg)


def plain(
    ex: ModelExecutor, prompt: np.ndarray, pages: np.ndarray, slot: int, n: int, sp=DeviceSampling()
) -> list[int]:
    out, rows, _ = ex.run([DeviceRow(prompt, 0, pages, sp, future_slot=slot)])
    toks = [int(out.tokens[rows[0]])]
    while len(toks) < n:
        row = DeviceRow(
            np.array([-(slot + 1)], np.int32), len(prompt) + len(toks) - 1, pages, sp, future_slot=slot
        )
        out, rows, _ = ex.run([row])
        toks.append(int(out.tokens[rows[0]]))
    return toks


@pytest.mark.parametrize("backend", ["native", "cpu_kernel", "bucketed"])
def test_verify_rounds_equal_plain_decoding(tiny_dir, backend):
    if backend == "cpu_kernel":
        from ringserve.model.compute.kernels import cpu_attention

        if (why := cpu_attention.reason()) is not None:
            pytest.skip(f"the C++ attention kernel: {why}")
    ex = executor(tiny_dir, backend)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 2000, n).astype(np.int32) for n in (21, 9)]
    pages = [np.arange(1 + 12 * i, 13 + 12 * i, dtype=np.int32) for i in range(4)]
    n = 40
    refs = [plain(ex, p, pages[i], i, n + K + 1) for i, p in enumerate(prompts)]  # slots 0, 1

    # the same prompts again on slots 2, 3, then verify rounds with drafts right, wrong or absent
    slots = [2, 3]
    out, rows, _ = ex.run(
        [DeviceRow(p, 0, pages[s], future_slot=s) for p, s in zip(prompts, slots, strict=True)]
    )
    gen = [[int(out.tokens[rows[i]])] for i in range(2)]
    exact = [len(p) for p in prompts]  # KV tokens valid per slot
    in_flight = [0, 0]  # a bound the host would hold: a round in flight counted as all accepted
    rounds = 0
    while min(len(g) for g in gen) < n:
        batch, want = [], []
        for i, s in enumerate(slots):
            have = len(gen[i])
            drafts = np.array(refs[i][have : have + K] + [0] * K, np.int32)[:K]
            kind = rng.integers(0, 4)
            if kind == 1:  # a wrong draft somewhere
                j = int(rng.integers(0, K))
                drafts[j] = (drafts[j] + 1) % 2000 + 3
            elif kind == 2:  # fewer drafts (padding)
                drafts[int(rng.integers(0, K + 1)) :] = -1
            want.append(next((j for j in range(K) if drafts[j] != refs[i][have + j]), K))
            bound = exact[i] + in_flight[i]
            batch.append(
                DeviceRow(
                    np.concatenate([[-(s + 1)], drafts]).astype(np.int32), bound, pages[s], future_slot=s
                )
            )
        out, rows, accepted = ex.run(batch, K + 1)
        targets = np.asarray(out.tokens)[rows].reshape(2, K + 1)
        acc = np.asarray(accepted)[:2]
        for i in range(2):
            assert acc[i] == want[i], (rounds, i, acc[i], want[i])
            gen[i] += targets[i, : acc[i] + 1].tolist()
            exact[i] += int(acc[i]) + 1
            in_flight[i] = int(rng.integers(0, K + 2))  # the next round's bound: anything >= exact
        rounds += 1
    for i in range(2):
        assert gen[i][:n] == refs[i][:n], i
    assert rounds < n - 1  # drafts were accepted

    # the KV the rounds wrote is what plain decoding reads next (a session's next turn)
    for i, s in enumerate(slots):
        row = DeviceRow(np.array([-(s + 1)], np.int32), exact[i], pages[s], future_slot=s)
        out, rows, _ = ex.run([row])
        more = plain(ex, prompts[i], pages[i], i, len(gen[i]) + 1)
        assert int(out.tokens[rows[0]]) == more[-1]


def test_verify_with_seeded_sampling_draws_what_plain_decoding_draws(tiny_dir):
    """Each target is drawn at its own position with the request's seed: accepting a draft only
    when it equals that draw makes the output the same tokens plain decoding samples."""
    ex = executor(tiny_dir, "native")
    sp = DeviceSampling(temperature=1.3, top_k=20, seed=11)
    prompt = np.random.default_rng(2).integers(3, 2000, 13).astype(np.int32)
    pages = [np.arange(1 + 12 * i, 13 + 12 * i, dtype=np.int32) for i in range(2)]
    n = 24
    ref = plain(ex, prompt, pages[0], 0, n + K + 1, sp)
    out, rows, _ = ex.run([DeviceRow(prompt, 0, pages[1], sp, future_slot=1)])
    gen, exact = [int(out.tokens[rows[0]])], len(prompt)
    while len(gen) < n:
        drafts = np.array((ref[len(gen) : len(gen) + K] + [0] * K)[:K], np.int32)
        out, rows, accepted = ex.run(
            [DeviceRow(np.concatenate([[-2], drafts]).astype(np.int32), exact, pages[1], sp, 1)], K + 1
        )
        a = int(np.asarray(accepted)[0])
        gen += np.asarray(out.tokens)[rows][: a + 1].tolist()
        exact += a + 1
    assert gen[:n] == ref[:n]


def test_verify_shapes_compiled_at_start_up(tiny_dir):
    cfg = ExecutorConfig(page_size=PAGE, num_pages=64, max_context_len=256, max_batch=4, max_extend_tokens=64,
                         extend_block=16, verify_tokens=K + 1)  # fmt: skip
    ex = ModelExecutor(tiny_dir("llama"), cfg)
    verify = [s for s, _ in ex.programs.order if s.verify]
    assert sorted(s.tokens for s in verify) == [16, 32]  # 4 rounds of 5 tokens fit 32
    traced = ex.trace_count
    pages = np.arange(1, 9, dtype=np.int32)
    out, rows, _ = ex.run([DeviceRow(np.arange(3, 20, dtype=np.int32), 0, pages, future_slot=0)])
    ex.run([DeviceRow(np.array([-1, 5, 6, 7, 8], np.int32), 17, pages, future_slot=0)], K + 1)
    assert ex.trace_count == traced
    with pytest.raises(ValueError, match="rounds of 5 tokens"):
        ex.run([DeviceRow(np.array([-1, 5], np.int32), 17, pages, future_slot=0)], K + 1)

"""Sampling one step's tokens for 32 rows over SmolLM2's vocabulary (49,152), ringserve's
on-device sampler (model/runtime/sampler.py) vs what transformers' generate does on the same logits
(logits processors TemperatureLogitsWarper / TopKLogitsWarper / TopPLogitsWarper, softmax,
torch.multinomial), in the same run:

    .venv/bin/python -m pytest bench/test_sampler.py --benchmark-enable -p no:cacheprovider

Cases: greedy; temperature 0.8; temperature 0.8 with top-p 0.9 on peaked rows (the nucleus
fits the 256 top-k candidates) and on flat rows (it does not: the bisection path); top-k 50.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ringserve.model.compute.step_inputs import SamplingBatch
from ringserve.model.runtime.sampler import sample

ROWS, VOCAB = 32, 49152
CASES = {  # name: (logit scale, temperature, top_k, top_p)
    "greedy": (8.0, 0.0, -1, 1.0),
    "temperature": (8.0, 0.8, -1, 1.0),
    "top_p peaked": (8.0, 0.8, -1, 0.9),
    "top_p flat": (1.0, 0.8, -1, 0.9),
    "top_k 50": (8.0, 0.8, 50, 1.0),
}


def _logits(scale: float) -> np.ndarray:
    return (np.random.default_rng(0).standard_normal((ROWS, VOCAB)) * scale).astype(np.float32)


@pytest.mark.parametrize("case", list(CASES))
def test_sample_ringserve(benchmark, record, case):
    scale, temp, top_k, top_p = CASES[case]
    logits = jnp.asarray(_logits(scale))
    col = lambda x, dt: jnp.full((ROWS,), x, dt)  # noqa: E731
    sp = SamplingBatch(
        col(temp, jnp.float32), col(top_k, jnp.int32), col(top_p, jnp.float32), col(0.0, jnp.float32),
        jnp.arange(ROWS, dtype=jnp.uint32), jnp.arange(ROWS, dtype=jnp.int32) + 100,
        jnp.bool_(temp > 0), jnp.bool_(top_k > 0 or top_p < 1),
    )  # fmt: skip
    fn = jax.jit(lambda lg, s: sample(lg, s, 0).tokens)
    fn(logits, sp).block_until_ready()
    out = benchmark(lambda: fn(logits, sp).block_until_ready())
    assert out.shape == (ROWS,)
    record(("sample 32 rows x 49152", case, "ringserve"), ROWS)


@pytest.mark.parametrize("case", list(CASES))
def test_sample_transformers(benchmark, record, case):
    import torch
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    torch.set_num_threads(2)
    scale, temp, top_k, top_p = CASES[case]
    logits = torch.from_numpy(_logits(scale))
    procs = LogitsProcessorList()
    if temp > 0:
        procs.append(TemperatureLogitsWarper(temp))
    if top_k > 0:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        procs.append(TopPLogitsWarper(top_p))
    gen = torch.Generator().manual_seed(0)

    def step():
        if temp == 0:
            return torch.argmax(logits, dim=-1)
        scores = procs(None, logits)
        return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=gen)[:, 0]

    out = benchmark(step)
    assert out.shape == (ROWS,)
    record(("sample 32 rows x 49152", case, "transformers"), ROWS)

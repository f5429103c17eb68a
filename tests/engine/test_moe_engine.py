"""A mixture-of-experts model through the whole engine (every process) gives Hugging Face
transformers' greedy tokens, overlap on and off, chunked prefill and not (model/layers/moe.py)."""

from __future__ import annotations

import pytest

from tests.engine.conftest import engine_ctx, random_prompts
from tests.hf_ref import hf_greedy

MAX_NEW = 12
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


@pytest.mark.slow
def test_qwen3_moe_greedy_equals_hf_overlap_and_chunked(tiny_dir):
    path = tiny_dir("qwen3_moe")
    prompts = random_prompts(8, seed=9, lo=5, hi=70)
    want = hf_greedy(path, prompts, MAX_NEW)
    for overlap, chunk in ((True, 16), (False, -1)):
        with engine_ctx(path, page_size=16, chunked_prefill_size=chunk, disable_overlap_schedule=not overlap) as engine:
            outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
            assert [o["output_ids"] for o in outs] == want, (overlap, chunk)

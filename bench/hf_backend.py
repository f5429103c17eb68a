"""The peer: the same requests through HF transformers `generate` (PyTorch, CPU) on the same
checkpoint directory, as a static-batching server would run them.

Requests are served in batches of up to `batch` (left-padded): whenever the model is free it
takes the requests that have arrived (offline: all of them, sorted by prompt length so a batch
pads little; online: first come, first served) and generates greedily, EOS ignored, until the
longest of the batch is done (`min_new_tokens` = that length). A stopping criterion stamps
every generation step, so each request gets the same record a streaming client would write:
token j arrives at step j, the request is done at step `output_len`, its time counts from its
arrival. Only the requested tokens count as output (padding and a batch's extra steps are
transformers' cost, not work).
"""

from __future__ import annotations

import time
from typing import Any

from ringserve.bench.metrics import RequestRecord
from ringserve.bench.workload import Request


def load_model(model_dir: str, **kwargs: Any) -> Any:
    """The checkpoint in f32, for inference; `kwargs` go to `from_pretrained` (such as
    `experts_implementation`)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs).eval()


def _step_clock() -> tuple[Any, list[float]]:
    import torch
    from transformers import StoppingCriteria

    stamps: list[float] = []

    class Stamp(StoppingCriteria):
        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return Stamp(), stamps


def generate_batch(model: Any, prompts: list[list[int]], max_new: int) -> tuple[Any, list[float]]:
    """Left-padded greedy generation of exactly `max_new` tokens: (new token ids [B, max_new],
    the time each step's tokens were ready)."""
    import torch
    from transformers import StoppingCriteriaList

    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(p)
        mask[r, width - len(p) :] = 1
    stamp, stamps = _step_clock()
    with torch.no_grad():
        g = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                           do_sample=False, eos_token_id=None, pad_token_id=0,
                           stopping_criteria=StoppingCriteriaList([stamp]))  # fmt: skip
    return g[:, width:], stamps


def run_hf(model: Any, requests: list[Request], arrivals: list[float], batch: int = 32,
           progress: bool = True) -> tuple[list[RequestRecord], list[list[int]]]:  # fmt: skip
    """Records (as bench/metrics.py defines them) and the generated ids of every request."""
    from tqdm import tqdm

    n = len(requests)
    records = [RequestRecord(prompt_len=r.prompt_len) for r in requests]
    outputs: list[list[int]] = [[] for _ in requests]
    offline = all(a == 0.0 for a in arrivals)
    waiting = sorted(range(n), key=lambda i: (arrivals[i], i))
    bar = tqdm(total=n, desc="transformers", unit="req", disable=not progress, leave=False)
    start = time.perf_counter()
    while waiting:
        now = time.perf_counter() - start
        arrived = [i for i in waiting if arrivals[i] <= now]
        if not arrived:
            time.sleep(arrivals[waiting[0]] - now)
            continue
        if offline:
            arrived.sort(key=lambda i: len(requests[i].prompt))
        take = arrived[:batch]
        for i in take:
            waiting.remove(i)
        max_new = max(requests[i].output_len for i in take)
        new, stamps = generate_batch(model, [requests[i].prompt for i in take], max_new)
        assert len(stamps) >= max_new, f"{len(stamps)} step stamps for {max_new} tokens"
        for row, i in enumerate(take):
            k = requests[i].output_len
            rec = records[i]
            rec.sent = start + arrivals[i]
            rec.chunk_times = stamps[:k]
            rec.chunk_tokens = [1] * k
            rec.done = stamps[k - 1]
            rec.output_len = k
            outputs[i] = new[row, :k].tolist()
        bar.update(len(take))
    bar.close()
    return records, outputs

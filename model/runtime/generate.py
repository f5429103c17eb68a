"""Static-batch generation through the model runtime alone (no actors, no scheduler).

Every prompt is prefilled in extend steps no larger than the biggest bucket, then all are
decoded together until each hits EOS or `max_new_tokens`. Pages are handed out linearly (no
prefix cache). This is the runtime's own smoke path (`ringserve generate-static`).
"""

from __future__ import annotations

import numpy as np

from ringserve.kvmem.allocator import cdiv
from ringserve.model.compute.step_inputs import DeviceRow, DeviceSampling
from ringserve.model.runtime.executor import ModelExecutor


def generate(
    ex: ModelExecutor,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: DeviceSampling,
    eos_ids: set[int],
    on_token=None,
) -> list[list[int]]:
    cfg = ex.cfg.shapes
    page = cfg.page_size
    next_page = 1
    tables = []
    for p in prompts:
        need = cdiv(len(p) + max_new_tokens, page)
        if len(p) + max_new_tokens > cfg.max_context_len:
            raise ValueError(f"prompt of {len(p)} tokens + max_new_tokens={max_new_tokens} exceeds max_context_len={cfg.max_context_len}")
        if next_page + need > cfg.num_pages:
            raise ValueError(f"batch needs more than the {cfg.num_pages - 1} KV pages available; pass fewer prompts")
        tables.append(np.arange(next_page, next_page + need, dtype=np.int32))
        next_page += need
    params = [DeviceSampling(sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, sampling.seed + i) for i in range(len(prompts))]
    out: list[list[int]] = [[] for _ in prompts]
    # Prefill: one request per extend step, chunked to the largest extend bucket.
    chunk = ex.buckets.extend_tokens[-1]
    for i, p in enumerate(prompts):
        for start in range(0, len(p), chunk):
            piece = np.asarray(p[start : start + chunk], np.int32)
            res, rows, _ = ex.run([DeviceRow(piece, start, tables[i], params[i])])
        tok = int(np.asarray(res.tokens)[rows[0]])
        out[i].append(tok)
        if on_token:
            on_token(i, tok)
    live = [i for i in range(len(prompts)) if out[i][-1] not in eos_ids and max_new_tokens > 1]
    while live:
        for lo in range(0, len(live), cfg.max_batch):
            group = live[lo : lo + cfg.max_batch]
            batch = [DeviceRow(np.array([out[i][-1]], np.int32), len(prompts[i]) + len(out[i]) - 1, tables[i], params[i]) for i in group]
            res, rows, _ = ex.run(batch)
            toks = np.asarray(res.tokens)
            for i, r in zip(group, rows, strict=True):
                out[i].append(int(toks[r]))
                if on_token:
                    on_token(i, int(toks[r]))
        live = [i for i in live if out[i][-1] not in eos_ids and len(out[i]) < max_new_tokens]
    return out

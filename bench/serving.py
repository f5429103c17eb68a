"""Offline throughput: one mixed workload through the engine and through HF transformers
`generate` (static, left-padded batches) in the same run, on the same checkpoint.

    .venv/bin/python -m bench.serving --model tiny --num-requests 256
    .venv/bin/python -m bench.serving --model smollm2 --num-requests 256 --hf-batch 32

Workload (fixed seed): random token prompts of 16-512 tokens, 16-256 output tokens each,
EOS ignored so both sides produce exactly the requested tokens. Output tokens/s counts only
requested tokens (HF's padding and the extra steps of a static batch are its cost, not work).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np


@dataclasses.dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_new: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.max_new)


def make_workload(n: int, seed: int, vocab: int, in_range=(16, 512), out_range=(16, 256)) -> Workload:
    rng = np.random.default_rng(seed)
    lens = rng.integers(in_range[0], in_range[1] + 1, n)
    outs = rng.integers(out_range[0], out_range[1] + 1, n)
    return Workload([rng.integers(3, vocab, int(k)).tolist() for k in lens], [int(o) for o in outs])


def run_engine(model_dir: str, w: Workload, **server) -> tuple[float, dict, list[list[int]]]:
    from actors.frontend.engine import Engine

    with Engine(model_dir, **server) as engine:
        engine.generate(
            input_ids=w.prompts[:2], sampling_params={"max_new_tokens": 4, "temperature": 0}
        )  # warm
        sps = [{"max_new_tokens": k, "temperature": 0, "ignore_eos": True} for k in w.max_new]
        t = time.perf_counter()
        outs = engine.generate(input_ids=w.prompts, sampling_params=sps)
        dt = time.perf_counter() - t
        info = engine.get_server_info()
    return dt, info, [o["output_ids"] for o in outs]


def run_hf(model_dir: str, w: Workload, batch: int) -> tuple[float, list[list[int]]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    order = np.argsort([len(p) for p in w.prompts])  # similar lengths together: less padding
    outs: list[list[int]] = [[] for _ in w.prompts]
    t = time.perf_counter()
    with torch.no_grad():
        for lo in range(0, len(order), batch):
            idx = order[lo : lo + batch]
            width = max(len(w.prompts[i]) for i in idx)
            ids = torch.zeros((len(idx), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, i in enumerate(idx):
                p = w.prompts[i]
                ids[r, width - len(p) :] = torch.tensor(p)
                mask[r, width - len(p) :] = 1
            n = max(w.max_new[i] for i in idx)
            g = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               eos_token_id=None, pad_token_id=0)  # fmt: skip
            for r, i in enumerate(idx):
                outs[i] = g[r, width : width + w.max_new[i]].tolist()
    return time.perf_counter() - t, outs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serving")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--disable-overlap-schedule", action="store_true")
    a = ap.parse_args(argv)
    from model.checkpoints.resolve import resolve_model
    from model.checkpoints.config import ModelConfig

    path, _ = resolve_model(a.model)
    vocab = ModelConfig.from_dir(path).vocab_size
    w = make_workload(a.num_requests, a.seed, vocab)
    server = dict(max_running_requests=a.max_running_requests, page_size=a.page_size, context_length=1024,
                  max_total_tokens=a.max_running_requests * 1024, max_prefill_tokens=2048, chunked_prefill_size=512,
                  disable_overlap_schedule=a.disable_overlap_schedule)  # fmt: skip
    dt, info, ours = run_engine(str(path), w, **server)
    report = {
        "model": a.model, "requests": a.num_requests, "output_tokens": w.output_tokens,
        "ringserve_s": round(dt, 2), "ringserve_tok_s": round(w.output_tokens / dt, 1),
        "host_ms_per_step": round(info["host_s_per_step"] * 1e3, 3), "runner_ms_per_step": round(info["forward_s_per_step"] * 1e3, 3),
        "decode_steps": info["forward_ct_decode"], "prefill_steps": info["forward_ct_prefill"], "retracted": info["num_retracted"],
    }  # fmt: skip
    print(json.dumps(report), flush=True)  # ours first: the peer run can be long
    if not a.no_hf:
        hf_dt, theirs = run_hf(str(path), w, a.hf_batch)
        same = sum(o == t for o, t in zip(ours, theirs, strict=True))
        report.update(transformers_s=round(hf_dt, 2), transformers_tok_s=round(w.output_tokens / hf_dt, 1),
                      ratio_ours_over_transformers=round(hf_dt / dt, 2), identical_outputs=f"{same}/{len(ours)}")  # fmt: skip
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

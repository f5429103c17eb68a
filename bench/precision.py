"""Accuracy at low precision (issue 29): ringserve and HF transformers at bf16 (or f16), both
measured against HF transformers at float32, the truth.

    python -m ringserve.bench.precision --model tiny --dtype bfloat16
    python -m ringserve.bench.precision --model smollm2 --dtype bfloat16 --cpu-matmul xla --prompts 64 --new-tokens 32
    python -m ringserve.bench.precision --model smollm2 --quantization int8     # int8 weights, bf16 compute

Prompts: `--prompts` seeded random token ids (`3 <= id < vocab`, as bench/workload.py draws
them), lengths uniform in [16, 128]; nothing is downloaded (smollm2 must already be fetched).
Every system runs the same prompts, one at a time for HF (no padding), all together for
ringserve (model/runtime/generate.py: one prefill step per prompt, then batched decode), greedy, EOS
ignored, exactly `--new-tokens` tokens.

Measures, per system and precision, against HF float32:

    max_err    max |logit - truth| over the vocabulary at every prompt's last position (the
               first step's logits)
    mean_err   the mean of the same |logit - truth|
    equal      fraction of prompts whose whole greedy continuation equals the truth's
    prefix     mean length of the continuation's prefix that equals the truth's

HF's logits at low precision are its bf16 `lm_head` output; ringserve's are f32 at every
precision (its LM head accumulates and returns f32, model/layers/decoder.py `logits`). The bar: ringserve
f32 equals HF f32's greedy tokens; ringserve at low precision is within what HF gets at the same
precision. `--cpu-matmul` applies to ringserve's low-precision run (its f32 run uses "auto",
which is XLA's dot). Prints a table and one JSON line.

Measured (tiny llama, 64 prompts, 32 tokens, bfloat16, cpu_matmul auto = oneDNN; one run):

    system     dtype     max_err  mean_err  equal  prefix
    ringserve  float32   1.2e-04   1.9e-05  1.000   32.00
    hf         bfloat16  1.61      0.226    0.406   22.02
    ringserve  bfloat16  1.65      0.216    0.438   21.72

SmolLM2-135M-Instruct, 16 prompts, 16 tokens (64 x 32 ran past 7 minutes for HF f32 alone on
2 shared cores):

    ringserve  float32   1.2e-04   1.0e-05  1.000   16.00
    hf         bfloat16  0.836     0.123    0.250    6.94
    ringserve  bfloat16  0.486     0.092    0.688   12.06

SmolLM2-135M-Instruct, 64 prompts, 32 tokens (one run each, quiet machine; int8: the weights'
int8 images, bf16 compute, on both sides):

    ringserve  float32        8.5e-05   1.1e-05  1.000   32.00
    hf         bfloat16       0.739     0.123    0.484   18.00
    ringserve  bfloat16       0.630     0.103    0.641   22.05
    hf         int8/bfloat16  1.41      0.221    0.281   12.03
    ringserve  int8/bfloat16  1.89      0.225    0.359   14.95

The tiny checkpoints' top-2 logit gaps (>= ~0.03, model/checkpoints/tiny.py) are far below bf16's
error at their logit scale (~50), so greedy agreement at bf16 is low on both sides.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from ringserve.bench.workload import FIRST_ID
from ringserve.kvmem.allocator import cdiv

LOW_DTYPES = ("bfloat16", "float16")
PAGE = 16
PROMPT_LEN = (16, 128)


@dataclasses.dataclass(frozen=True, slots=True)
class Outputs:
    """One system's answers to the prompts."""

    logits: np.ndarray  # [P, V] float32: each prompt's first-step logits (its last position)
    greedy: list[list[int]]  # P continuations of exactly n_new tokens


@dataclasses.dataclass(frozen=True, slots=True)
class Accuracy:
    """One system at one precision against the truth (HF float32)."""

    system: str
    dtype: str
    max_err: float
    mean_err: float
    equal: float  # fraction of prompts with the whole continuation equal to the truth's
    prefix: float  # mean matched-prefix length, in tokens
    seconds: float  # wall time of this system's run (logits and greedy)


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(PROMPT_LEN[0], PROMPT_LEN[1] + 1, n)
    return [rng.integers(FIRST_ID, vocab, int(k)).tolist() for k in lens]


def matched_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def compare(system: str, dtype: str, got: Outputs, truth: Outputs, seconds: float) -> Accuracy:
    err = np.abs(got.logits.astype(np.float64) - truth.logits.astype(np.float64))
    prefixes = [matched_prefix(g, t) for g, t in zip(got.greedy, truth.greedy, strict=True)]
    n_new = len(truth.greedy[0])
    return Accuracy(system, dtype, float(err.max()), float(err.mean()),
                    float(np.mean([p == n_new for p in prefixes])), float(np.mean(prefixes)), seconds)  # fmt: skip


def int8_weights(m) -> None:
    """HF model `m`'s projections, LM head and embedding replaced in place by their int8 images
    (model/weights/quant.py quantize_int8, one scale per output row of HF's [out, in]): HF at the
    precision ringserve's `quantization="int8"` serves."""
    import torch

    from ringserve.model.families import family
    from ringserve.model.weights.quant import quantize_int8

    quantized = family("llama").quantized  # the Llama lineage's int8 modules (the benchmark's models)

    with torch.no_grad():
        for name, p in m.named_parameters():  # a tied head shares the embedding's tensor: done once
            if name.endswith(".weight") and name.split(".")[-2] in quantized:
                q, s = quantize_int8(p.detach().float().numpy(), -1)
                p.copy_(torch.from_numpy(q.astype(np.float32) * s[:, None]).to(p.dtype))


def hf_outputs(path: Path, prompts: list[list[int]], n_new: int, dtype: str, int8: bool = False) -> Outputs:
    """HF transformers generate, one prompt at a time; the first step's logits are generate's
    raw logits of step 0 (the model's own output dtype, widened to f32). `int8`: on the int8
    images of the weights (`int8_weights`), computed in `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32 if int8 else getattr(torch, dtype)).eval()
    if int8:
        int8_weights(m)
        m = m.to(getattr(torch, dtype))
    logits, greedy = [], []
    with torch.no_grad():
        for p in prompts:
            g = m.generate(torch.tensor([p]), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                           eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)  # fmt: skip
            logits.append(g.logits[0][0].float().numpy())
            greedy.append(g.sequences[0, len(p) :].tolist())
    return Outputs(np.stack(logits), greedy)


def ringserve_outputs(
    path: Path, prompts: list[list[int]], n_new: int, dtype: str, cpu_matmul: str = "auto", quantization: str | None = None
) -> Outputs:
    """ModelExecutor's diagnostic logits path (one prompt at a time, pages reused), then
    model/runtime/generate.py's greedy generation of all prompts on a fresh cache."""
    from ringserve.model.compute.step_inputs import DeviceRow, DeviceSampling
    from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor
    from ringserve.model.runtime.generate import generate

    longest = max(map(len, prompts)) + n_new
    cfg = ExecutorConfig(page_size=PAGE, num_pages=1 + sum(cdiv(len(p) + n_new, PAGE) for p in prompts),
                         max_context_len=cdiv(longest, PAGE) * PAGE, max_batch=len(prompts),
                         max_extend_tokens=PROMPT_LEN[1], dtype=dtype, cpu_matmul=cpu_matmul,
                         quantization=quantization, precompile=False)  # fmt: skip
    ex = ModelExecutor(path, cfg)
    logits = []
    for p in prompts:
        pages = np.arange(1, 1 + cdiv(len(p), PAGE), dtype=np.int32)
        out, _ = ex.logits([DeviceRow(np.asarray(p, np.int32), 0, pages)])
        logits.append(out[0])
    ex.kv_pool.new()
    greedy = generate(ex, prompts, n_new, DeviceSampling(temperature=0.0), eos_ids=set())
    return Outputs(np.stack(logits).astype(np.float32), greedy)


def measure(path: Path, dtype: str, n_prompts: int, n_new: int, cpu_matmul: str = "auto", seed: int = 0,
            log=lambda msg: None, quantization: str | None = None) -> list[Accuracy]:  # fmt: skip
    """Rows: HF and ringserve at float32, then at `dtype`, each against HF float32. With
    `quantization="int8"` the low-precision rows are int8 weights computed in `dtype`: HF on
    the weights' int8 images, ringserve quantized at load."""
    if dtype not in LOW_DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {LOW_DTYPES} (float32 is always run, as the truth)")
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(n_prompts, vocab, seed)
    int8 = quantization == "int8"
    low = f"int8/{dtype}" if int8 else dtype
    runs = [("hf", "float32", lambda: hf_outputs(path, prompts, n_new, "float32")),
            ("ringserve", "float32", lambda: ringserve_outputs(path, prompts, n_new, "float32")),
            ("hf", low, lambda: hf_outputs(path, prompts, n_new, dtype, int8)),
            (f"ringserve ({cpu_matmul})", low,
             lambda: ringserve_outputs(path, prompts, n_new, dtype, cpu_matmul, quantization))]  # fmt: skip
    truth, rows = None, []
    for system, dt, run in runs:
        t0 = time.perf_counter()
        out = run()
        seconds = time.perf_counter() - t0
        truth = out if truth is None else truth
        rows.append(compare(system, dt, out, truth, seconds))
        log(f"{system} {dt}: {seconds:.1f}s")
    return rows


def format_rows(rows: list[Accuracy]) -> str:
    head = f"{'system':22s} {'dtype':9s} {'max_err':>9s} {'mean_err':>9s} {'equal':>6s} {'prefix':>7s} {'time_s':>7s}"
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.system:22s} {r.dtype:9s} {r.max_err:9.2e} {r.mean_err:9.2e} {r.equal:6.3f} {r.prefix:7.2f} {r.seconds:7.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ringserve.bench.precision", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model", default="tiny", help="'tiny', 'smollm2' (already fetched) or a model directory"
    )
    ap.add_argument("--dtype", default="bfloat16", choices=LOW_DTYPES)
    ap.add_argument("--cpu-matmul", default="auto", choices=("auto", "xla", "onednn", "kernel"))
    ap.add_argument("--quantization", default=None, choices=("int8",),
                    help="the low-precision rows: int8 weights computed in --dtype")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.model == "smollm2":
        from ringserve.model.checkpoints.fetch import model_dir

        path = model_dir("smollm2")
        if not (path / "config.json").is_file():
            raise SystemExit(f"{path}: not fetched; run `ringserve fetch-model smollm2` first")
    else:
        from ringserve.model.checkpoints.resolve import resolve_model

        path, _ = resolve_model(a.model)
    rows = measure(path, a.dtype, a.prompts, a.new_tokens, a.cpu_matmul, a.seed,
                   log=lambda msg: print(msg, file=sys.stderr, flush=True), quantization=a.quantization)  # fmt: skip
    print(f"{a.model}: {a.prompts} prompts of {PROMPT_LEN[0]}-{PROMPT_LEN[1]} tokens, {a.new_tokens} greedy tokens; "
          "errors and agreement against HF float32")  # fmt: skip
    print(format_rows(rows))
    print(json.dumps({"model": a.model, "dtype": a.dtype, "quantization": a.quantization,
                      "cpu_matmul": a.cpu_matmul, "prompts": a.prompts,
                      "new_tokens": a.new_tokens, "seed": a.seed, "rows": [dataclasses.asdict(r) for r in rows]}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

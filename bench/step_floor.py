"""One step, measured against its floor and against HF transformers, per shape.

    python -m ringserve.bench.step_floor --model smollm2-135m
    python -m ringserve.bench.step_floor --model llama-3.2-1b --dtype bfloat16 --cases decode:1x512,decode:128x512
    python -m ringserve.bench.step_floor --model tiny --startup

For a random checkpoint of a named shape (model/checkpoints/random_shapes.py, made in place,
no hub) and each case it prints, in one run:

    step_ms    ringserve's step (the attention backend picked for this platform, or --backend)
    floor_ms   the same step with attention removed (backend "none": K/V still written)
    hf_ms      transformers' forward of the same tokens over a cache of the same length
    tok_s      new tokens per second of ringserve's step;  vs_hf = hf_ms / step_ms

Cases: `decode:BxC` (B rows, one new token each, C tokens of context) and `extend:BxN` (B
rows of N new tokens, empty context). Step contents do not change the cost, so caches are
not prefilled: ringserve attends over C positions of its (zero) cache, HF over a random cache.
`--startup` also times building an executor with the engine's default shapes from a cold
compilation cache (every bucket compiled), which is the first start-up's cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

DEFAULT_CASES = "decode:1x512,decode:128x512,decode:128x128,extend:4x512"


def parse_cases(text: str) -> list[tuple[str, int, int]]:
    out = []
    for item in text.split(","):
        kind, _, dims = item.partition(":")
        b, _, n = dims.partition("x")
        if kind not in ("decode", "extend") or not b.isdigit() or not n.isdigit():
            raise ValueError(f"case {item!r}: write decode:BxC or extend:BxN")
        out.append((kind, int(b), int(n)))
    return out


def model_dir(name: str):
    if name == "tiny":
        from ringserve.model.checkpoints.tiny import tiny_model_path

        return tiny_model_path("llama")
    from ringserve.model.checkpoints.random_shapes import random_model

    return random_model(name)


def timed(fn, repeat: int) -> float:
    """Median wall milliseconds of fn() (after one warm call)."""
    fn()
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def executor(path, backend: str, dtype: str, cases, precompile: bool = False, cpu_matmul: str = "auto",
             quantization: str | None = None):  # fmt: skip
    from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor

    page = 16
    max_batch = max(b for _, b, _ in cases)
    ctx = max(n + 1 for _, _, n in cases)
    pages = max(b * -(-(n + 1) // page) for _, b, n in cases)  # each case reuses pages 1, 2, ...
    cfg = ExecutorConfig(page_size=page, num_pages=pages + 2, max_context_len=max(ctx, 16), max_batch=max(2, max_batch),
                         max_extend_tokens=max(16, max(b * n for k, b, n in cases if k == "extend") if any(
                             k == "extend" for k, _, _ in cases) else 16), dtype=dtype, attention_backend=backend,
                         precompile=precompile, cpu_matmul=cpu_matmul, quantization=quantization)  # fmt: skip
    return ModelExecutor(path, cfg)


def ringserve_step(ex, kind: str, b: int, n: int, repeat: int) -> float:
    from ringserve.model.compute.step_inputs import DeviceRow

    page = ex.cfg.shapes.page_size
    rng = np.random.default_rng(0)
    per = -(-(n + 1) // page)
    rows = []
    for i in range(b):
        table = np.arange(1 + i * per, 1 + (i + 1) * per, dtype=np.int32)
        if kind == "decode":
            rows.append(DeviceRow(np.array([5], np.int32), n, table))
        else:
            rows.append(DeviceRow(rng.integers(3, 1000, n).astype(np.int32), 0, table))

    def step():
        out, _, _ = ex.run(rows)
        out.tokens.block_until_ready()

    return timed(step, repeat)


def hf_step(model, kind: str, b: int, n: int, repeat: int) -> float:
    import torch
    from transformers import DynamicCache

    cfg = model.config
    weight = next(model.parameters())
    dtype, dev = weight.dtype, weight.device
    if kind == "extend":
        ids = torch.randint(3, 1000, (b, n), device=dev)

        def run():
            with torch.no_grad():
                model(ids, use_cache=True, logits_to_keep=1).logits.argmax(-1).tolist()  # tolist: waits for a GPU

        return timed(run, repeat)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = DynamicCache(config=cfg)
    for layer in range(cfg.num_hidden_layers):
        kv = [torch.randn(b, cfg.num_key_value_heads, n, hd, dtype=dtype, device=dev) for _ in range(2)]
        cache.update(kv[0], kv[1], layer)
    nxt = torch.full((b, 1), 5, device=dev)

    def step():
        with torch.no_grad():
            model(nxt, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1).tolist()
            cache.crop(-1)  # back to n cached tokens: every call does the same work

    return timed(step, repeat)


def startup(path, dtype: str) -> dict:
    """Seconds to build an executor with the engine's default shapes, nothing cached: until it
    serves (the covering programs compiled: `serve_while_compiling`) and until every program is."""
    from ringserve.actors.runner.core import executor_config
    from ringserve.actors.server_args import ServerArgs
    from ringserve.actors.transport.memory import resolve_memory
    from ringserve.model.runtime.executor import ModelExecutor

    args, _ = resolve_memory(ServerArgs(model_path=str(path), dtype=dtype), path)  # type: ignore[arg-type]
    t = time.perf_counter()
    ex = ModelExecutor(path, executor_config(args))
    ready = time.perf_counter() - t
    ex.wait_compiled()
    return {"ready_s": round(ready, 1), "all_compiled_s": round(time.perf_counter() - t, 1), "programs": ex.num_programs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ringserve.bench.step_floor", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m, llama-3.2-1b or tiny")
    ap.add_argument("--cases", default=DEFAULT_CASES)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--backend", default="auto", help="attention backend of the measured step")
    ap.add_argument("--cpu-matmul", default="auto", choices=["auto", "xla", "onednn", "kernel"],
                    help="projections on CPU: XLA's dot, oneDNN's, or ringserve's kernel for few rows (auto: the best that runs)")
    ap.add_argument("--quantization", default=None, choices=["int8"], help="weight-only int8 projections")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--startup", action="store_true", help="also time a cold start-up (no compilation cache)")
    a = ap.parse_args(argv)
    import jax

    cases = parse_cases(a.cases)
    path = model_dir(a.model)
    main_ex = executor(path, a.backend, a.dtype, cases, cpu_matmul=a.cpu_matmul, quantization=a.quantization)
    floor_ex = executor(path, "none", a.dtype, cases, cpu_matmul=a.cpu_matmul, quantization=a.quantization)
    hf = None
    if not a.no_hf:
        import torch
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, a.dtype)).eval()
        if jax.devices()[0].platform == "gpu" and torch.cuda.is_available():
            hf = hf.cuda()
    platform = jax.devices()[0].platform
    print(f"# {a.model} {a.dtype} on {platform} ({jax.devices()[0].device_kind}); attention: {main_ex.plan.attention}; matmul: {main_ex.plan.dot.name}; "
          f"quantization: {a.quantization}")
    print(f"{'case':>18} {'step_ms':>9} {'floor_ms':>9} {'hf_ms':>9} {'tok_s':>10} {'vs_hf':>6}")
    rows = []
    for kind, b, n in cases:
        step = ringserve_step(main_ex, kind, b, n, a.repeat)
        floor = ringserve_step(floor_ex, kind, b, n, a.repeat)
        hf_ms = hf_step(hf, kind, b, n, max(2, a.repeat // 2)) if hf is not None else float("nan")
        new = b if kind == "decode" else b * n
        r = {"case": f"{kind} {b}x{n}", "step_ms": round(step, 2), "floor_ms": round(floor, 2),
             "hf_ms": round(hf_ms, 2), "tok_s": round(new / step * 1e3, 1), "vs_hf": round(hf_ms / step, 2)}  # fmt: skip
        rows.append(r)
        print(f"{r['case']:>18} {step:9.2f} {floor:9.2f} {hf_ms:9.2f} {r['tok_s']:10.1f} {r['vs_hf']:6.2f}", flush=True)
    report = {"model": a.model, "dtype": a.dtype, "platform": platform, "backend": main_ex.plan.attention, "matmul": main_ex.plan.dot.name,
              "quantization": a.quantization, "cases": rows}
    if a.startup:
        del main_ex, floor_ex
        report["startup"] = startup(path, a.dtype)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A mixture of experts served whole, against dense models of its total and of its active size and
against HF transformers, in one sitting (one process, one machine state):

    python -m ringserve.bench.moe_serving                  # the defaults below: 30 min on 2 busy cores
    python -m ringserve.bench.moe_serving --only moe --hf moe --hf-experts eager   # transformers' eager experts
    python -m ringserve.bench.moe_serving --hidden 64 --layers 2 --experts 4 --topk 2 --moe-inter 32 \\
        --batches 1 2 --repeat 1 --output-len 4            # a smoke run (tests/bench/test_moe_serving.py)

Three random checkpoints (`make-tiny-model`, seed 0), Qwen3-MoE's layout scaled down from
Qwen3-30B-A3B (hidden 2048, 128 experts, top 8, expert intermediate 768 = 0.375 hidden):

    moe           qwen3_moe: `--experts` experts of `--moe-inter`, top `--topk`, every layer sparse
    dense-total   qwen3 with the same TOTAL parameters: one MLP of intermediate E * moe_inter
                  (+ the router's H * E parameters spread over it), to the nearest multiple of 16
    dense-active  qwen3 with the same ACTIVE parameters (those one token reads): intermediate
                  k * moe_inter (+ the router's), to the nearest multiple of 16

The attention, embedding, head and vocabulary are the same in all three. Each model's exact total
and active parameter counts (from its safetensors) are printed and saved.

What is timed, per checkpoint, each `--repeat` times over fresh random prompts (no prefix hit):

    generate B    B requests at once of `--prompt-len` tokens, greedy, EOS ignored, exactly
                  `--output-len` new tokens each: output tokens / wall seconds of the whole batch
                  (its prefill of B * prompt-len tokens included), for each B in `--batches`
    prefill       `--prefill-prompts` prompts of `--prefill-len` tokens, 1 new token each:
                  prompt tokens / wall seconds

ringserve: one Engine per checkpoint (f32, `Engine.generate` of the whole batch; started and every
program compiled before anything is timed, then one untimed pass of each shape). transformers:
`generate` on the same directory, same prompts (no padding: equal lengths), f32, torch threads =
`--hf-threads`, greedy with `min_new_tokens = max_new_tokens`, after one untimed pass (hf on moe and
dense-total unless `--hf` says otherwise). The two see the same token ids; the table's `same` column
counts the requests of the largest batch whose tokens are identical (random weights: a near-tie can
flip one). Prints a table (medians, every value in the JSON) and writes `--output-json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ringserve.bench.workload import FIRST_ID

MODELS = ("moe", "dense-total", "dense-active")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m ringserve.bench.moe_serving", description=__doc__.split("\n")[0]
    )
    a = ap.add_argument
    a("--hidden", type=int, default=512)
    a("--layers", type=int, default=8)
    a("--heads", type=int, default=8, help="attention heads (head_dim = hidden / heads)")
    a("--kv-heads", type=int, default=4)
    a("--vocab", type=int, default=2048)
    a("--experts", type=int, default=32)
    a("--topk", type=int, default=4)
    a("--moe-inter", type=int, default=192, help="each expert's intermediate size")
    a("--batches", type=int, nargs="+", default=[1, 8, 32])
    a("--prompt-len", type=int, default=16)
    a("--output-len", type=int, default=64)
    a("--prefill-prompts", type=int, default=4)
    a("--prefill-len", type=int, default=256)
    a("--repeat", type=int, default=3)
    a(
        "--only",
        nargs="+",
        default=list(MODELS),
        choices=MODELS,
        help="the checkpoints to run (default: all three)",
    )
    a(
        "--hf",
        nargs="*",
        default=["moe", "dense-total"],
        choices=MODELS,
        help="checkpoints transformers runs too",
    )
    a("--hf-threads", type=int, default=2)
    a(
        "--hf-experts",
        default=None,
        help="transformers' experts_implementation (eager, grouped_mm; default: its own)",
    )
    a("--models-dir", default=None, help="where the checkpoints are written (default: a temporary directory)")
    a("--output-json", default="bench/results/moe_serving.json")
    return ap


def model_dims(a: argparse.Namespace) -> dict[str, tuple[str, dict]]:
    """Each checkpoint's family and make-tiny-model sizes (the module docstring says which is which)."""
    shared = dict(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
                  num_key_value_heads=a.kv_heads, head_dim=a.hidden // a.heads,
                  max_position_embeddings=max(4096, a.prefill_len, a.prompt_len + a.output_len))  # fmt: skip
    router = a.experts / 3  # the router's H * E parameters as intermediate width of a gated MLP (3 * H each)

    def near16(x: float) -> int:
        return max(16, int(round(x / 16)) * 16)

    moe = dict(num_experts=a.experts, num_experts_per_tok=a.topk, moe_intermediate_size=a.moe_inter,
               intermediate_size=a.moe_inter)  # fmt: skip
    return {"moe": ("qwen3_moe", shared | moe),
            "dense-total": ("qwen3", shared | {"intermediate_size": near16(a.experts * a.moe_inter + router)}),
            "dense-active": ("qwen3", shared | {"intermediate_size": near16(a.topk * a.moe_inter + router)})}  # fmt: skip


def param_counts(model_dir: Path) -> dict[str, int]:
    """Total parameters (every tensor of the safetensors) and active ones: what one token reads,
    all but the (E - k) experts of each layer it is not routed to."""
    from safetensors import safe_open

    from ringserve.model.families import read_config

    total = 0
    with safe_open(str(model_dir / "model.safetensors"), "np") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            total += int(np.prod(f.get_slice(name).get_shape()))
    c = read_config(model_dir)
    idle = (
        c.num_layers * (c.num_experts - c.num_experts_per_tok) * 3 * c.hidden_size * c.moe_intermediate_size
    )
    return {"total_params": total, "active_params": total - idle}


def prompts(n: int, length: int, vocab: int, seed: tuple[int, int]) -> list[list[int]]:
    return np.random.default_rng(seed).integers(FIRST_ID, vocab, (n, length)).tolist()


def processor() -> str:
    """/proc/cpuinfo's model name, its core count and whether it has AMX (the figures' machine)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
    cores = info.count("processor\t:")
    return (
        f"{name}, {cores} cores"
        + (", AMX" if " amx_tile" in flags else "")
        + (", AVX-512" if " avx512f" in flags else "")
    )


class Shapes:
    """The timed work, the same for every checkpoint and both engines: for repeat r, batch B's
    prompts and the prefill prompts (seeded by r and B, so ringserve and transformers match)."""

    def __init__(self, a: argparse.Namespace, vocab: int):
        self.a, self.vocab = a, vocab

    def generate(self, b: int, r: int) -> list[list[int]]:
        return prompts(b, self.a.prompt_len, self.vocab, (r + 1, b))

    def prefill(self, r: int) -> list[list[int]]:
        return prompts(self.a.prefill_prompts, self.a.prefill_len, self.vocab, (r + 1, 0))


class Ringserve:
    """One Engine on a checkpoint, sized for the bench's shapes."""

    name = "ringserve"

    def __init__(self, model_dir: Path, a: argparse.Namespace):
        from ringserve import Engine

        t0 = time.perf_counter()

        def up64(n: int) -> int:  # a multiple of every page and extend block
            return -(-n // 64) * 64

        ctx = up64(max(a.prompt_len + a.output_len, a.prefill_len + 1))
        # a prefill step takes the largest batch's prompts at once, or one prefill prompt
        self.engine = Engine(str(model_dir), max_running_requests=max(a.batches), context_length=ctx,
                             max_prefill_tokens=up64(max(a.prefill_len, max(a.batches) * a.prompt_len)), log_level="warning",
                             max_total_tokens=max(max(a.batches) * ctx, a.prefill_prompts * ctx) + 64 * 16)  # fmt: skip
        self.engine.wait_compiled()
        self.startup_s = time.perf_counter() - t0

    def run(self, ps: list[list[int]], new: int) -> list[list[int]]:
        sp = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
        out = self.engine.generate(input_ids=ps, sampling_params=sp)
        self.engine.flush_cache()
        return [o["output_ids"] for o in out]

    def close(self) -> None:
        self.engine.shutdown()


class Transformers:
    """HF transformers' generate on the same checkpoint (bench/hf_backend.py)."""

    name = "transformers"

    def __init__(self, model_dir: Path, a: argparse.Namespace):
        import torch

        from ringserve.bench.hf_backend import load_model
        from ringserve.model.families import read_config

        torch.set_num_threads(a.hf_threads)
        t0 = time.perf_counter()
        moe = read_config(model_dir).num_experts > 0
        extra = {"experts_implementation": a.hf_experts} if a.hf_experts and moe else {}
        self.model = load_model(str(model_dir), **extra)
        self.startup_s = time.perf_counter() - t0
        impl = getattr(self.model, "get_experts_implementation", None)
        self.experts = impl() if impl and moe else None

    def run(self, ps: list[list[int]], new: int) -> list[list[int]]:
        from ringserve.bench.hf_backend import generate_batch

        ids, _ = generate_batch(self.model, ps, new)
        return ids.tolist()

    def close(self) -> None:
        del self.model


def measure(server: Any, shapes: Shapes, a: argparse.Namespace) -> dict[str, Any]:
    """Every timed run of one server on one checkpoint: {"gen_B": [tok/s...], "prefill": [...],
    "ids_B": the largest batch's last outputs}. One untimed pass of each shape first."""

    def timed(ps: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        ids = server.run(ps, new)
        dt = time.perf_counter() - t0
        assert all(len(x) == new for x in ids), f"{server.name}: {[len(x) for x in ids]} tokens, want {new}"
        return dt, ids

    for b in a.batches:  # warm: first calls of each shape (allocator, caches, oneDNN primitives)
        server.run(shapes.generate(b, -1), a.output_len)
    server.run(shapes.prefill(-1), 1)
    res: dict[str, Any] = {"startup_s": round(server.startup_s, 2)}
    for r in range(a.repeat):
        for b in a.batches:
            dt, ids = timed(shapes.generate(b, r), a.output_len)
            res.setdefault(f"gen_{b}", []).append(b * a.output_len / dt)
            if b == max(a.batches):
                res["ids"] = ids
        dt, _ = timed(shapes.prefill(r), 1)
        res.setdefault("prefill", []).append(a.prefill_prompts * a.prefill_len / dt)
        print(f"  {server.name} repeat {r}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in res.items() if isinstance(v, list)
                                                           and k != "ids"), file=sys.stderr, flush=True)  # fmt: skip
    return res


def _cols(a: argparse.Namespace) -> list[str]:
    return [*(f"gen_{b}" for b in a.batches), "prefill"]


def table(rows: list[dict], a: argparse.Namespace) -> str:
    """Medians in tokens/s, then the ratios the issue asks for."""
    cols = _cols(a)
    med = {(r["model"], r["server"]): {c: statistics.median(r[c]) for c in cols} for r in rows}
    out = [
        f"{'model':13} {'server':12} {'params':>7} {'active':>7} "
        + " ".join(f"{c:>10}" for c in cols)
        + "  same"
    ]
    for r in rows:
        m = med[(r["model"], r["server"])]
        out.append(f"{r['model']:13} {r['server']:12} {r['total_params'] / 1e6:6.2f}M {r['active_params'] / 1e6:6.2f}M "
                   + " ".join(f"{m[c]:10.1f}" for c in cols) + f"  {r.get('same', '')}")  # fmt: skip
    out.append(
        "tokens/s, medians of " + str(a.repeat) + "; gen_B: B requests x "
        f"{a.output_len} new tokens after {a.prompt_len}; prefill: {a.prefill_prompts} x {a.prefill_len} tokens"
    )

    def ratio(x: tuple[str, str], y: tuple[str, str]) -> None:
        if x in med and y in med:
            out.append(f"{x[0] + ' ' + x[1] + ' / ' + y[0] + ' ' + y[1]:52} "
                       + " ".join(f"{med[x][c] / med[y][c]:9.2f}x" for c in cols))  # fmt: skip

    out.append("ratios (of the medians; > 1: the first faster)")
    for name in ("dense-total", "dense-active"):
        ratio(("moe", "ringserve"), (name, "ringserve"))
    for name in MODELS:
        ratio((name, "ringserve"), (name, "transformers"))
    ratio(("moe", "transformers"), ("dense-total", "transformers"))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict:
    from ringserve.model.checkpoints.tiny import make_tiny_model

    a = parser().parse_args(argv)
    work = tempfile.TemporaryDirectory(prefix="moebench-") if a.models_dir is None else None
    root = Path(a.models_dir or work.name)  # type: ignore[union-attr]
    rows: list[dict] = []
    t_start, load_start = time.perf_counter(), os.getloadavg()
    try:
        for name, (family, dims) in model_dims(a).items():
            if name not in a.only:
                continue
            model_dir = make_tiny_model(root / name, family, seed=0, **dims)
            cfg = json.loads((model_dir / "config.json").read_text())
            counts = param_counts(model_dir)
            shapes = Shapes(a, cfg["vocab_size"])
            print(f"{name}: {family}, intermediate {cfg['intermediate_size']}, {counts['total_params'] / 1e6:.1f}M "
                  f"parameters, {counts['active_params'] / 1e6:.1f}M active", file=sys.stderr, flush=True)  # fmt: skip
            kinds = [Ringserve] + ([Transformers] if name in a.hf else [])
            for kind in kinds:
                server = kind(model_dir, a)
                try:
                    res = measure(server, shapes, a)
                finally:
                    server.close()
                row = {"model": name, "server": kind.name, "family": family, **counts,
                       "intermediate_size": cfg["intermediate_size"], **res}  # fmt: skip
                if isinstance(server, Transformers) and server.experts is not None:
                    row["hf_experts_implementation"] = server.experts
                rows.append(row)
            ours = next(r for r in rows if r["model"] == name and r["server"] == "ringserve")
            for r in rows:
                if r["model"] == name and r["server"] == "transformers":
                    r["same"] = ours["same"] = sum(x == y for x, y in zip(ours["ids"], r["ids"], strict=True))
    finally:
        if work is not None:
            work.cleanup()
    for r in rows:
        r.pop("ids", None)
    import jax

    out = {"processor": processor(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "jax": jax.__version__, "args": vars(a), "wall_s": round(time.perf_counter() - t_start, 1),
           "loadavg_start_end": [load_start, os.getloadavg()], "runs": rows}  # fmt: skip
    try:
        import torch
        import transformers

        out |= {"torch": torch.__version__, "transformers": transformers.__version__}
    except ImportError:
        pass
    text = table(rows, a)
    print(f"\n{out['processor']}; jax {out['jax']}, f32\n{text}")
    if a.output_json:
        Path(a.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.output_json).write_text(json.dumps(out | {"table": text}, indent=1) + "\n")
        print(f"wrote {a.output_json}")
    return out


if __name__ == "__main__":
    main()

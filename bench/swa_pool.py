"""What the sliding layers' own KV pool (kvmem/local.py) buys, in the sizing the engine does at
start-up (actors/transport/memory.py `size_pool`), for Gemma 2 and 3's published shapes:

    python -m ringserve.bench.swa_pool [--memory-gib 16] [--max-running 64] [--backend pallas_ragged]

For each model at its longest context, in one group's memory (`--memory-gib`, mem_fraction_static
0.85, bf16 weights and KV in `--backend`'s layout on `--platform`): the global pool's tokens with
the sliding layers sharing it (`max_swa_tokens=0`, before) and with their own pool (after), the
local pool's tokens, the KV bytes, and how many requests at full context fit at once. Pure
arithmetic of the engine's own sizing code (no model runs); prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json

from ringserve.actors.server_args import ServerArgs
from ringserve.actors.transport.memory import size_pool
from ringserve.model.checkpoints.footprint import Footprint

GIB = 1 << 30
# name: (layers, query heads, KV heads, head_dim, parameters, sliding layers, window, longest context)
MODELS = {
    "gemma-2-2b": (26, 8, 4, 256, 2_614_000_000, 13, 4096, 8192),
    "gemma-2-9b": (42, 16, 8, 256, 9_242_000_000, 21, 4096, 8192),
    "gemma-3-1b": (26, 4, 1, 256, 1_000_000_000, 22, 512, 32768),
    "gemma-3-4b": (34, 8, 4, 256, 3_880_000_000, 29, 1024, 131072),
    "gemma-3-12b": (48, 16, 8, 256, 11_770_000_000, 40, 1024, 131072),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--memory-gib", type=float, default=16.0, help="one group's device memory")
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--backend", default="pallas_ragged")
    ap.add_argument("--platform", default="tpu")
    a = ap.parse_args()
    rows = []
    print(f"{'model':<12} {'context':>8} {'before':>10} {'after':>10} {'local':>8} {'KV GiB':>7} "
          f"{'full-context requests':>22}")  # fmt: skip
    for name, (layers, heads, kv, hd, params, sliding, window, ctx) in MODELS.items():
        fp = Footprint(layers, kv, hd, params, heads, sliding, window)
        args = ServerArgs(dtype="bfloat16", attention_backend=a.backend, max_running_requests=a.max_running,
                          context_length=ctx, mem_fraction_static=0.85)  # fmt: skip
        mem = int(a.memory_gib * GIB)
        if fp.weight_bytes("bfloat16") >= 0.85 * mem:
            continue
        pools = []
        for variant in (args.replace(max_swa_tokens=0), args):
            try:
                pools.append(size_pool(variant, fp, a.platform, mem))
            except ValueError:  # not even one request of the context fits
                pools.append(None)
        before, after = pools
        if after is None:
            continue
        tokens_before = before.max_total_tokens if before is not None else 0
        row = {"model": name, "context": ctx, "before_tokens": tokens_before,
               "after_tokens": after.max_total_tokens, "swa_tokens": after.swa_tokens,
               "kv_gib_before": round(before.kv_bytes / GIB, 3) if before is not None else None,
               "kv_gib_after": round(after.kv_bytes / GIB, 3),
               "requests_before": tokens_before // ctx, "requests_after": after.max_total_tokens // ctx}  # fmt: skip
        rows.append(row)
        shown = f"{tokens_before:,}" if before is not None else "no fit"
        print(f"{name:<12} {ctx:>8,} {shown:>10} {after.max_total_tokens:>10,} "
              f"{after.swa_tokens:>8,} {after.kv_bytes / GIB:>7.2f} "
              f"{row['requests_before']:>10} -> {row['requests_after']:<10}")  # fmt: skip
    print(json.dumps({"memory_gib": a.memory_gib, "max_running": a.max_running, "backend": a.backend, "rows": rows}))


if __name__ == "__main__":
    main()

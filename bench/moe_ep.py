"""Expert parallelism's two forms (model/layers/expert_parallel.py) on forced CPU devices, one
MoE MLP (gate, up, down) at a time, against the same layer on one device:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
        python -m ringserve.bench.moe_ep --ep 2 4 --tokens 16 64 256

    local   one device, every expert (combine_pairs)
    psum    the experts split over `ep` devices, every device sorting all T * k pairs and
            multiplying its experts' run, one psum of the combined [T, H]
    a2a     each device routing its T / ep tokens, all_to_all there and back, all_gather

Forced CPU devices share this machine's cores, so a form's time is its total work plus the
collectives' copies, not a multi-chip speed-up: what it measures is how much each form adds or
saves in work (the a2a form's padded slots, the psum form's every-pair sort). Default shape:
Qwen3-30B-A3B's expert layer scaled by 1/4 (H 512, I 192, 32 experts, k 8). Medians of
`--repeat` calls (float32, the CPU tiles grouped matmul). Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from ringserve.bench.moe import median_s
from ringserve.model.compute.dots import Dot
from ringserve.model.compute.grouped import GroupedDot
from ringserve.model.layers.expert_parallel import combine_pairs, expert_parallel
from ringserve.model.layers.mlp import silu
from ringserve.model.layers.moe import expert_product


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=192)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    h, i, e, k = args.hidden, args.inter, args.experts, args.topk
    rng = np.random.default_rng(0)
    ws = tuple(
        (jnp.asarray(rng.normal(size=s).astype(np.float32) / 16),) for s in ((e, h, i), (e, h, i), (e, i, h))
    )
    router = rng.normal(size=(h, e)).astype(np.float32)
    grouped, dot = GroupedDot("tiles"), Dot()

    def mlp(xs, sizes, row0, arrays, layer, grouped):
        wg, wu, wd = arrays
        y = silu(expert_product(xs, sizes, row0, wg, layer, grouped, dot, False))
        y = y * expert_product(xs, sizes, row0, wu, layer, grouped, dot, False)
        return expert_product(y, sizes, row0, wd, layer, grouped, dot, False)

    def route(x):
        top_p, top_i = jax.lax.top_k(jax.nn.softmax(x @ router, axis=-1), k)
        return top_p / top_p.sum(-1, keepdims=True), top_i

    rows = []
    for t in args.tokens:
        x = jnp.asarray(rng.normal(size=(t, h)).astype(np.float32))
        top_p, top_i = route(x)
        local = jax.jit(
            lambda x, p, i_, w: combine_pairs(x, p, i_, e, lambda xs, s: mlp(xs, s, 0, w, None, grouped))
        )
        row = {"tokens": t, "local_ms": median_s(local, x, top_p, top_i, ws, repeat=args.repeat) * 1e3}
        for ep in args.ep:
            mesh = jax.make_mesh((ep,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
            split = tuple(
                tuple(jax.device_put(a, jax.NamedSharding(mesh, jax.P("tp"))) for a in w) for w in ws
            )
            for form in ("psum", "a2a"):
                f = jax.jit(lambda x, p, i_, w, form=form, ep=ep: expert_parallel(form, ep, mlp, grouped, x, p, i_, w,
                                                                                   jnp.int32(0)))  # fmt: skip
                row[f"ep{ep}_{form}_ms"] = median_s(f, x, top_p, top_i, split, repeat=args.repeat) * 1e3
        rows.append(row)
        print(
            " ".join(f"{k_}={v:.2f}" if isinstance(v, float) else f"{k_}={v}" for k_, v in row.items()),
            flush=True,
        )
    print(
        json.dumps(
            {"hidden": h, "inter": i, "experts": e, "topk": k, "devices": jax.device_count(), "rows": rows}
        )
    )


if __name__ == "__main__":
    main()

"""The experts' grouped matmul (model/layers/moe.py, model/compute/grouped.py) against the dense
all-experts product and the active-parameter floor, one MoE MLP (gate, up, down) at a time:

    python -m ringserve.bench.moe                       # Qwen3-30B-A3B's expert shape, scaled
    python -m ringserve.bench.moe --hidden 2048 --inter 768 --experts 128 --topk 8 --tokens 1 16 256

    tiles     ringserve's layer on CPU: the T * k (token, expert) pairs sorted by expert, gate/up/down
              over each group's row tiles through the dot (XLA's; `--kernel`: also ringserve's
              kernel, reading each expert in place), weighted and summed back
    ragged_dot  the same through `jax.lax.ragged_dot` over the groups
    dense     every expert over every token (einsum over E), the unchosen ones weighted 0: what a
              grouped matmul must beat
    floor     the active parameters as one dense MLP: T tokens x an intermediate of k * inter
              (the same multiply-adds as the chosen experts; at one token the same weight bytes)

Times are medians of `--repeat` calls of one jitted function each (weights resident, f32 or
`--dtype`), on this machine's CPU (JAX_PLATFORMS=cpu). Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from ringserve.model.compute.dots import Dot
from ringserve.model.compute.grouped import GroupedDot
from ringserve.model.layers.mlp import silu


def _route(x, router, k):
    top_p, top_i = jax.lax.top_k(jax.nn.softmax(x @ router, axis=-1), k)
    return top_p / top_p.sum(-1, keepdims=True), top_i


def grouped_moe(x, router, wg, wu, wd, k, grouped=GroupedDot(), dot=Dot()):
    t = x.shape[0]
    top_p, top_i = _route(x, router, k)
    pair = top_i.reshape(-1)
    order = jnp.argsort(pair, stable=True)
    sizes = jnp.bincount(pair, length=wg.shape[0]).astype(jnp.int32)
    xs = jnp.take(x, order // k, axis=0)
    h = silu(grouped(xs, wg, sizes, dot)) * grouped(xs, wu, sizes, dot)
    ys = grouped(h, wd, sizes, dot)
    back = jnp.take(ys, jnp.argsort(order), axis=0).reshape(t, k, -1)
    return jnp.einsum("tkh,tk->th", back, top_p.astype(x.dtype))


def dense_moe(x, router, wg, wu, wd, k):
    top_p, top_i = _route(x, router, k)
    weight = jnp.zeros((x.shape[0], wg.shape[0]), x.dtype).at[jnp.arange(x.shape[0])[:, None], top_i].set(top_p)
    h = silu(jnp.einsum("th,ehi->eti", x, wg)) * jnp.einsum("th,ehi->eti", x, wu)
    return jnp.einsum("eti,eih,te->th", h, wd, weight)


def floor_mlp(x, g, u, d):
    return (silu(x @ g) * (x @ u)) @ d


def median_s(f, *args, repeat: int) -> float:
    """Median seconds of `repeat` calls of jitted `f` after one warm call (bench/moe_ep.py too)."""
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m ringserve.bench.moe", description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=384, help="each expert's intermediate size")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--kernel", action="store_true", help="also the tiles over ringserve's CPU matmul kernel")
    args = ap.parse_args(argv)
    h, i, e, k = args.hidden, args.inter, args.experts, args.topk
    dt = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32) / np.sqrt(shape[-2]), dt)

    router, wg, wu, wd = w(h, e), w(e, h, i), w(e, h, i), w(e, i, h)
    fg, fu, fd = w(h, k * i), w(h, k * i), w(k * i, h)
    paths = {"tiles": (GroupedDot("tiles"), Dot()), "ragged_dot": (GroupedDot("ragged_dot"), Dot())}
    if args.kernel:  # ringserve's CPU matmul kernel under the tiles (as the CPU plan's "kernel" dot)
        from ringserve.model.compute.dots import kernel_rows
        from ringserve.model.compute.kernels import cpu_matmul

        if cpu_matmul.reason(args.dtype) is None:
            paths["tiles+kernel"] = (GroupedDot("tiles"), Dot("kernel", ((args.dtype, args.dtype, kernel_rows(args.dtype, x_dtype=args.dtype)),)))
    fns = {name: jax.jit(functools.partial(grouped_moe, k=k, grouped=g, dot=d)) for name, (g, d) in paths.items()}
    fns["dense"] = jax.jit(functools.partial(dense_moe, k=k))
    floor = jax.jit(floor_mlp)
    rows = []
    for t in args.tokens:
        x = w(t, h)
        want = fns["dense"](x, router, wg, wu, wd)
        row: dict = {"tokens": t}
        for name, f in fns.items():
            diff = float(jnp.abs(f(x, router, wg, wu, wd).astype(jnp.float32) - want.astype(jnp.float32)).max())
            assert diff <= 1e-3 * float(jnp.abs(want).max()) + 1e-3, (name, diff)
            row[name + "_ms"] = 1e3 * median_s(f, x, router, wg, wu, wd, repeat=args.repeat)
        row["floor_ms"] = 1e3 * median_s(floor, x, fg, fu, fd, repeat=args.repeat)
        rows.append(row)
    names = [*fns, "floor"]
    print(f"H={h} I={i} E={e} k={k} {args.dtype} on {jax.devices()[0].device_kind}; ms per MoE MLP")
    print(f"{'tokens':>7} " + " ".join(f"{n:>12}" for n in names))
    for r in rows:
        print(f"{r['tokens']:>7} " + " ".join(f"{r[n + '_ms']:>12.2f}" for n in names))
    out = {"hidden": h, "inter": i, "experts": e, "topk": k, "dtype": args.dtype, "rows": rows}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()

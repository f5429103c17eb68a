"""A decode step's matmuls on CPU: XLA's dot, the cpu_matmul kernel and oneDNN, from memory.

    python -m ringserve.bench.cpu_matmul
    python -m ringserve.bench.cpu_matmul --dtypes bf16 --m 1 --repeats 11

Builds SmolLM2-135M's projections as distinct arrays, 30 layers of q 576x576, k 576x192,
v 576x192, o 576x576, gate 576x1536, up 576x1536, down 1536x576 ([K, N]) and the LM head
49152x576 ([N, K], a tied embedding), 134.5 M weights in all (538 MB f32), far more than the
caches hold, and times one jitted function that runs M rows of x through all of them once, for
each weight dtype (f32: x f32; bf16: x bf16; int8 + per-column f32 scale: x f32, each int8
weight stored [N, K] as the model stores it, model/compute/dots.py `Linear`; bf16nk: bf16 weights
stored [N, K] too, the layout question for bf16's decode) and method:

    xla      jnp.matmul (int8: w.astype(x) * scale, then the dot)
    kernel   model/compute/kernels/cpu_matmul.py
    grouped  the same, q/k/v and gate/up each as one call (`cpu_matmul.matmuls`, as the model runs it)
    onednn   model/compute/kernels/onednn.py (where `onednn.reason()` is None)

It prints the median ms per full pass over `--repeats` and the effective bandwidth (weight
bytes / time), against a plain read of 1 GiB by 2 threads (numpy, the GIL released), measured
before and after (the host's bandwidth drifts). Run it once more with
RINGSERVE_POOL_SPIN_US=300 for the kernel with its own spinning helper (model/compute/kernels/pool.h).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import numpy as np

LAYER = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]
HEAD = (49152, 576)  # [N, K]


def _nk(s) -> bool:
    """The scale slot of a bf16 weight stored [N, K] (dtype bf16nk): an empty array, no scale."""
    return s is not None and s.shape == (0,)


def read_bandwidth(threads: int = 2, gib: float = 1.0, repeats: int = 5) -> float:
    """GB/s of `threads` threads each reading their share of one array once (the best of
    `repeats`: the machine's plain streaming-read rate)."""
    a = np.ones(int(gib * (1 << 30)) // 8, np.uint64)
    parts = np.array_split(a, threads)
    best = float("inf")
    for _ in range(repeats):
        ts = [threading.Thread(target=np.max, args=(p,)) for p in parts]
        t = time.perf_counter()
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best / 1e9


def make_weights(dtype: str, layers: int, seed: int = 0):
    """[(w, scale | None)] per layer (7 each) and the head's: distinct arrays, small values."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)

    def one(k: int, n: int):
        if dtype == "int8":  # [N, K], as model/compute/dots.py's Linear stores int8
            q = rng.integers(-127, 128, (n, k), dtype=np.int8)
            return jnp.asarray(q), jnp.asarray((rng.random(n) * 1e-3).astype(np.float32))
        w = (rng.standard_normal((k, n), dtype=np.float32) * 0.02).astype(np.float32)
        if dtype == "bf16nk":  # bf16 stored [N, K]
            return jnp.asarray(w.T.copy(), jnp.bfloat16), jnp.zeros((0,), jnp.float32)
        return jnp.asarray(w, jnp.bfloat16 if dtype == "bf16" else jnp.float32), None

    stack = [[one(k, n) for k, n in LAYER] for _ in range(layers)]
    if dtype == "int8":
        hq = rng.integers(-127, 128, HEAD, dtype=np.int8)
        head = (jnp.asarray(hq), jnp.asarray((rng.random(HEAD[0]) * 1e-3).astype(np.float32)))
    else:
        hw = rng.standard_normal(HEAD, dtype=np.float32) * 0.02
        head = (jnp.asarray(hw, jnp.float32 if dtype == "f32" else jnp.bfloat16), None)
    return stack, head


def weight_bytes(stack, head) -> int:
    return sum(int(w.nbytes) for layer in stack for w, _ in layer) + int(head[0].nbytes)


def dot_fn(method: str):
    """mm(x, w, scale, transpose_w) for one method."""
    if method == "xla":

        def mm(x, w, s, t):
            s = None if _nk(s) else s
            if s is not None:  # dequantize: column n of the product is scaled by s[n]
                w = w.astype(x.dtype) * s.astype(x.dtype)[:, None] if t else w.astype(x.dtype) * s.astype(x.dtype)
            return x @ (w.T if t else w)

        return mm
    if method in ("kernel", "grouped"):
        from ringserve.model.compute.kernels import cpu_matmul

        return lambda x, w, s, t: cpu_matmul.matmul(x, w, transpose_w=t, scale=None if _nk(s) else s)
    from ringserve.model.compute.kernels import onednn

    return lambda x, w, s, t: onednn.matmul(x, w, transpose_w=t, scale=None if _nk(s) else s)


def forward(mm, grouped: bool = False):
    """One pass of x through every layer's projections (every output used) and the head;
    `grouped`: the projections that share x as one kernel call each (q/k/v, gate/up)."""
    import jax

    from ringserve.model.compute.kernels import cpu_matmul

    def group(x, pairs):
        t = pairs[0][1] is not None  # int8 weights are [N, K] (and bf16nk's)
        if not grouped:
            return [mm(x, w, s, t) for w, s in pairs]
        scales = None if not t or _nk(pairs[0][1]) else [s for _, s in pairs]
        return cpu_matmul.matmuls(x, [w for w, _ in pairs], transpose_w=t, scales=scales)

    def run(x, stack, head):
        for (wq, sq), (wk, sk), (wv, sv), (wo, so), (wg, sg), (wu, su), (wd, sd) in stack:
            q, k, v = group(x, [(wq, sq), (wk, sk), (wv, sv)])
            o = group(q, [(wo, so)])[0]
            g, u = group(x, [(wg, sg), (wu, su)])
            h = g * u
            kv = (k.sum(-1, keepdims=True) + v.sum(-1, keepdims=True)) * 1e-3
            x = (x + o + group(h, [(wd, sd)])[0] + kv.astype(x.dtype)) * 0.5
        return mm(x, head[0], head[1], True)

    return jax.jit(run)


def time_pass(fn, x, stack, head, repeats: int) -> float:
    fn(x, stack, head).block_until_ready()  # compile, warm
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(x, stack, head).block_until_ready()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ringserve.bench.cpu_matmul", description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="f32,bf16,int8")
    ap.add_argument("--m", default="1,4,16", help="rows of x")
    ap.add_argument("--methods", default="xla,kernel,onednn")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)

    import jax.numpy as jnp

    from ringserve.model.compute.kernels import cpu_matmul, onednn

    methods = []
    for m in args.methods.split(","):
        why = None if m == "xla" else onednn.reason() if m == "onednn" else cpu_matmul.reason()
        if why is None:
            methods.append(m)
        else:
            print(f"# {m}: skipped ({why})")
    ref = read_bandwidth()
    load = os.getloadavg()[0]
    spin = os.environ.get("RINGSERVE_POOL_SPIN_US", "0")
    print(f"# 2-thread read: {ref:.1f} GB/s   load1 {load:.2f}   threads cap "
          f"{os.environ.get('RINGSERVE_MATMUL_THREADS', 'none')}   RINGSERVE_POOL_SPIN_US={spin}")  # fmt: skip
    print(f"{'dtype':>5} {'M':>3} {'method':>7} {'ms':>8} {'GB/s':>6} {'%read':>6} {'vs xla':>7}")
    rows = []
    rng = np.random.default_rng(1)
    for dtype in args.dtypes.split(","):
        stack, head = make_weights(dtype, args.layers)
        nbytes = weight_bytes(stack, head)
        xdt = jnp.bfloat16 if dtype.startswith("bf16") else jnp.float32
        xname, wname = ("bfloat16", "bfloat16") if dtype.startswith("bf16") else ("float32", "int8" if dtype == "int8" else "float32")
        lacks = onednn.supports(xname, wname) if "onednn" in methods else None
        if lacks is not None:
            print(f"# onednn, {dtype}: skipped ({lacks})")
        for m in [int(v) for v in args.m.split(",")]:
            x = jnp.asarray(rng.standard_normal((m, 576)), xdt)
            base = None
            for method in methods:
                if method == "onednn" and lacks is not None:
                    continue
                sec = time_pass(forward(dot_fn(method), method == "grouped"), x, stack, head, args.repeats)
                base = sec if method == "xla" else base
                gbs = nbytes / sec / 1e9
                row = {"dtype": dtype, "m": m, "method": method, "ms": round(sec * 1e3, 3),
                       "gb_s": round(gbs, 2), "of_read": round(gbs / ref, 3),
                       "vs_xla": round(base / sec, 2) if base else None}  # fmt: skip
                rows.append(row)
                vs = f"{row['vs_xla']:.2f}x" if base else "-"
                print(f"{dtype:>5} {m:>3} {method:>7} {sec * 1e3:8.2f} {gbs:6.1f} {gbs / ref:6.0%} {vs:>7}", flush=True)
        del stack, head
    after = read_bandwidth()  # the host's bandwidth drifts (shared machine): measured again
    print(f"# 2-thread read after: {after:.1f} GB/s   load1 {os.getloadavg()[0]:.2f}")
    print(json.dumps({"read_gb_s": round(ref, 2), "read_after_gb_s": round(after, 2), "load1": round(load, 2),
                      "pool_spin_us": spin, "weight_layers": args.layers, "rows": rows}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

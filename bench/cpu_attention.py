"""One layer's paged attention on CPU through the cpu_attention custom call, from memory.

    python -m ringserve.bench.cpu_attention
    python -m ringserve.bench.cpu_attention --cases decode:64x256,extend:1x512 --dtype bf16 --repeats 50
    python -m ringserve.bench.cpu_attention --dtype bf16 --layout pairs      # the pair layouts (AVX512-BF16, AMX)

Each case is one call of model/compute/kernels/cpu_attention.cc with SmolLM2-135M's heads (9 query
heads, 3 KV heads, head dim 64, pages of 16 keys) over a pool of `--layers` layers (default 30,
so a layer's pages are not all in the caches, as in a step), the rows' pages scattered over it:

    decode:BxC   B rows of one query each, C keys of context
    extend:BxN   B rows of N new queries each (causal over their own N keys)

It prints the median ms per call, the KV bytes the call reads and their rate, and the same for a
whole step (x layers). The call is timed inside one jitted loop over the layers (the step's
pattern: 30 calls one after another), divided by the layers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def run_case(kind: str, b: int, n: int, dtype: str, layers: int, repeats: int, pages_order: str = "random",
             heads=(9, 3), d=64, s=16, layout: str = "plain"):  # fmt: skip
    import jax
    import jax.numpy as jnp

    from ringserve.model.compute.kernels import cpu_attention

    why = cpu_attention.reason()
    if why is not None:
        raise SystemExit(f"cpu_attention does not build here: {why}")
    h, hkv = heads
    ctx = n
    q_per_row = 1 if kind == "decode" else n
    pages_per_row = -(-ctx // s)
    pages = b * pages_per_row + 1
    rng = np.random.default_rng(0)
    perm = np.arange(pages - 1, dtype=np.int32) + 1  # page 0: unused, as the pool's null page
    if pages_order == "random":
        perm = rng.permutation(perm)
    table = perm.reshape(b, pages_per_row)
    t = b * q_per_row
    row_start = np.arange(b + 1, dtype=np.int32) * q_per_row
    kv_len = np.full(b, ctx, np.int32)
    if kind == "decode":
        positions = np.full(t, ctx - 1, np.int32)
    else:
        positions = np.tile(np.arange(n, dtype=np.int32), b)
    q = jnp.asarray(rng.standard_normal((t, h, d), np.float32))
    if dtype == "bf16":  # a bf16 model's queries (model/compute/attention/cpu_kernel.py passes them as they are)
        q = q.astype(jnp.bfloat16)

    def cache(shape):
        x = rng.standard_normal(shape, np.float32)
        if dtype == "bf16":
            return jnp.asarray((x.view(np.uint32) >> 16).astype(np.uint16))
        return jnp.asarray(x)

    k = cache((hkv, layers * pages, d, s))
    v = cache((hkv, layers * pages, s, d))
    if layout == "pairs":  # model/compute/attention/cpu_kernel.py's pair layouts (bf16 caches, AVX512-BF16)
        k = k.reshape(hkv, layers * pages, d // 2, 2, s).transpose(0, 1, 2, 4, 3)
        v = v.reshape(hkv, layers * pages, s // 2, 2, d).transpose(0, 1, 2, 4, 3)
    fb = [jnp.asarray(x) for x in (table, row_start, kv_len, positions)]

    def one(q, k, v, layer, table, row_start, kv_len, positions):
        return jax.ffi.ffi_call(cpu_attention.TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
            q, k, v, table, row_start, kv_len, positions, layer * pages, np.int32(0),  # the layer's base page
            scale=np.float32(d**-0.5), softcap=np.float32(0))  # fmt: skip

    @jax.jit
    def step(q, k, v, table, row_start, kv_len, positions):
        def body(acc, layer):
            return acc + one((q + acc * 0).astype(q.dtype), k, v, layer, table, row_start, kv_len, positions), None

        out, _ = jax.lax.scan(body, jnp.zeros(q.shape, jnp.float32), jnp.arange(layers, dtype=jnp.int32))
        return out

    step(q, k, v, *fb).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step(q, k, v, *fb).block_until_ready()
        times.append((time.perf_counter() - t0) * 1e3)
    ms = statistics.median(times)
    keys = b * ctx if kind == "decode" else b * n
    kv_bytes = keys * hkv * d * 2 * (2 if dtype == "bf16" else 4)
    return {"case": f"{kind} {b}x{n}", "dtype": dtype if layout == "plain" else f"{dtype} {layout}", "call_ms": ms / layers, "step_ms": ms,
            "kv_mb": kv_bytes / 1e6, "gb_s": kv_bytes * layers / (ms / 1e3) / 1e9,
            "best_step_ms": min(times)}  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m ringserve.bench.cpu_attention", description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="decode:1x256,decode:64x256,decode:64x512,extend:1x512")
    ap.add_argument("--dtype", nargs="+", default=["bf16", "f32"], choices=["bf16", "f32"])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--pages", default="random", choices=["random", "sequential"],
                    help="the rows' page tables: pages scattered over the pool, or each row's consecutive")
    ap.add_argument("--layout", default="plain", choices=["plain", "pairs"],
                    help="bf16 caches: the native layout, or the pair layouts (model/compute/attention/cpu_kernel.py)")
    a = ap.parse_args(argv)
    rows = []
    print(f"{'case':>16s} {'dtype':>5s} {'call ms':>8s} {'step ms':>8s} {'KV MB':>7s} {'GB/s':>6s}")
    for dt in a.dtype:
        for item in a.cases.split(","):
            kind, _, dims = item.partition(":")
            b, _, n = dims.partition("x")
            r = run_case(kind, int(b), int(n), dt, a.layers, a.repeats, a.pages,
                         layout=a.layout if dt == "bf16" else "plain")  # fmt: skip
            rows.append(r)
            print(f"{r['case']:>16s} {dt:>5s} {r['call_ms']:8.3f} {r['step_ms']:8.2f} {r['kv_mb']:7.2f} {r['gb_s']:6.1f}", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()

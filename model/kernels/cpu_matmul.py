"""y = x @ w for few rows on CPU (decode) as a custom call (cpu_matmul.cc), on every core.

Decoding one token reads every weight once for one row of x: the step's time is the time to
stream the weights from memory. XLA:CPU's dot at M=1 runs on about one core (~15 GB/s on the
2 Zen 4 cores measured), and oneDNN's custom call (onednn.py) pays ~55 us of queue overhead per
call (~12 ms over SmolLM2's 211 calls a step). This kernel deals column tiles to every thread of
XLA's intra-op pool, widens bf16 / int8 weights to f32 in registers and accumulates in f32; it
needs only g++ (built on first use, `-march=native`, model/kernels/build.py). Measured by
`python -m bench.cpu_matmul`: see its docstring for the figures.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model.kernels.build import loader

TARGET, TARGET_Q8 = "ringserve_cpu_matmul", "ringserve_cpu_matmul_q8"

reason = loader("cpu_matmul", ["-O3", "-march=native"], {TARGET: "RingserveCpuMatmul", TARGET_Q8: "RingserveCpuMatmulQ8"})
"""None when the kernel runs here; otherwise why not."""


def matmul(x: jax.Array, w: jax.Array, *, transpose_w: bool = False, scale: jax.Array | None = None,
           out_dtype=None) -> jax.Array:  # fmt: skip
    """x [..., K] @ w, w [K, N] (or [N, K] with transpose_w): [..., N] in `out_dtype` (x's by
    default). x f32 or bf16; w f32 or bf16, or int8 with `scale` [N] f32 (column n is
    w[:, n] * scale[n]); sums in f32. CPU only; call `reason()` first (the targets must be
    registered before a program is traced)."""
    n = w.shape[0] if transpose_w else w.shape[1]
    out = jax.ShapeDtypeStruct((*x.shape[:-1], n), out_dtype or x.dtype)
    if scale is None:
        return jax.ffi.ffi_call(TARGET, out)(x, w, transpose_w=transpose_w)
    return jax.ffi.ffi_call(TARGET_Q8, out)(x, w, scale.astype(jnp.float32), transpose_w=transpose_w)

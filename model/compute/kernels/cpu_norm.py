"""RMSNorm, and the residual add before it, for bf16 on CPU as a custom call (cpu_norm.cc), on the
cores of XLA's pool: one read of a row for its squares and one for its outputs, where XLA:CPU
made three or four passes (a 2048-token SmolLM2 bf16 prefill step spent ~40 ms of ~415 in
them). It gives what model/compute/norm.py's XLA `rms_norm` gives, to a bf16 step where the two sums of
squares round apart; it needs only a C++ compiler (built on first use, `-march=native`,
model/compute/kernels/build.py), and where it does not build the XLA expression runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ringserve.model.compute.kernels.build import loader

TARGET = "ringserve_cpu_rms_norm"

reason = loader("cpu_norm", ["-O3", "-march=native"], {TARGET: "RingserveCpuRmsNorm"})
"""None when the kernel runs here; otherwise why not."""


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """w * rmsnorm(x) for bf16 x [..., H] and w [H] (call only where `reason()` is None)."""
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape, jnp.bfloat16))(x, w, eps=np.float32(eps))


def add_rms_norm(x: jax.Array, a: jax.Array, w: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """(s, w * rmsnorm(s)) with s = x + a, all bf16 [..., H] (w [H]): the residual stream and the
    next sublayer's input in one pass."""
    out = jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
    s, y = jax.ffi.ffi_call(TARGET, (out, out))(x, a, w, eps=np.float32(eps))
    return s, y

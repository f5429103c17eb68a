"""How an RMSNorm computes: `Norm`, decided once per executor by the compute plan
(model/compute/plan.py) and handed to every RMSNorm module (model/layers/norm.py).

    plain      XLA's expression (`rms_norm`: statistics in f32, as HF)
    invariant  the same, batch-invariant (model/compute/dots.py `rowwise`): the deterministic mode
    kernel     bf16 on CPU under the kernel dots: cpu_norm's custom call (model/compute/kernels/
               cpu_norm.py), the residual add before it in the same pass (`add`)

Gemma's norm (`unit_offset`) scales by (1 + w) and rounds once at the end, all in f32 as HF's
Gemma2RMSNorm does (`rms_norm_unit_offset`); the kernel computes Llama's rounding, so it is
XLA's expression (batch-invariant in the deterministic mode).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ringserve.model.compute.dots import rowwise


@dataclasses.dataclass(frozen=True, slots=True)
class Norm:
    invariant: bool = False
    kernel: bool = False

    def __call__(self, x: jax.Array, w: jax.Array, eps: float, unit_offset: bool = False) -> jax.Array:
        norm = rms_norm_unit_offset if unit_offset else rms_norm
        if self.kernel and x.dtype == jnp.bfloat16 and not unit_offset:  # (the custom call is bf16's)
            from ringserve.model.compute.kernels import cpu_norm

            return cpu_norm.rms_norm(x, w, eps)
        if not self.invariant:
            return norm(x, w, eps)
        flat = x.reshape(-1, x.shape[-1])
        return rowwise(lambda a: norm(a, w, eps), flat).reshape(x.shape)

    def add(self, x: jax.Array, a: jax.Array, w: jax.Array, eps: float,
            unit_offset: bool = False) -> tuple[jax.Array, jax.Array]:  # fmt: skip
        """(x + a, self(x + a)): the residual stream and the next sublayer's input, in one pass
        where the kernel runs."""
        if self.kernel and x.dtype == jnp.bfloat16 and a.dtype == x.dtype and not unit_offset:
            from ringserve.model.compute.kernels import cpu_norm

            return cpu_norm.add_rms_norm(x, a, w, eps)
        s = x + a
        return s, self(s, w, eps, unit_offset)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis; statistics in f32 whatever the compute dtype, as HF does."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def rms_norm_unit_offset(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), all in f32, rounded to x's dtype once
    (HF's Gemma2RMSNorm / Gemma3RMSNorm: "(x * w).to(float16)", not Llama's "x.to(float16) * w")."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + w.astype(jnp.float32))).astype(x.dtype)

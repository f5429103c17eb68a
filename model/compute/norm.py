"""How an RMSNorm computes: `Norm`, decided once per executor by the compute plan
(model/compute/plan.py) and handed to every RMSNorm module (model/layers/norm.py).

    plain      XLA's expression (`rms_norm`: statistics in f32, as HF)
    invariant  the same, batch-invariant (model/compute/dots.py `rowwise`): the deterministic mode
    kernel     bf16 on CPU under the kernel dots: cpu_norm's custom call (model/compute/kernels/
               cpu_norm.py), the residual add before it in the same pass (`add`)
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

    def __call__(self, x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
        if self.kernel and x.dtype == jnp.bfloat16:  # (the custom call is bf16's)
            from ringserve.model.compute.kernels import cpu_norm

            return cpu_norm.rms_norm(x, w, eps)
        if not self.invariant:
            return rms_norm(x, w, eps)
        flat = x.reshape(-1, x.shape[-1])
        return rowwise(lambda a: rms_norm(a, w, eps), flat).reshape(x.shape)

    def add(self, x: jax.Array, a: jax.Array, w: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
        """(x + a, self(x + a)): the residual stream and the next sublayer's input, in one pass
        where the kernel runs."""
        if self.kernel and x.dtype == jnp.bfloat16 and a.dtype == x.dtype:
            from ringserve.model.compute.kernels import cpu_norm

            return cpu_norm.add_rms_norm(x, a, w, eps)
        s = x + a
        return s, self(s, w, eps)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis; statistics in f32 whatever the compute dtype, as HF does."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)

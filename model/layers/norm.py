"""RMSNorm as a module: weight [dim] (replicated), computed as the plan's `Norm` says
(model/compute/norm.py: XLA's expression, batch-invariant, or cpu_norm's kernel)."""

from __future__ import annotations

import jax
from flax import nnx

from ringserve.model.compute.norm import Norm
from ringserve.model.layers.linear import param


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis of x [T, ...]; `unit_offset`: Gemma's, scaled by (1 + weight)
    (model/compute/norm.py `rms_norm_unit_offset`)."""

    def __init__(self, dim: int, eps: float, dtype, how: Norm = Norm(), unit_offset: bool = False):
        self.weight = param((dim,), dtype)
        self.eps = eps
        self.how = how
        self.unit_offset = unit_offset

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.how(x, self.weight[...], self.eps, self.unit_offset)

    def add(self, x: jax.Array, a: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(x + a, self(x + a)): the residual stream and the next sublayer's input, in one pass
        where the kernel runs."""
        return self.how.add(x, a, self.weight[...], self.eps, self.unit_offset)

"""bf16 RMSNorm and the residual add before it as a custom call (model/compute/kernels/cpu_norm.py)
against model/compute/norm.py's XLA expressions, and the decoder layer taking it under the CPU
custom-call dots. Skips with the reason where it does not build."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ringserve.model.compute.dots import Dot
from ringserve.model.compute.kernels import cpu_norm
from ringserve.model.compute.norm import Norm, rms_norm
from ringserve.model.compute.options import ComputeOptions
from ringserve.model.compute.plan import norm_kernel
from ringserve.model.layers.norm import RMSNorm

pytestmark = pytest.mark.skipif(cpu_norm.reason() is not None, reason=f"cpu_norm: {cpu_norm.reason()}")


def _steps(got, want) -> np.ndarray:
    return np.abs(np.asarray(got).view(np.uint16).astype(np.int32) - np.asarray(want).view(np.uint16).astype(np.int32))


@pytest.mark.parametrize("shape", [(1, 576), (70, 576), (33, 50), (2, 3, 64)])
def test_the_norm_and_the_add_match_the_xla_expressions(shape):
    """Rows of 576, of 50 (no whole vector at the end), leading axes as rows: the residual sum
    is XLA's bit for bit; the norm within one bf16 step where the two sums of squares round
    apart, in under 2% of the values (most of them equal)."""
    k0, k1, k2 = jax.random.split(jax.random.PRNGKey(sum(shape)), 3)
    x = (jax.random.normal(k0, shape) * 3).astype(jnp.bfloat16)
    a = jax.random.normal(k1, shape).astype(jnp.bfloat16)
    w = (1 + 0.1 * jax.random.normal(k2, shape[-1:])).astype(jnp.bfloat16)
    got = jax.jit(lambda x, w: cpu_norm.rms_norm(x, w, 1e-5))(x, w)
    want = jax.jit(lambda x, w: rms_norm(x, w, 1e-5))(x, w)
    steps = _steps(got, want)
    assert steps.max() <= 1 and (steps > 0).mean() < 0.02
    s, y = jax.jit(lambda x, a, w: cpu_norm.add_rms_norm(x, a, w, 1e-5))(x, a, w)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(x + a))
    steps = _steps(y, jax.jit(lambda s, w: rms_norm(s, w, 1e-5))(x + a, w))
    assert steps.max() <= 1 and (steps > 0).mean() < 0.02


def test_the_norm_runs_in_the_kernel_for_bf16_under_the_kernel_dots_only():
    """RMSNorm takes the custom call for bf16 x under the kernel dots, XLA's expression under
    XLA's dot, for f32 and in the deterministic mode; `add` gives (x + a, norm(x + a)) either way."""

    def how(dtype, dot, det=False) -> Norm:  # the compute plan's choice (model/compute/plan.py)
        opts = ComputeOptions(dtype=jnp.dtype(dtype).name, enable_deterministic_inference=det)
        return Norm(invariant=det, kernel=norm_kernel(opts, 1, Dot(dot)))

    def calls(dtype, dot, det=False) -> bool:
        norm = RMSNorm(64, 1e-5, dtype, how(dtype, dot, det))
        return cpu_norm.TARGET in jax.jit(lambda x: norm(x)).lower(jnp.ones((4, 64), dtype)).as_text()

    assert calls(jnp.bfloat16, "kernel") and calls(jnp.bfloat16, "kernel+onednn")
    assert not calls(jnp.bfloat16, "xla") and not calls(jnp.float32, "kernel") and not calls(jnp.bfloat16, "kernel", True)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 64)), jnp.bfloat16)
    for dot in ("kernel", "xla"):
        norm = RMSNorm(64, 1e-5, jnp.bfloat16, how(jnp.bfloat16, dot))
        s, y = norm.add(x, x)
        np.testing.assert_array_equal(np.asarray(s), np.asarray(x + x))
        assert _steps(y, norm(x + x)).max() == 0

"""Weight-only int8 (`quantization="int8"`): every projection's weight, the LM head's and the
embedding's (the modules a family lists, model/families/base.py `Family.quantized`) are int8 with a
f32 `scale` beside each `weight`: one per output column of a projection ([..., out]), one per
token row of the embedding ([V]; a tied LM head's columns). `quantize_int8` makes them from the
checkpoint's floats at load and at every weight update (symmetric, round to nearest, max |w| ->
127). An int8 projection's weight is stored `[out, in]` (`[L, out, in]` stacked; model/layers/
linear.py Linear.transposed): the decode kernel streams each output's inputs as one run.
"""

from __future__ import annotations

import numpy as np

from ringserve.model.compute.options import QUANT_MODES
from ringserve.model.weights.memory import SCRATCH_MIN, scratch


def quant_axis(module: str) -> int:
    """The axis a quantized weight's scale reduces over: a projection's input features ([in, out]
    or [L, in, out]), an embedding row's hidden features ([V, H])."""
    return -1 if module == "embed_tokens" else -2


def quantize_int8(a: np.ndarray, axis: int, round_to=None) -> tuple[np.ndarray, np.ndarray]:
    """(int8 weight, f32 scale) of float `a`, first rounded to dtype `round_to` if given: one
    scale per slice along `axis` (max |a| / 127; 1 for an all-zero slice), a = q * scale up to
    half a step. Stacked weights go one layer at a time, so the f32 copy it needs is one layer's;
    a larger matrix scaled along its last axis (an embedding) goes ~4 MB of rows at a time:
    whole, each of its f32 temporaries (113 MB for SmolLM2's) was fresh memory whose huge pages
    the kernel may first compact (`scratch`). One temporary a pass, written in place; the
    values are those of max(|a|), a / scale, rint and clip taken one after another."""
    axis = axis - a.ndim if axis >= 0 else axis
    if a.ndim == 3:
        parts = [quantize_int8(a[i], axis, round_to) for i in range(a.shape[0])]
        return np.stack([q for q, _ in parts]), np.stack([sc for _, sc in parts])
    if a.ndim == 2 and axis == -1 and a.size * 4 > SCRATCH_MIN:
        rows = max(1, SCRATCH_MIN // (4 * a.shape[1]))
        q, scale = scratch(a.shape, np.int8), np.empty(a.shape[0], np.float32)
        for i in range(0, a.shape[0], rows):
            q[i : i + rows], scale[i : i + rows] = quantize_int8(a[i : i + rows], -1, round_to)
        return q, scale
    if round_to is not None:
        a = a.astype(round_to, copy=False)
    f = np.asarray(a, np.float32)
    amax = np.maximum(f.max(axis=axis), -f.min(axis=axis))  # max |f|, without an |f| array
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    t = f / np.expand_dims(scale, axis)
    np.rint(t, out=t)
    np.clip(t, -127, 127, out=t)
    return t.astype(np.int8), scale


def quantize_int8_jnp(a, round_to, qmax) -> tuple:
    """`quantize_int8(a, -1, round_to)` in jnp, for a state built on the device (model/weights/
    device_state.py): the same steps, so the same values (every op is exact or correctly
    rounded: max, division, round half to even, clip). XLA turns a division by a constant or
    a broadcast into a multiplication by its (inexact) reciprocal, one ulp off NumPy's, which
    moves a value at a rounding tie (common: amax / 2 of bf16 inputs is one): so 127 comes as
    `qmax`, a traced f32 scalar (an argument of the program), and the scales' broadcast goes
    behind an optimization barrier."""
    import jax
    import jax.numpy as jnp

    f = a.astype(round_to).astype(jnp.float32)
    amax = jnp.maximum(f.max(axis=-1), -f.min(axis=-1))
    scale = jnp.where(amax > 0, amax / qmax, jnp.float32(1)).astype(jnp.float32)
    den = jax.lax.optimization_barrier(jnp.broadcast_to(scale[..., None], f.shape))
    q = jnp.clip(jnp.round(f / den), -127, 127).astype(jnp.int8)
    return q, scale


def quant_transposed(module: str) -> bool:
    """Whether the int8 weight of `module` is stored [out, in] (every projection; the embedding
    is [V, H] either way)."""
    return module != "embed_tokens"


def out_in(q: np.ndarray) -> np.ndarray:
    """A projection's int8 weight [..., in, out] as stored: [..., out, in], contiguous."""
    return np.ascontiguousarray(np.swapaxes(q, -1, -2))


__all__ = ["QUANT_MODES", "quant_axis", "quant_transposed", "quantize_int8", "quantize_int8_jnp"]

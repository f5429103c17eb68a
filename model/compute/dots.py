"""Building blocks shared by the model families: `flax.nnx` modules (RMSNorm, Linear, Embedding,
the gated MLP) over the pure functions they compute (and rotary embedding's). Linear weights are
`[in, out]` (HF's `[out, in]` transposed at load, model/weights/state.py), so every projection is
`x @ w`. Each parameter is an `nnx.Param` annotated with its `tp` sharding (`out_sharding`,
model/compute/mesh.py); the loader places it so (model/layers/decoder.py: `CausalLM.place`), nothing shards eagerly.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from ringserve.model.config import RopeConfig

Sharding = tuple[str | None, ...]  # an `out_sharding`: mesh axis (or None) per dimension; () = replicated


def param(shape: tuple[int, ...], dtype, sharding: Sharding = ()) -> nnx.Param:
    """A parameter of `shape` with its `tp` sharding annotation. Zeros: modules are built
    abstractly (`nnx.eval_shape`) and filled from the checkpoint."""
    return nnx.Param(jnp.zeros(shape, dtype), out_sharding=sharding, eager_sharding=False)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis of x [T, ...]; weight [dim], replicated. Batch-invariant
    (`rowwise`) in the deterministic mode. `dot` (the layer's, `matmul`): under the CPU
    custom-call dots (kernel*) a bf16 norm runs in cpu_norm's kernel (model/compute/kernels/cpu_norm.py),
    where it builds."""

    def __init__(self, dim: int, eps: float, dtype, deterministic: bool = False, dot: str = "xla"):
        self.weight = param((dim,), dtype)
        self.eps = eps
        self.deterministic = deterministic
        self.dot = dot

    def _kernel(self, x: jax.Array) -> Any:
        """cpu_norm where it computes this norm of `x`, else None."""
        if self.deterministic or not self.dot.startswith("kernel") or x.dtype != jnp.bfloat16:
            return None
        from ringserve.model.compute.kernels import cpu_norm

        return cpu_norm if cpu_norm.reason() is None else None

    def __call__(self, x: jax.Array) -> jax.Array:
        w, eps = self.weight[...], self.eps
        if (kernel := self._kernel(x)) is not None:
            return kernel.rms_norm(x, w, eps)
        if not self.deterministic:
            return rms_norm(x, w, eps)
        flat = x.reshape(-1, x.shape[-1])
        return rowwise(lambda a: rms_norm(a, w, eps), flat).reshape(x.shape)

    def add(self, x: jax.Array, a: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(x + a, self(x + a)): the residual stream and the next sublayer's input, in one pass
        where the kernel runs."""
        if (kernel := self._kernel(x)) is not None and a.dtype == x.dtype:
            return kernel.add_rms_norm(x, a, self.weight[...], self.eps)
        s = x + a
        return s, self(s)


class Linear(nnx.Module):
    """x [T, in] @ weight [in, out] (+ bias [out], which shares the weight's output split).
    `sharding` of the [in, out] weight: (None, "tp") column-parallel, ("tp", None) row-parallel, ().
    `dot`: how the product is computed (`matmul`). `quant="int8"`: weight-only int8, the weight
    int8 and `scale` [out] f32 (output n is (x @ weight[n, :]) * scale[n]; model/weights/state.py
    quantizes), stored [out, in] (`transposed`, HF's own layout): each output's inputs are then
    one run of bytes, which the decode kernel streams 1.65x faster than [in, out]'s strided rows
    (SmolLM2's layers at M=1: 7.3 -> 4.4 ms; a whole bf16 + int8 decode step 14.7 -> 13.7 ms, medians
    of 4 alternating runs, 64 rows even; bf16 gains 1.14x and f32 1.09x alone: they stay [in, out])."""

    def __init__(self, n_in: int, n_out: int, dtype, sharding: Sharding = (), bias: bool = False,
                 dot: str = "xla", quant: str | None = None):  # fmt: skip
        self.transposed = quant is not None
        shape, split = ((n_out, n_in), tuple(reversed(sharding))) if quant else ((n_in, n_out), sharding)
        self.weight = param(shape, jnp.int8 if quant else dtype, split)
        self.scale = param((n_out,), jnp.float32, sharding[1:]) if quant else None
        self.bias = param((n_out,), dtype, sharding[1:]) if bias else None
        self.dot = dot

    def __call__(self, x: jax.Array, layer: jax.Array | int | None = None) -> jax.Array:
        return project(x, self, layer=layer)[0]


def project(x: jax.Array, *linears: Linear, layer: jax.Array | int | None = None) -> list[jax.Array]:
    """[lin(x) for lin in linears]: projections that share x (q/k/v, gate/up) as one custom call
    when each would run on the few-row kernel alone (`few_rows`; cpu_matmul.py `matmuls`: the
    same bits, one dispatch to the pool's threads instead of one per projection).

    Weights stacked over the layers (`Decoder`'s scan on CPU hands over each projection's
    whole stack, `[L, ...]`, weight and scale) multiply as layer `layer`'s (`matmul`)."""
    ws = [lin.weight[...] for lin in linears]
    scales = [None if lin.scale is None else lin.scale[...] for lin in linears]
    at = layer if ws[0].ndim == 3 else None  # per-layer weights (unrolled): `layer` is not theirs to index
    kernel = all(few_rows(lin.dot, x, w) for lin, w in zip(linears, ws, strict=True))
    if len(linears) > 1 and kernel and len({lin.transposed for lin in linears}) == 1:
        from ringserve.model.compute.kernels import cpu_matmul

        given = [s for s in scales if s is not None]  # every projection int8 (transposed), or none
        ys = cpu_matmul.matmuls(x, ws, transpose_w=linears[0].transposed, scales=given or None, layer=at)
    else:
        ys = [matmul(x, w, lin.dot, lin.transposed, s, layer=at) for lin, w, s in zip(linears, ws, scales, strict=True)]
    return [y if lin.bias is None else y + lin.bias[...] for lin, y in zip(linears, ys, strict=True)]


class Embedding(nnx.Module):
    """Token embedding, weight [V, H] (replicated); a tied checkpoint's LM head reads it too.
    `quant="int8"`: weight int8 and `scale` [V] f32, one per token's row (the LM head's columns)."""

    def __init__(self, vocab: int, hidden: int, dtype, quant: str | None = None):
        self.weight = param((vocab, hidden), jnp.int8 if quant else dtype)
        self.scale = param((vocab,), jnp.float32) if quant else None
        self.dtype = dtype

    def __call__(self, ids: jax.Array) -> jax.Array:
        rows = jnp.take(self.weight[...], ids, axis=0)
        if self.scale is None:
            return rows
        return (rows.astype(jnp.float32) * jnp.take(self.scale[...], ids)[:, None]).astype(self.dtype)


class GatedMLP(nnx.Module):
    """down(silu(gate(x)) * up(x)), the Llama/Qwen/Mistral MLP: gate/up column-parallel, down
    row-parallel (each replicated if `tp` does not divide the intermediate size)."""

    def __init__(self, hidden: int, inter: int, dtype, column: Sharding, row: Sharding, dot: str = "xla",
                 quant: str | None = None):  # fmt: skip
        self.gate_proj = Linear(hidden, inter, dtype, column, dot=dot, quant=quant)
        self.up_proj = Linear(hidden, inter, dtype, column, dot=dot, quant=quant)
        self.down_proj = Linear(inter, hidden, dtype, row, dot=dot, quant=quant)

    def __call__(self, x: jax.Array, lora: Any = None, layer: jax.Array | int | None = None) -> jax.Array:
        """`lora`: the layer's adapters (model/weights/lora.py LayerLora), added to each projection;
        `layer`: which layer's weights multiply, where they are stacked (`project`)."""
        if lora is None and (h := gated_kernel(x, self.gate_proj, self.up_proj, layer)) is not None:
            return self.down_proj(h, layer)
        g, u = project(x, self.gate_proj, self.up_proj, layer=layer)
        if lora is None:
            return self.down_proj(silu(g) * u, layer)
        h = silu(lora.apply("gate_proj", x, g)) * lora.apply("up_proj", x, u)
        return lora.apply("down_proj", h, self.down_proj(h, layer))


def gated_kernel(x: jax.Array, gate: Linear, up: Linear, layer: jax.Array | int | None) -> jax.Array | None:
    """silu(gate(x)) * up(x) as one custom call (cpu_matmul.py `gated`: where AMX multiplies, the
    two products are never written out; SmolLM2 bf16, a 2048-token prefill step [to be
    measured]), where both projections would run on the small-row kernel with bf16 x; else None."""
    wg, wu = gate.weight[...], up.weight[...]
    if x.dtype != jnp.bfloat16 or gate.transposed != up.transposed or not (few_rows(gate.dot, x, wg) and few_rows(up.dot, x, wu)):
        return None
    from ringserve.model.compute.kernels import cpu_matmul

    scales = None if gate.scale is None or up.scale is None else [gate.scale[...], up.scale[...]]
    if (gate.scale is None) != (up.scale is None) or gate.bias is not None or up.bias is not None:
        return None
    return cpu_matmul.gated(x, [wg, wu], transpose_w=gate.transposed, scales=scales, layer=layer if wg.ndim == 3 else None)


def silu(x: jax.Array) -> jax.Array:
    """x * sigmoid(x) computed in f32 and rounded to x's dtype once, as torch computes it for
    bf16 (`jax.nn.silu` on bf16 rounds after each of its five ops: XLA:CPU converts to f32 and
    back around each; SmolLM2's 2048-token bf16 prefill spent ~107 ms of 1.35 s in that fusion)."""
    xf = x.astype(jnp.float32)
    return (xf * jax.nn.sigmoid(xf)).astype(x.dtype)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis; statistics in f32 whatever the compute dtype, as HF does."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


INVARIANT_ROWS = 64


def rowwise(f, x: jax.Array) -> jax.Array:
    """f over the rows of x [T, ...], computed as T / 64 calls on one fixed shape [64, ...].

    Kernels pick their summation order by shape: measured on XLA CPU, row 0 of x @ w differs in
    most of its bits between T = 2 and T = 64, and an RMSNorm over 576 features between fewer
    and more than 8 rows. With one shape for every call, a token's row is computed the same way
    whatever the step's other rows are: the deterministic mode (`enable_deterministic_inference`)
    pays the padding and the loop for it."""
    t = x.shape[0]
    tiles = jnp.pad(x, [(0, -t % INVARIANT_ROWS)] + [(0, 0)] * (x.ndim - 1))
    out = jax.lax.map(f, tiles.reshape(-1, INVARIANT_ROWS, *x.shape[1:]))
    return out.reshape(-1, *out.shape[2:])[:t]


def invariant_matmul(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """x [T, K] @ w [K, N], batch-invariant (see `rowwise`)."""
    return rowwise(lambda a: jnp.matmul(a, w, preferred_element_type=out_dtype), x)


def matmul(x: jax.Array, w: jax.Array, dot: str = "xla", transpose_w: bool = False,
           scale: jax.Array | None = None, out_dtype=None, layer: jax.Array | int | None = None) -> jax.Array:  # fmt: skip
    """x @ w (w [K, N]; [N, K] with `transpose_w`) in `out_dtype` (x's by default), computed as
    `dot` says:

        xla            XLA's dot
        invariant      batch-invariant (`rowwise`): the deterministic mode's projections and LM head
        onednn         oneDNN's matmul as a custom call (model/compute/kernels/onednn.py; CPU, bf16 above all)
        kernel         a few rows (decode, `kernel_rows`): ringserve's own custom call, which streams
                       the weights on every core (model/compute/kernels/cpu_matmul.py); more rows: XLA's dot
        kernel+onednn  the same up to KERNEL_ROWS_BESIDE_ONEDNN rows, more rows through oneDNN

    `scale` [N] f32: w is int8, weight-only quantized (column n is w[:, n] * scale[n]); XLA's
    paths convert w to x's dtype inside the dot and scale its f32 result, the custom calls
    dequantize as they multiply.

    `layer`: w (and `scale`) are stacked over the layers, `[L, ...]`, and layer `layer`'s
    multiply: the custom calls read that layer in place, XLA's dots a slice of it (a copy)."""
    out_dtype = out_dtype or x.dtype
    if dot.startswith("kernel"):
        if few_rows(dot, x, w):
            from ringserve.model.compute.kernels import cpu_matmul

            return cpu_matmul.matmul(x, w, transpose_w=transpose_w, scale=scale, out_dtype=out_dtype, layer=layer)
        dot = "onednn" if dot == "kernel+onednn" else "xla"
    if dot == "onednn":
        from ringserve.model.compute.kernels import onednn

        return onednn.matmul(x, w, transpose_w=transpose_w, scale=scale, out_dtype=out_dtype, layer=layer)
    if layer is not None:
        w, scale = w[layer], None if scale is None else scale[layer]
    w = w.T if transpose_w else w
    if scale is not None:
        w = w.astype(x.dtype)
    if dot == "invariant":
        y = invariant_matmul(x, w, None if scale is None else jnp.float32)
    else:
        y = jnp.matmul(x, w, preferred_element_type=None if scale is None else jnp.float32)
    return (y if scale is None else y * scale).astype(out_dtype)


# The most rows the "kernel" dots send to cpu_matmul, by the vectors the kernel computes with
# (`cpu_matmul.lanes(dtype)`) and weight dtype; more rows go to XLA's dot. AVX-512 (2 Zen 4 cores),
# SmolLM2's whole decode step at 256 tokens of context, with the grouped call (q/k/v, gate/up as
# one): f32 kernel against XLA's dot 32.9 vs 38.7 ms at 4 rows, 45.6 vs 51.4 at 8, 67.3 vs 62.9
# at 16 (the kernel against oneDNN: KERNEL_ROWS_BESIDE_ONEDNN below). AVX2 alone (2 Zen 3 cores, no
# bf16 arithmetic, oneDNN without bf16 kernels): XLA's bf16 and int8 dots are slow at every
# decode size (the same step at 64 rows: bf16 439 ms on XLA's dot, 405 on XLA's f32 dot of
# widened operands, 252 on the kernel; int8 617 / 483 / 294; at 128 rows int8 753 on XLA's f32
# dot, 639 on the kernel), f32 wins to 16 rows (80 vs 99 ms; 32: 183 vs 166); with AVX2's packed
# panels (cpu_matmul.cc: above 6 rows each tile widened once, either layout) the kernel wins for
# f32 too: a pass over SmolLM2's projections at 64 rows (python -m ringserve.bench.cpu_matmul) f32 108 ms
# against XLA's 143, bf16 140 against 283, int8 98 against 303; the LM head alone at 64 rows f32
# 26 against 29, bf16 27 against 104, int8 42 against 91; the whole f32 step, one process,
# alternating with XLA's dot (medians of 11 and 9), 64 rows 247 vs 256 ms, 32 rows 157 vs 173.
# Without oneDNN on AVX-512 (2 Zen 4 cores, 2026-12-01; one executor per setting in one process,
# steps alternated, 256 tokens of context) XLA's bf16 and int8 dots are as slow as on AVX2: bf16
# 16 rows 239.5 ms on XLA's dot against 47.4 on the kernel, 64 rows 345.6 / 152.5, 128 rows
# 461.4 / 281.8; int8 (x as int16 through vpdpwssd up to 64 rows) 32 rows 153.3 / 68.5, 64 rows
# 215.4 / 134.0, and at 128 rows the kernel's f32 widening 435.3 against XLA's 372.8.
KERNEL_ROWS = {
    16: {"float32": 8, "bfloat16": 128, "int8": 64},
    8: {"float32": 128, "bfloat16": 128, "int8": 128},
}

# The same for "kernel+onednn", where the larger steps go to oneDNN reading its packed copy of
# each weight (model/compute/kernels/onednn_matmul.cc; 8 rows or more): where oneDNN has bf16 kernels,
# AVX-512 or newer. SmolLM2's whole decode step at 256 tokens of context, medians of 15, two
# runs: bf16 kernel 31.2/31.3 ms at 8 rows against oneDNN's 27.6/27.3; int8 30.5/32.8 against
# 30.3/31.2 at 8 rows and 66.1/54.5 against 42.1/39.6 at 16. At 4 rows the kernel wins (bf16
# 20.4/20.8 ms against 35.3/32.7: oneDNN reads fewer than 8 rows from the plain weight). int8 with
# x as int16 (vpdpwssd, AVX-512 VNNI; 2026-12-01, alternated in one process): the kernel 19.3 ms
# at 8 rows against oneDNN's 30.4, 36.0 against 39.7 at 16; at 32 rows oneDNN 58.0 against 68.0.
KERNEL_ROWS_BESIDE_ONEDNN = {"float32": 8, "bfloat16": 4, "int8": 16}


# bf16 weights (and int8 ones, above cpu_matmul.cc kS8PairRows rows) times bf16 rows where the
# kernel reads them from packed pairs (AVX512-BF16, model/compute/kernels/pairs.h: the executor registers
# its weights): every step, prefill too. SmolLM2, one executor per setting
# in one process, steps alternated (2 Zen 4 cores, 2026-12-01), against oneDNN's packed copies:
# decode at 256 tokens of context, 16 rows 45.2 -> 29.1 ms, 32 rows 72.7 -> 52.1, 64 132.4 ->
# 95.2, 128 272.9 -> 192.6; prefill of 256 tokens 216 -> 204 ms, 512 556 -> 419, 2048 2189 -> 2116.
PAIR_ROWS = 1 << 30


def kernel_rows(dtype: str, beside_onednn: bool = False, x_dtype: str = "bfloat16") -> int:
    """The most rows of x (of `x_dtype`) the "kernel" dots send to cpu_matmul for weights of
    `dtype` (plain loops, or a width not measured: AVX-512's figures)."""
    from ringserve.model.compute.kernels import cpu_matmul

    if x_dtype == "bfloat16" and dtype in ("bfloat16", "int8") and cpu_matmul.packs_pairs(dtype):
        return PAIR_ROWS
    if beside_onednn:
        return KERNEL_ROWS_BESIDE_ONEDNN.get(dtype, 0)
    return KERNEL_ROWS.get(cpu_matmul.lanes(dtype), KERNEL_ROWS[16]).get(dtype, 0)


# The dots whose custom calls read a layer's weights in place from a stack over the layers
# (`matmul(layer=)`): with them CPU scans its layers (model/compute/plan.py resolve_layer_loop) and
# the scan hands each projection's whole stack over (model/layers/decoder.py Decoder)
STACK_READING_DOTS = ("kernel", "kernel+onednn", "onednn")


def few_rows(dot: str, x: jax.Array, w: jax.Array) -> bool:
    """Whether `matmul(x, w, dot)` runs on the small-row kernel (rows are static in a trace)."""
    if not dot.startswith("kernel"):
        return False
    return math.prod(x.shape[:-1]) <= kernel_rows(jnp.dtype(w.dtype).name, dot == "kernel+onednn", jnp.dtype(x.dtype).name)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies [head_dim // 2], with llama3 / linear scaling applied.

    Computed in float32 the way transformers does, so positions in the thousands rotate by the
    same angles as the reference to the last bit that matters."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv = (np.float32(1.0) / np.power(np.float32(rope.theta), exponent)).astype(np.float32)
    if rope.rope_type == "linear":
        inv = inv / rope.factor
    elif rope.rope_type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


# The most entries (positions x D/2) of a cos or sin table baked into a program (4 MB of f32).
ROPE_TABLE_MAX = 1 << 20


@functools.lru_cache(maxsize=8)
def _rope_table(positions: int, inv_freq: bytes) -> np.ndarray:
    """[2, positions, D/2]: cos and sin of position x inv_freq (f32 angles), made once for every
    program that traces them (a server traces a few dozen)."""
    angles = np.arange(positions, dtype=np.float32)[:, None] * np.frombuffer(inv_freq, np.float32)[None, :]
    return np.stack([np.cos(angles.astype(np.float64)), np.sin(angles.astype(np.float64))]).astype(np.float32)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray, table_positions: int | None = None,
                ) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """(cos, sin) [T, 1, D/2] for the step's positions, used by every layer.

    With `table_positions` (CPU: the KV pages' whole span, every position a step can hold) they
    are gathered from tables made once on the host, else computed in the program. XLA:CPU fuses
    cos and sin into every layer's q and k rotation and evaluates them per head and layer, and
    drops optimization barriers before fusion: SmolLM2's 2048-token bf16 prefill spent 2.9 ms
    a layer in the q rotation's fusion (0.4 ms with the tables). The tables hold the same f32
    angles' cos and sin, correctly rounded (computed in float64)."""
    if table_positions is not None and table_positions * inv_freq.size <= ROPE_TABLE_MAX:
        table = _rope_table(table_positions, inv_freq.astype(np.float32).tobytes())
        cs = jnp.take(jnp.asarray(table), positions, axis=1, mode="clip")  # [2, T, D/2]
        return cs[0][:, None, :], cs[1][:, None, :]
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    return jnp.cos(freqs)[:, None, :], jnp.sin(freqs)[:, None, :]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF convention: pairs are (i, i + d/2)). x: [T, heads, D]."""
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)

"""How the projections and the LM head multiply: `Dot`, decided once per executor by the compute
plan (model/compute/plan.py) and handed to every Linear (model/layers/linear.py), which calls it:

    xla            XLA's dot (every accelerator; CPU where no custom call builds)
    invariant      batch-invariant (`rowwise`): the deterministic mode's projections and LM head
    onednn         oneDNN's matmul as a custom call (model/compute/kernels/onednn.py; CPU, bf16 above all)
    kernel         a few rows (decode, `kernel_rows`): ringserve's own custom call, which streams
                   the weights on every core (model/compute/kernels/cpu_matmul.py); more rows: XLA's dot
    kernel+onednn  the same up to KERNEL_ROWS_BESIDE_ONEDNN rows, more rows through oneDNN

A Dot carries its row thresholds, resolved once for the weight and compute dtypes it serves
(`Dot.rows`): how many rows of x go to the few-row kernel is a fact of the plan, not of the trace.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

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


@dataclasses.dataclass(frozen=True, slots=True)
class Dot:
    """How x @ w computes (the module docstring's names). `rows`: (weight dtype, x dtype, most
    rows) the few-row kernel takes, resolved by the plan for the dtypes it serves."""

    name: str = "xla"
    rows: tuple[tuple[str, str, int], ...] = ()

    @property
    def invariant(self) -> bool:
        return self.name == "invariant"

    @property
    def kernel(self) -> bool:
        """Few rows go through ringserve's custom call (and, with bf16 x, the fused gated MLP)."""
        return self.name.startswith("kernel")

    @property
    def onednn(self) -> bool:
        """Some steps multiply through oneDNN's custom call (which keeps packed copies)."""
        return "onednn" in self.name

    @property
    def reads_stack(self) -> bool:
        """The custom calls read layer l's weights in place from a stack over the layers
        (`layer=`): with them CPU scans its layers (model/compute/plan.py `layer_loop`) and the
        scan hands each projection's whole stack over (model/layers/decoder.py)."""
        return self.kernel or self.onednn

    def max_rows(self, w_dtype: str, x_dtype: str) -> int:
        """The most rows of x the few-row kernel takes for these dtypes (0: none)."""
        if not self.kernel:
            return 0
        for w, x, n in self.rows:
            if (w, x) == (w_dtype, x_dtype):
                return n
        return kernel_rows(w_dtype, self.onednn, x_dtype)  # (a pair the plan did not resolve)

    def few_rows(self, x: jax.Array, w: jax.Array) -> bool:
        """Whether `self(x, w)` runs on the few-row kernel (rows are static in a trace)."""
        return self.kernel and math.prod(x.shape[:-1]) <= self.max_rows(jnp.dtype(w.dtype).name, jnp.dtype(x.dtype).name)

    def __call__(self, x: jax.Array, w: jax.Array, transpose_w: bool = False, scale: jax.Array | None = None,
                 out_dtype=None, layer: jax.Array | int | None = None) -> jax.Array:  # fmt: skip
        """x @ w (w [K, N]; [N, K] with `transpose_w`) in `out_dtype` (x's by default).

        `scale` [N] f32: w is int8, weight-only quantized (column n is w[:, n] * scale[n]); XLA's
        paths convert w to x's dtype inside the dot and scale its f32 result, the custom calls
        dequantize as they multiply.

        `layer`: w (and `scale`) are stacked over the layers, `[L, ...]`, and layer `layer`'s
        multiply: the custom calls read that layer in place, XLA's dots a slice of it (a copy)."""
        out_dtype = out_dtype or x.dtype
        name = self.name
        if self.kernel:
            if self.few_rows(x, w):
                from ringserve.model.compute.kernels import cpu_matmul

                return cpu_matmul.matmul(x, w, transpose_w=transpose_w, scale=scale, out_dtype=out_dtype, layer=layer)
            name = "onednn" if self.onednn else "xla"
        if name == "onednn":
            from ringserve.model.compute.kernels import onednn

            return onednn.matmul(x, w, transpose_w=transpose_w, scale=scale, out_dtype=out_dtype, layer=layer)
        if layer is not None:
            w, scale = w[layer], None if scale is None else scale[layer]
        w = w.T if transpose_w else w
        if scale is not None:
            w = w.astype(x.dtype)
        if name == "invariant":
            y = invariant_matmul(x, w, None if scale is None else jnp.float32)
        else:
            y = jnp.matmul(x, w, preferred_element_type=None if scale is None else jnp.float32)
        return (y if scale is None else y * scale).astype(out_dtype)

    def matmuls(self, x: jax.Array, ws: list[jax.Array], transpose_w: bool, scales: list[jax.Array] | None,
                layer: jax.Array | int | None) -> list[jax.Array] | None:  # fmt: skip
        """[x @ w for w in ws] as one custom call where each product would run on the few-row
        kernel alone (cpu_matmul.py `matmuls`: the same bits, one dispatch to the pool's threads
        instead of one per projection); None where they run apart."""
        if len(ws) < 2 or not all(self.few_rows(x, w) for w in ws):
            return None
        from ringserve.model.compute.kernels import cpu_matmul

        return cpu_matmul.matmuls(x, ws, transpose_w=transpose_w, scales=scales, layer=layer)

    def gated(self, x: jax.Array, ws: list[jax.Array], transpose_w: bool, scales: list[jax.Array] | None,
              layer: jax.Array | int | None) -> jax.Array | None:  # fmt: skip
        """silu(x @ gate) * (x @ up) as one custom call (cpu_matmul.py `gated`: where AMX
        multiplies, the two products are never written out), where both would run on the few-row
        kernel with bf16 x; else None."""
        if x.dtype != jnp.bfloat16 or not all(self.few_rows(x, w) for w in ws):
            return None
        from ringserve.model.compute.kernels import cpu_matmul

        return cpu_matmul.gated(x, ws, transpose_w=transpose_w, scales=scales, layer=layer)


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

"""Paged attention on CPU as a custom call (cpu_attention.cc), on every core of XLA's pool.

XLA:CPU runs the native backend's loop (model/compute/attention/native.py) on one core: each step of
it is small, and XLA parallelises within an op, never across a loop's independent lanes. The
kernel deals (row, KV head, 8-query block) items to all of XLA's intra-op threads and walks
each row's own pages with an online softmax; it needs only a C++ compiler (built on first use,
`-march=native`, model/compute/kernels/build.py), and `attention_backend=auto` on CPU uses it where it
builds, the pure-JAX native backend where it does not. Where the CPU has AVX512-BF16 it also
reads bf16 caches in the pair layouts (cpu_attention.cc's header; `reads_pairs`), through AMX
where Linux lends it (`uses_amx`).
"""

from __future__ import annotations

import ctypes

from ringserve.model.compute.kernels.build import loader

TARGET = "ringserve_cpu_attention"

_LIB: list[ctypes.CDLL] = []


def _check(lib: ctypes.CDLL) -> None:
    _LIB.append(lib)


reason = loader("cpu_attention", ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp-simd"], {TARGET: "RingserveCpuAttention"},
                check=_check)  # fmt: skip
"""None when the kernel runs here; otherwise why not."""


def reads_pairs() -> bool:
    """Whether the kernel reads bf16 caches in the pair layouts (AVX512-BF16); False where it
    does not build."""
    return reason() is None and bool(_LIB[0].ringserve_cpu_attention_pairs())


def uses_amx() -> bool:
    """Whether it multiplies them through AMX's tiles (Linux lent them; RINGSERVE_AMX=0: not)."""
    return reads_pairs() and bool(_LIB[0].ringserve_cpu_attention_amx())

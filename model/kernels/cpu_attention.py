"""Paged attention on CPU as a custom call (cpu_attention.cc), on every core of XLA's pool.

XLA:CPU runs the native backend's loop (model/attention/native.py) on one core: each step of
it is small, and XLA parallelises within an op, never across a loop's independent lanes. The
kernel deals (row, KV head, 8-query block) items to all of XLA's intra-op threads and walks
each row's own pages with an online softmax; it needs only a C++ compiler (built on first use,
`-march=native`, model/kernels/build.py), and `attention_backend=auto` on CPU uses it where it
builds, the pure-JAX native backend where it does not.
"""

from __future__ import annotations

from model.kernels.build import loader

TARGET = "ringserve_cpu_attention"

reason = loader("cpu_attention", ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd"], {TARGET: "RingserveCpuAttention"})
"""None when the kernel runs here; otherwise why not."""

"""Paged attention on CPU as a custom call (cpu_attention.cc), on every core of XLA's pool.

XLA:CPU runs the native backend's loop (model/attention/native.py) on one core: each step of
it is small, and XLA parallelises within an op, never across a loop's independent lanes. The
kernel deals (row, KV head, 8-query block) items to all of XLA's intra-op threads and walks
each row's own pages with an online softmax; it needs only a C++ compiler (built on first use,
`-march=native`, model/kernels/build.py), and `attention_backend=auto` on CPU uses it where it
builds, the pure-JAX native backend where it does not.
"""

from __future__ import annotations

import functools

import jax

from model.kernels.build import build

TARGET = "ringserve_cpu_attention"


@functools.cache
def _load() -> tuple[bool, str]:
    try:
        lib = build("cpu_attention", ["-O3", "-march=native", "-ffast-math"])
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.RingserveCpuAttention), platform="cpu")
    except (OSError, RuntimeError, AttributeError) as e:
        return False, str(e)
    return True, ""


def reason() -> str | None:
    """None when the kernel runs here; otherwise why not."""
    ok, why = _load()
    return None if ok else why


def available() -> bool:
    return reason() is None

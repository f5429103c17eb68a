"""oneDNN's matmul as a custom call on CPU: the bf16 (and weight-only int8) projections where
the processor's AVX512-BF16 / AMX units do them. XLA:CPU has no fast bf16 dot of its own
(measured on 2 Zen 4 cores: its bf16 dots run at 45-140 GF/s against 150-190 for f32, and a
one-row bf16 LM head takes 45 ms; oneDNN: 290-400 GF/s bf16 and 1.4 ms).

Optional, never required: `pip install 'ringserve[onednn]'` brings the library and headers
(PyPI's `onednn`, `onednn-devel` and the runtimes they pull in); the first use compiles
`onednn_matmul.cc` (a few seconds, g++; model/compute/kernels/build.py) against them and registers
two FFI targets with XLA. Without a compiler, headers or library, `reason()`
says what is missing and `ExecutorConfig.cpu_matmul="auto"` stays on XLA's dot.

PyPI's oneDNN is built with the SYCL CPU runtime: its engine runs through the Intel OpenCL CPU
driver shipped beside it, found through OCL_ICD_FILENAMES (set here before the library loads,
unless the caller set it).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from ringserve.model.compute.kernels.build import loader

_owners = itertools.count(1)

TARGET, TARGET_Q8 = "ringserve_onednn_matmul", "ringserve_onednn_matmul_q8"


def _prefix() -> Path:
    """Where pip put oneDNN's library and headers: this interpreter's prefix (a venv's root)."""
    return Path(sys.prefix)


def _missing() -> str | None:
    """What the build needs and this machine lacks, or None."""
    p = _prefix()
    if not (p / "include" / "oneapi" / "dnnl" / "dnnl.hpp").exists():
        return f"oneDNN's headers are not in {p}/include (pip install 'ringserve[onednn]')"
    if not (p / "lib" / "libdnnl.so").exists():
        return f"oneDNN's library is not in {p}/lib (pip install 'ringserve[onednn]')"
    return None


def _prepare() -> str | None:
    if (why := _missing()) is not None:
        return why
    icd = _prefix() / "lib" / "libintelocl.so"
    if icd.exists():
        os.environ.setdefault("OCL_ICD_FILENAMES", str(icd))
    return None


_LIB: list[ctypes.CDLL] = []  # the built library, once `reason()` has loaded it


def _check(lib) -> str | None:
    if not lib.ringserve_onednn_ready():
        return "oneDNN loaded but could not make a CPU engine (its CPU runtime is missing)"
    lib.ringserve_onednn_register.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.ringserve_onednn_release.argtypes = [ctypes.c_int64]
    lib.ringserve_onednn_packed_bytes.argtypes = [ctypes.c_int64]
    lib.ringserve_onednn_packed_bytes.restype = ctypes.c_int64
    lib.ringserve_onednn_supports.argtypes = [ctypes.c_int, ctypes.c_int]
    _LIB.append(lib)
    return None


_lib = _prefix() / "lib"
_stamp = (_lib / "libdnnl.so").stat().st_size if (_lib / "libdnnl.so").exists() else 0  # a new oneDNN, a new build
reason = loader("onednn_matmul", ["-O2", f"-I{_prefix() / 'include'}", f"-DRINGSERVE_DNNL={_stamp}"],
                {TARGET: "RingserveOnednnMatmul", TARGET_Q8: "RingserveOnednnMatmulQ8"},
                [f"-L{_lib}", "-ldnnl", f"-Wl,--disable-new-dtags,-rpath,{_lib}"], prepare=_prepare, check=_check)  # fmt: skip
"""None when the custom call can run here; otherwise why not (for logs and errors)."""


_CODES = {"float32": 0, "bfloat16": 1, "float16": 2, "int8": 3}


@functools.cache
def supports(x_dtype: str, w_dtype: str) -> str | None:
    """None where oneDNN makes every matmul a model of compute dtype `x_dtype` and weight dtype
    `w_dtype` ("int8": weight-only quantized) asks for on this CPU; otherwise why not. The
    library is the same everywhere, its kernels are not: on a processor without AVX512-BF16,
    AMX or AVX2-VNNI-2 (AVX2 alone, as Zen 2 and 3 have) it has no bf16 source and no int8
    weights beside a floating source, and a step would fail (onednn_matmul.cc
    `ringserve_onednn_supports` asks it)."""
    if (why := reason()) is not None:
        return why
    if x_dtype not in _CODES or w_dtype not in _CODES or x_dtype == "int8":
        return f"no {x_dtype} x {w_dtype} matmul in the custom call"
    if not _LIB[0].ringserve_onednn_supports(_CODES[x_dtype], _CODES[w_dtype]) & 1:
        return f"oneDNN has no {x_dtype} x {w_dtype} matmul on this CPU"
    return None


def matmul(x: jax.Array, w: jax.Array, *, transpose_w: bool = False, scale: jax.Array | None = None,
           out_dtype=None, layer: jax.Array | int | None = None) -> jax.Array:  # fmt: skip
    """x [..., K] @ w, w [K, N] (or [N, K] with transpose_w): [..., N] in `out_dtype` (x's by
    default). `scale` [N] f32: w is int8 and column n is w[:, n] * scale[n]. `layer`: w is
    stacked over the layers ([L, K, N] / [L, N, K], scale [L, N]) and layer `layer`'s
    multiply, read in place (the layers' scan). CPU only; call `reason()` first (the targets
    must be registered before a program is traced)."""
    n = w.shape[-2] if transpose_w else w.shape[-1]
    out = jax.ShapeDtypeStruct((*x.shape[:-1], n), out_dtype or x.dtype)
    extra = [] if layer is None else [jnp.asarray(layer, jnp.int32)]
    if scale is None:
        return jax.ffi.ffi_call(TARGET, out)(x, w, *extra, transpose_w=transpose_w)
    return jax.ffi.ffi_call(TARGET_Q8, out)(x, w, scale.astype(jnp.float32), *extra, transpose_w=transpose_w)


def register_weights(arrays: list[jax.Array]) -> int | None:
    """Register `arrays` (the executor's weights, CPU) as buffers whose contents stay as they are
    until `release_weights(owner)`: the custom call then packs each into oneDNN's blocked layout
    on its first call of 8 or more rows and reads the packed copy from then on (onednn_matmul.cc).
    Returns the owner token, or None where the custom call is not built (nothing to register).
    The caller must release before it frees, replaces or changes any of them."""
    if not _LIB:
        return None
    # only a matrix is ever a matmul's weight; a stack of them ([L, K, N], the layers' scan)
    # registers each layer's matrix, which the call reads in place (`matmul(layer=)`)
    bufs: list[tuple[int, int]] = []
    for a in arrays:
        if a.ndim == 2:
            bufs.append((a.unsafe_buffer_pointer(), a.nbytes))
        elif a.ndim == 3 and a.size:
            per = a.nbytes // a.shape[0]
            bufs += [(a.unsafe_buffer_pointer() + i * per, per) for i in range(a.shape[0])]
    addrs = (ctypes.c_uint64 * len(bufs))(*(p for p, _ in bufs))
    sizes = (ctypes.c_uint64 * len(bufs))(*(n for _, n in bufs))
    owner = next(_owners)
    _LIB[0].ringserve_onednn_register(owner, addrs, sizes, len(bufs))
    return owner


def release_weights(owner: int | None) -> None:
    """Forget the buffers registered under `owner` and free their packed copies."""
    if owner is not None and _LIB:
        _LIB[0].ringserve_onednn_release(owner)


def packed_bytes(owner: int | None = None) -> int:
    """Bytes of packed weight copies held (for `owner`, or all)."""
    return _LIB[0].ringserve_onednn_packed_bytes(-1 if owner is None else owner) if _LIB else 0

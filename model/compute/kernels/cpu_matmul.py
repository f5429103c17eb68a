"""y = x @ w for few rows on CPU (decode) as a custom call (cpu_matmul.cc), on the pool's cores.

Decoding one token reads every weight once for one row of x: the step's time is the time to
stream the weights from memory. XLA:CPU's dot does that badly at M=1 (f32 ~6 GB/s over a whole
SmolLM2 pass; bf16 and dequantized int8 far worse), and oneDNN's custom call (onednn.py) pays
~55 us of queue overhead per call (~12 ms over SmolLM2's 211 calls a step). This kernel reads
each weight once in address order, widens bf16 / int8 weights to f32 in registers (bf16 x
bf16: vdpbf16ps) and accumulates in f32; it needs only g++ (built on first use,
`-march=native`, model/compute/kernels/build.py).

`python -m ringserve.bench.cpu_matmul` (2 Zen 4 cores, SmolLM2-135M's 30 layers + LM head, weights not
cache-hot, a 2-thread read at ~36 GB/s; M=1 ms per full pass):

    weights   XLA     kernel   kernel, RINGSERVE_POOL_SPIN_US=300   oneDNN
    f32       87      29.9     21.2 (70% of the read)               37.1
    bf16      150     19.8     12.3 (60%)                           24.3
    int8      297     14.9     10.4 (36%)                           26.3

At M=4 f32 it is even with XLA in this benchmark (0.9x; 1.1x spinning) and at M=16 f32 slower
(0.9x); in a whole decode step, with q/k/v and gate/up grouped, it wins up to 8 rows for f32,
against oneDNN up to 4 for bf16 and 16 for int8 (x as int16), against XLA's bf16 and int8 dots
at every decode size (model/compute/dots.py KERNEL_ROWS has the figures); on AVX2 alone, where
above 6 rows it reads each tile from a packed f32 panel (either layout), to 128 rows for every
dtype.
With XLA's own pool the helper often starts after a short call is over; pool.h's opt-in
spinning helper is what reaches the memory's bandwidth (see pool.h). On 2 Zen 3 cores (AVX2,
a 2-thread read at 25-28 GB/s, one thread 14-16), with one helper scheduled a call (pool.h),
M=1 ms per pass, three alternating runs: f32 22.9-24.7 (28.8-31.9 with a helper scheduled per
pool thread), bf16 14.8-20.5 (21.8-22.0), int8 8.2-9.8 (8.4-12.9; one thread widens int8 at
~10 G weights/s from memory, 14 from L2).

The projections that read the same x go as one call (`matmuls`; model/compute/dots.py `project`):
q/k/v, gate/up, so a SmolLM2 step makes 121 calls instead of 211, each weight's items dealt in
one dispatch (the longer call finds the helper more often), each result the single call's
bits. SmolLM2-135M decode 1x512, whole step, ms (2 Zen 4 cores, each run started with the
CPUs idle; one process holding both, the same tree with those projections as separate calls,
steps interleaved, 60 each; the medians of three runs):

    dtype        separate   grouped
    f32          25.8-27.0  23.1-24.5
    bf16         17.8-20.3  15.9-18.0
    bf16 + int8  16.3-17.1  14.6-15.1
"""

from __future__ import annotations

import ctypes
import functools
import itertools

import jax
import jax.numpy as jnp

from ringserve.model.compute.kernels.build import loader

# One library per weight dtype (cpu_matmul.cc RINGSERVE_WEIGHTS), each under a target of its own:
# a configuration builds only the one its weights need (a first SmolLM2 f32 start: 3.2 CPU-s of
# g++ against 5.5 for every dtype in one library), and a process holding several (the tests)
# registers each once
WEIGHTS = ("float32", "bfloat16", "int8")
TARGETS = {w: f"ringserve_cpu_matmul_{tag}" for w, tag in zip(WEIGHTS, ("f32", "bf16", "s8"), strict=True)}

_LANES: list[int] = []
_LIBS: dict[str, ctypes.CDLL] = {}  # weight dtype -> its loaded library
_owners = itertools.count(1)


def _check(weights: str, lib) -> None:
    _LANES.append(int(lib.ringserve_cpu_matmul_lanes()))
    lib.ringserve_cpu_matmul_register.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.ringserve_cpu_matmul_release.argtypes = [ctypes.c_int64]
    lib.ringserve_cpu_matmul_packed_bytes.argtypes = [ctypes.c_int64]
    lib.ringserve_cpu_matmul_packed_bytes.restype = ctypes.c_int64
    lib.ringserve_cpu_matmul_reserve.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.ringserve_cpu_matmul_arena_bytes.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    _LIBS[weights] = lib


_LOADERS = {
    w: loader("cpu_matmul", ["-O3", "-march=native", f"-DRINGSERVE_WEIGHTS={code}"], {TARGETS[w]: "RingserveCpuMatmul"},
              check=functools.partial(_check, w))  # fmt: skip
    for code, w in enumerate(WEIGHTS, start=1)
}


def loader_of(weights: str):
    """The build's `reason` for weights of dtype `weights` (model/compute/kernels/build.py `loader`:
    `prebuild` starts it), or None for a dtype the kernel does not multiply."""
    return _LOADERS.get(weights)


def reason(weights: str = "float32") -> str | None:
    """None when the kernel for weights of dtype `weights` (float32, bfloat16 or int8: the
    configuration's, int8 where it quantizes) runs here; otherwise why not. The first call per
    dtype builds that library (once per machine) and registers its target."""
    load = _LOADERS.get(weights)
    return f"it multiplies float32, bfloat16 or int8 weights, not {weights}" if load is None else load()


def lanes(weights: str = "float32") -> int:
    """The f32 lanes of the vectors the built kernel computes with: 16 (AVX-512), 8 (AVX2 + FMA),
    1 (plain loops); 0 where the kernel for `weights` is not built (`reason(weights)` says why)."""
    return _LANES[0] if reason(weights) is None else 0


def target(weights: str) -> str:
    """The FFI target multiplying weights of dtype `weights`, registered (built first where this
    machine has none); RuntimeError naming why where it cannot be."""
    if (why := reason(weights)) is not None:
        raise RuntimeError(f"cpu_matmul for {weights} weights: {why}")
    return TARGETS[weights]


def matmul(x: jax.Array, w: jax.Array, *, transpose_w: bool = False, scale: jax.Array | None = None,
           out_dtype=None, layer: jax.Array | int | None = None) -> jax.Array:  # fmt: skip
    """x [..., K] @ w, w [K, N] (or [N, K] with transpose_w): [..., N] in `out_dtype` (x's by
    default). x f32 or bf16; w f32 or bf16, or int8 with `scale` [N] f32 (column n is
    w[:, n] * scale[n]); sums in f32; `layer`: stacked weights (`matmuls`). CPU only; the
    weights' dtype picks the library (`target`), built and registered at trace time if it is
    not yet (`reason(dtype)` first says whether it can be)."""
    return matmuls(
        x, [w], transpose_w=transpose_w, scales=None if scale is None else [scale], out_dtype=out_dtype, layer=layer
    )[0]


def matmuls(x: jax.Array, ws: list[jax.Array], *, transpose_w: bool = False, scales: list[jax.Array] | None = None,
            out_dtype=None, layer: jax.Array | int | None = None) -> list[jax.Array]:  # fmt: skip
    """[matmul(x, w) for w in ws] (`scales`: one per int8 weight) as one call: the work of every
    weight is dealt to the pool at once, and each result has the bits its own call gives.

    `layer`: the weights are stacked over the layers ([L, K, N] or [L, N, K], scales [L, N])
    and layer `layer`'s multiply, read in place (the layers' scan: `w[layer]` would copy them)."""
    outs = [jax.ShapeDtypeStruct((*x.shape[:-1], w.shape[-2] if transpose_w else w.shape[-1]), out_dtype or x.dtype)
            for w in ws]  # fmt: skip
    name, extra = _call_of(ws, scales, layer, "matmuls")
    return list(jax.ffi.ffi_call(name, outs)(x, *ws, *extra, transpose_w=transpose_w))


def _call_of(ws: list[jax.Array], scales: list[jax.Array] | None, layer: jax.Array | int | None,
             what: str) -> tuple[str, list[jax.Array]]:  # fmt: skip
    """The target of the weights' dtype and the operands after them: the scales (f32), then the
    layer of stacked weights (s32). ValueError where the weights' dtypes differ."""
    extra = [] if scales is None else [s.astype(jnp.float32) for s in scales]
    if layer is not None:
        extra.append(jnp.asarray(layer, jnp.int32))
    kinds = {jnp.dtype(w.dtype).name for w in ws}
    if len(kinds) != 1:
        raise ValueError(f"cpu_matmul.{what}: the weights of one call share a dtype, got {sorted(kinds)}")
    return target(kinds.pop()), extra


def gated(x: jax.Array, ws: list[jax.Array], *, transpose_w: bool = False, scales: list[jax.Array] | None = None,
          layer: jax.Array | int | None = None) -> jax.Array:  # fmt: skip
    """silu(x @ ws[0]) * (x @ ws[1]) for bf16 x, as model/compute/dots.py's GatedMLP computes it (each
    product rounded to bf16, silu in f32 rounded to bf16, the product rounded): one call, and
    where AMX multiplies registered weights each block of both products is summed and activated
    in place (cpu_matmul.cc `amx::rows`), never written out as two [..., N] arrays. Arguments
    as `matmuls`'."""
    if len(ws) != 2 or x.dtype != jnp.bfloat16:
        raise ValueError("cpu_matmul.gated: bf16 x and two weights (the gate's, the up projection's)")
    n = ws[0].shape[-2] if transpose_w else ws[0].shape[-1]
    name, extra = _call_of(ws, scales, layer, "gated")
    out = jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.bfloat16)
    return jax.ffi.ffi_call(name, out)(x, *ws, *extra, transpose_w=transpose_w, gated=True)


def packs_pairs(weights: str = "bfloat16") -> bool:
    """Whether the library for `weights` (bfloat16, int8) reads registered weights from packed
    pairs (AVX512-BF16: cpu_matmul.cc `pair_tile`, pairs.h; int8 above kS8PairRows rows); False
    where it is not built or the CPU lacks them."""
    lib = _LIBS.get(weights) if weights in ("bfloat16", "int8") and reason(weights) is None else None
    return lib is not None and bool(lib.ringserve_cpu_matmul_pairs())


def uses_amx(weights: str = "bfloat16") -> bool:
    """Whether the library for `weights` multiplies registered weights' packed pairs through AMX
    (cpu_matmul.cc `amx::rows`: a Sapphire Rapids or later CPU, whose Linux lends the process
    its tiles; K a multiple of 32; RINGSERVE_AMX=0 keeps the AVX-512 pairs)."""
    return packs_pairs(weights) and bool(_LIBS[weights].ringserve_cpu_matmul_amx())


def register_weights(arrays: list[jax.Array]) -> int | None:
    """Register the bf16 matrices of `arrays` (the executor's weights, CPU; a stack [L, K, N]:
    each layer's) as buffers whose contents stay as they are until `release_weights(owner)`: the
    kernel then reads each [K, N] one from a copy packed in pairs along K, made on its first
    call (pairs.h). Returns the owner token, or None where nothing reads pairs here. The caller
    must release before it frees, replaces or changes any of them."""
    if not packs_pairs():
        return None
    bufs: list[tuple[int, int]] = []
    for a in arrays:
        if a.dtype not in (jnp.bfloat16, jnp.int8):
            continue
        if a.ndim == 2:
            bufs.append((a.unsafe_buffer_pointer(), a.nbytes))
        elif a.ndim == 3 and a.size:
            per = a.nbytes // a.shape[0]
            bufs += [(a.unsafe_buffer_pointer() + i * per, per) for i in range(a.shape[0])]
    addrs = (ctypes.c_uint64 * len(bufs))(*(p for p, _ in bufs))
    sizes = (ctypes.c_uint64 * len(bufs))(*(n for _, n in bufs))
    owner = next(_owners)
    for lib in _LIBS.values():  # each library keeps its own registry (bf16's, int8's)
        lib.ringserve_cpu_matmul_register(owner, addrs, sizes, len(bufs))
    return owner


def pairs_bytes(shape: tuple[int, ...]) -> int:
    """Bytes of the packed pairs of one matrix `shape` [K, N] (pairs.h: u32 tiles of 64 columns
    over ceil(K / 2) pairs), read either way round ([N, K] with transpose_w: the larger)."""
    a, b = shape

    def packed(k: int, n: int) -> int:
        return -(-n // 64) * 64 * -(-k // 2) * 4

    return max(packed(a, b), packed(b, a))


def reserve(arrays: list) -> None:
    """Fault in the memory the packed pairs of `arrays`' bf16 matrices will take (arrays or
    their avals: shapes and dtypes are all it reads; a stack [L, K, N]: L matrices), for the next
    `register_weights` to pack into, so that its first calls do not take the page faults
    (pairs.h `Arena::reserve`). Returns at once: the pages come in on a thread of the library's.
    Not int8's: their pairs wait for a call of more than 16 rows, and reserved at start they
    only slowed it (3 starts each, ready 3.4-4.6 s against 3.1-3.5). Nothing where nothing
    reads pairs here."""
    sizes = [pairs_bytes(tuple(a.shape)) for a in arrays if a.dtype == jnp.bfloat16 and len(a.shape) == 2]
    sizes += [pairs_bytes(tuple(a.shape[1:])) for a in arrays if a.dtype == jnp.bfloat16 and len(a.shape) == 3
              for _ in range(a.shape[0])]  # fmt: skip
    if sizes and packs_pairs():
        _LIBS["bfloat16"].ringserve_cpu_matmul_reserve((ctypes.c_uint64 * len(sizes))(*sizes), len(sizes))


def release_weights(owner: int | None) -> None:
    """Forget the buffers registered under `owner` and free their packed copies."""
    if owner is not None:
        for lib in _LIBS.values():
            lib.ringserve_cpu_matmul_release(owner)


def arena_bytes(owner: int | None = None) -> tuple[int, int]:
    """Bytes the packed copies' memory of `owner` maps (None: the reserve no registrant has
    taken yet), summed over the libraries: (in use, reserved and not yet used)."""
    used, reserved = ctypes.c_int64(), ctypes.c_int64()
    total = [0, 0]
    for lib in _LIBS.values():
        lib.ringserve_cpu_matmul_arena_bytes(-1 if owner is None else owner, ctypes.byref(used), ctypes.byref(reserved))
        total[0] += used.value
        total[1] += reserved.value
    return total[0], total[1]


def packed_bytes(owner: int | None = None) -> int:
    """Bytes of packed pairs held (for `owner`, or all)."""
    return sum(lib.ringserve_cpu_matmul_packed_bytes(-1 if owner is None else owner) for lib in _LIBS.values())

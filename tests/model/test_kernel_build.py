"""model/compute/kernels/build.py: a loader's work runs once per process, however many threads ask (the
executor's `prebuild` starts it on a thread, its first use then waits for that)."""

from __future__ import annotations

import threading
import time

import pytest

from ringserve.model.compute.kernels import build


def test_a_loader_works_once_and_a_caller_meanwhile_waits_for_its_answer():
    calls, started = [], threading.Event()

    def prepare() -> str | None:  # stands in for the build: slow, and answers why not
        calls.append(threading.get_ident())
        started.set()
        time.sleep(0.3)
        return "no compiler here"

    reason = build.loader("nothing", [], {}, prepare=prepare)
    build.prebuild(reason)
    assert started.wait(5)
    t0 = time.perf_counter()
    assert reason() == "no compiler here"  # waited for the thread's answer, did not run it again
    assert time.perf_counter() - t0 > 0.1
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(reason())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == ["no compiler here"] * 4 and len(calls) == 1
    assert calls[0] != threading.get_ident()  # the work ran on prebuild's thread


def test_prebuild_starts_only_loaders_with_nothing_built(tmp_path, monkeypatch):
    """A warm start (every library built) starts no thread: each loads where first used."""
    from ringserve.model.compute.kernels import cpu_memory

    if (why := cpu_memory.reason()) is not None:
        pytest.skip(f"cpu_memory is not built here: {why}")
    before = threading.active_count()
    build.prebuild(cpu_memory.reason)
    assert threading.active_count() == before and not cpu_memory.reason.to_build()
    fresh = build.loader("cpu_memory", ["-O2"], {})
    assert not fresh.to_build()  # the same source and flags: the library is there
    monkeypatch.setenv("RINGSERVE_CACHE", str(tmp_path))
    assert fresh.to_build()  # an empty cache: it would be built


@pytest.mark.parametrize("dtype, quantization, weights",
                         [("float32", None, "float32"), ("bfloat16", None, "bfloat16"), ("float32", "int8", "int8")])  # fmt: skip
def test_a_configuration_builds_the_matmul_library_of_its_weights_alone(monkeypatch, dtype, quantization, weights):
    """cpu_matmul is one library per weight dtype: a first start builds its configuration's
    (int8 where it quantizes), not the others (model/compute/plan.py `prebuild_kernels`)."""
    from ringserve.model.compute import plan
    from ringserve.model.compute.kernels import cpu_attention, cpu_matmul, cpu_memory, cpu_norm
    from ringserve.model.compute.options import ComputeOptions

    asked: list = []
    monkeypatch.setattr(build, "prebuild", lambda *reasons: asked.extend(reasons))
    plan.prebuild_kernels(ComputeOptions(dtype=dtype, quantization=quantization), tp=1)
    norm = [cpu_norm.reason] if dtype == "bfloat16" else []  # bf16 norms (model/compute/norm.py)
    assert asked == [cpu_memory.reason, *norm, cpu_attention.reason, cpu_matmul.loader_of(weights)]
    assert len({cpu_matmul.loader_of(w) for w in cpu_matmul.WEIGHTS}) == 3


# The vector widths simd.h writes the kernels for, each a target this machine may not run:
# AVX-512 with BF16 (a TPU or GPU host's Xeon), AVX2 + FMA, and plain loops
TARGETS = ["-march=sapphirerapids", "-march=haswell", "-march=x86-64"]


@pytest.mark.parametrize(
    "name, flags",
    [("cpu_matmul", []), *(("cpu_matmul", [f"-DRINGSERVE_WEIGHTS={w}"]) for w in (1, 2, 3)),
     ("cpu_attention", ["-ffast-math", "-fopenmp-simd"]), ("cpu_norm", [])],
)  # fmt: skip
def test_kernels_compile_for_every_vector_width(name, flags):
    """Each CPU kernel's source compiles for every width simd.h has (g++ -fsyntax-only): a path
    written for the width this machine runs must not break the others' build (where it broke, an
    AVX-512 host would fall back to XLA's slow dots, with only a logged reason); cpu_matmul
    also as each one-dtype library the engine builds."""
    import subprocess

    import jax

    cxx = build.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler (g++, or $CXX)")
    source = build.HERE / f"{name}.cc"
    for target in TARGETS:
        cmd = [cxx, "-std=c++17", "-fsyntax-only", "-w", target, *flags, f"-I{jax.ffi.include_dir()}", str(source)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, f"{name}.cc {target}:\n{done.stderr[-3000:]}"


def test_a_kernel_refuses_by_name_a_call_it_cannot_read():
    """The kernels read their call frames themselves (xla_call.h, not ffi.h's bindings): an
    attribute missing or of another type, an operand of the wrong type or count, comes back as
    XLA's error naming what was expected, never a misread buffer."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ringserve.model.compute.kernels import cpu_attention, cpu_matmul

    if cpu_matmul.reason() is not None or cpu_attention.reason() is not None:
        pytest.skip(f"kernels not built: {cpu_matmul.reason() or cpu_attention.reason()}")
    x, w = jnp.ones((1, 8), jnp.float32), jnp.ones((8, 4), jnp.float32)
    y = jax.ShapeDtypeStruct((1, 4), jnp.float32)
    call = jax.ffi.ffi_call(cpu_matmul.target("float32"), [y])
    assert np.allclose(call(x, w, transpose_w=False)[0], 8.0)
    with pytest.raises(Exception, match=r"attribute transpose_w \(bool\)"):
        call(x, w)
    with pytest.raises(Exception, match=r"attribute transpose_w \(bool\)"):
        call(x, w, transpose_w=np.int64(2))  # not 0 or 1: jax's eager cache takes 0 == False for the same call
    i32 = jnp.zeros((1,), jnp.int32)
    q = jnp.zeros((1, 2, 4), jnp.float32)
    cache = jnp.zeros((1, 2, 4, 16), jnp.float32)
    pages = jnp.zeros((1, 1), jnp.int32)
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    attend = jax.ffi.ffi_call(cpu_attention.TARGET, out)
    attrs = dict(scale=np.float32(1.0), softcap=np.float32(0.0))
    with pytest.raises(Exception, match="q must be f32 or bf16, out f32"):
        attend(q.astype(jnp.float16), cache, cache, pages, jnp.zeros((2,), jnp.int32), i32, i32, i32[0], i32[0], **attrs)
    with pytest.raises(Exception, match="must be s32"):
        attend(q, cache, cache, pages.astype(jnp.float32), jnp.zeros((2,), jnp.int32), i32, i32, i32[0], i32[0], **attrs)
    with pytest.raises(Exception, match=r"q, k_cache, v_cache, pages, row_start, kv_len, positions, base, window -> out"):
        attend(q, cache, cache, pages, **attrs)
    with pytest.raises(Exception, match=r"attributes scale \(f32\), softcap \(f32\)"):
        attend(q, cache, cache, pages, jnp.zeros((2,), jnp.int32), i32, i32, i32[0], i32[0],
               scale=np.int64(3), softcap=np.float32(0.0))  # fmt: skip (3: jax's eager cache takes 1 == 1.0)


def test_builders_of_one_library_build_it_once(tmp_path, monkeypatch):
    """Processes (or threads) that start together and find a kernel unbuilt: one runs the
    compiler, the others wait for it and load its library (model/paths.py
    `one_maker`), instead of each compiling on the same cores."""
    if build.compiler() is None:
        pytest.skip("no C++ compiler (g++, or $CXX)")
    monkeypatch.setenv("RINGSERVE_CACHE", str(tmp_path))
    real, runs = build.subprocess.run, []

    def counted(cmd, **kw):
        runs.append(cmd)
        return real(cmd, **kw)

    monkeypatch.setattr(build.subprocess, "run", counted)
    libs: list = []
    threads = [threading.Thread(target=lambda: libs.append(build.build("cpu_memory", ["-O0"]))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [cmd[1:3] for cmd in runs] == [["-std=c++17", "-c"], ["-shared", runs[0][-1]]]  # one compile, one link
    assert len(libs) == 3
    assert all(hasattr(lib, "RingserveLazyZeros") for lib in libs)


def test_loading_the_kernels_leaves_denormals_alone():
    """A library built with -ffast-math and linked by g++ 12 in the same command carries
    crtfastmath.o, which turns on flush-to-zero for the thread that loads it and every thread it
    starts: an engine in the caller's process would change the caller's numpy (and torch) math.
    The kernels are linked apart from their flags: after loading every one, a denormal is one."""
    import json
    import subprocess
    import sys

    if build.compiler() is None:
        pytest.skip("no C++ compiler (g++, or $CXX)")
    code = (
        "import threading, numpy as np\n"
        "from ringserve.model.compute.kernels import cpu_attention, cpu_matmul, cpu_memory, cpu_norm\n"
        "reasons = [cpu_attention.reason(), cpu_memory.reason(), cpu_norm.reason(),"
        " *(cpu_matmul.loader_of(w)() for w in cpu_matmul.WEIGHTS)]\n"
        "assert reasons == [None] * len(reasons), reasons\n"
        "out = [float(np.float32(1e-38) / np.float32(100))]\n"
        "t = threading.Thread(target=lambda: out.append(float(np.float32(1e-38) / np.float32(100)))); t.start(); t.join()\n"
        "print(out)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=build.HERE.parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    here, started = json.loads(done.stdout)
    assert here > 0 and started > 0, (here, started)

"""Building ringserve's C++ custom calls on first use and registering them with XLA.

A kernel is one C++ source beside this file, compiled with the machine's own compiler (g++, or
$CXX) against jax's FFI headers into

    $RINGSERVE_CACHE/kernels/<name>-<hash>.so

where the hash covers the source, the headers beside it (`*.h`: pool.h, bf16.h, xla_call.h),
the flags, jax's version and, for `-march=native` builds, this processor's model and flags (a
cache shared between machines never loads another CPU's build). The build is atomic (written
aside, then renamed) and made by one builder at a time (model/paths.py
`one_maker`): processes starting together (data-parallel runners, a test beside a server)
wait for the first's build instead of each compiling on the same cores. Nothing here is required: a missing compiler or a failed build is a reason the caller
logs before it falls back to XLA.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import jax

from ringserve.model.paths import cache_dir, one_maker

HERE = Path(__file__).parent


def compiler() -> str | None:
    """The C++ compiler's path, or None."""
    return shutil.which(os.environ.get("CXX", "g++"))


def _cpu_identity() -> bytes:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return b""
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(keep).encode()


def library_path(name: str, flags: Sequence[str], link: Sequence[str] = ()) -> Path:
    """Where `<name>.cc` built with `flags` and `link` lives on this machine (it may not yet)."""
    h = hashlib.sha256((HERE / f"{name}.cc").read_bytes())
    for header in sorted(HERE.glob("*.h")):  # included as "pool.h": a changed header rebuilds
        h.update(header.name.encode() + header.read_bytes())
    h.update(" ".join([*flags, *link, jax.__version__, "linked-apart"]).encode())  # (no crtfastmath.o)
    if "-march=native" in flags:
        h.update(_cpu_identity())
    return cache_dir("kernels", f"{name}-{h.hexdigest()[:16]}.so")


def build(name: str, flags: Sequence[str], link: Sequence[str] = ()) -> ctypes.CDLL:
    """The loaded library of `<name>.cc` (built first if this machine has no copy). Raises
    RuntimeError with the compiler's message when the build fails, OSError when loading does."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, or $CXX)")
    source = HERE / f"{name}.cc"
    out = library_path(name, flags, link)
    if not out.exists():
        with one_maker(out):
            if not out.exists():  # (else built while this one waited)
                tmp = out.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
                obj = tmp.with_suffix(".o")
                # compiled, then linked without `flags`: g++ 12 links crtfastmath.o into a shared
                # library whenever -ffast-math is on its link line, and loading that library
                # turns on flush-to-zero for the loading thread and every thread it starts (the
                # caller's numpy and torch included)
                steps = ([cxx, "-std=c++17", "-c", "-fPIC", "-w", *flags, str(source), f"-I{jax.ffi.include_dir()}",
                          "-o", str(obj)],
                         [cxx, "-shared", str(obj), *link, "-o", str(tmp)])  # fmt: skip
                try:
                    for cmd in steps:
                        done = subprocess.run(cmd, capture_output=True, text=True)
                        if done.returncode != 0:
                            tmp.unlink(missing_ok=True)
                            raise RuntimeError(f"building {source.name} failed:\n{done.stderr[-2000:]}")
                finally:
                    obj.unlink(missing_ok=True)
                tmp.replace(out)
    return ctypes.CDLL(str(out))


def loader(name: str, flags: Sequence[str], targets: dict[str, str], link: Sequence[str] = (),
           prepare: Callable[[], str | None] | None = None,
           check: Callable[[ctypes.CDLL], str | None] | None = None) -> Callable[[], str | None]:  # fmt: skip
    """A `reason()` for one kernel module: None once `<name>.cc` is built and each of `targets`
    (XLA target name -> exported symbol) is registered on CPU, otherwise why not. The work runs
    once per process, on the first call (a call meanwhile, from another thread, waits for it:
    `prebuild`); `prepare()` runs before the build and `check(lib)` after the load, each
    answering a reason to give up or None."""
    lock = threading.Lock()
    answer: list[str | None] = []

    def load() -> str | None:
        if prepare is not None and (why := prepare()) is not None:
            return why
        try:
            lib = build(name, flags, link)
            if check is not None and (why := check(lib)) is not None:
                return why
            for target, symbol in targets.items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        except (OSError, RuntimeError, AttributeError) as e:
            return str(e)
        return None

    def reason() -> str | None:
        with lock:
            if not answer:
                answer.append(load())
            return answer[0]

    def to_build() -> bool:  # no answer yet and no library built on this machine
        try:
            return not answer and not library_path(name, flags, link).exists()
        except OSError:  # no source: the loader's own call says why
            return not answer

    reason.to_build = to_build  # type: ignore[attr-defined]
    return reason


def prebuild(*reasons: Callable[[], str | None]) -> None:
    """Start the work of each `loader`'s `reason` on a thread of its own, so that a first start on a
    machine builds its kernels side by side, beside the rest of the start-up, not one after
    another where each is first used (2 Zen 3 cores, each alone: cpu_matmul's f32 library 3.2
    CPU-s, cpu_attention 2.8, cpu_memory 0.3). Only the loaders whose library is not built yet: a warm start loads each
    where it is first used (three threads loading them beside the runner's start-up made a
    warm SmolLM2 start ~0.3 s slower)."""
    for r in reasons:
        if r.to_build():  # type: ignore[attr-defined]
            threading.Thread(target=r, name="ringserve-kernel-build", daemon=True).start()

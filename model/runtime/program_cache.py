"""Step programs kept on disk as lowered StableHLO (`jax.export`), so that a warm start skips
tracing and lowering them; XLA's persistent cache (model/runtime/programs.py) then loads the compiled
executable of the same module.

Why: a warm start of SmolLM2 on 2 CPU cores spent ~1 s (of ~3.4) tracing and lowering the two
lead programs before XLA could load them, and each of the 17 background programs ~0.5 s more.
Reading a program back is ~0.01 s and lowering the one-call wrapper around it ~0.05 s.

An entry is keyed on everything that shapes the trace: the sources of the packages the step is
traced from (model/ and kvmem/: Python, kernels), the jax, jaxlib and flax versions, the
platform and XLA flags, the executor's and the checkpoint's configuration (by the caller, as
`context`), and per program the arguments' tree, avals and shardings and the static arguments.
A stale entry can therefore only come from a change outside those; `RINGSERVE_PROGRAM_CACHE=0`
turns the cache off. Entries are `Exported.serialize()` bytes (a flatbuffer, no pickle), files
0600 in a 0700 directory, written whole (a temporary file renamed). Anything that fails to read
or load is a miss: the caller traces as before and writes the entry again.

Used on CPU by single-process, single-device executors (model/compute/plan.py `program_cache`):
the platform whose start-up it is measured on; a multi-device program's shardings and an
accelerator's custom calls stay on the traced path, unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax

log = logging.getLogger(__name__)

ENV = "RINGSERVE_PROGRAM_CACHE"  # "0": off
MAX_ENTRIES = 512  # programs kept (SmolLM2's: ~0.25 MB each; the weights are arguments, not in them)
_PACKAGES = ("model", "kvmem")  # what the step is traced from
_SUFFIXES = (".py", ".cc", ".h")


@functools.cache
def source_digest() -> str:
    """sha256 of the sources the step is traced from (`tree_digest` of this checkout)."""
    return tree_digest(Path(__file__).resolve().parents[2])  # model/runtime/program_cache.py: the root above model/


def tree_digest(root: Path) -> str:
    """sha256 of the Python and kernel sources under `root`'s model/ and kvmem/ (paths and
    contents, in path order)."""
    h = hashlib.sha256()
    for pkg in _PACKAGES:
        for p in sorted((root / pkg).rglob("*")):
            if p.suffix in _SUFFIXES and p.is_file() and "__pycache__" not in p.parts:
                h.update(str(p.relative_to(root)).encode() + b"\0")
                h.update(p.read_bytes() + b"\0")
    return h.hexdigest()


def usable() -> bool:
    """Whether programs may be kept here at all: not turned off, one process, and XLA's persistent
    cache on (without it the traced module would be compiled anyway). Which executors keep them
    (CPU, one device) is the compute plan's (model/compute/plan.py `program_cache`)."""
    return os.environ.get(ENV, "1") != "0" and jax.process_count() == 1 and bool(_xla_cache_dir())


def directory() -> Path:
    """Beside XLA's persistent cache (`<cache>/xla` -> `<cache>/programs`): an entry is of use
    where XLA's executable of its module is kept."""
    return Path(_xla_cache_dir() or ".").parent / "programs"


def _xla_cache_dir() -> str | None:
    """XLA's persistent cache directory (model/runtime/programs.py `enable_compilation_cache`), or None."""
    return jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]


# jax options a trace reads (dtypes of Python scalars, default precisions, promotion rules)
_JAX_OPTIONS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_rank_promotion",
                "jax_numpy_dtype_promotion", "jax_default_prng_impl", "jax_use_shardy_partitioner")  # fmt: skip


def _environment() -> dict[str, Any]:
    import flax
    import jaxlib
    import numpy

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__,
            "numpy": numpy.__version__, "options": {o: repr(getattr(jax.config, o, None)) for o in _JAX_OPTIONS}}  # fmt: skip


def _aval(x: Any) -> str:
    sharding = getattr(x, "sharding", None)
    return f"{x.shape}:{x.dtype}:{getattr(x, 'weak_type', False)}:{sharding}"


class ProgramCache:
    """Exported step programs in the directory `path` (default: `directory()`), under keys made from `context`
    and each program's arguments (see the module docstring)."""

    def __init__(self, context: dict[str, Any], path: Path | None = None):
        self.dir = Path(path) if path is not None else directory()
        base = {"sources": source_digest(), "environment": _environment(), "platform": jax.devices()[0].platform,
                "device": jax.devices()[0].device_kind, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                "context": context}  # fmt: skip
        self._base = hashlib.sha256(json.dumps(base, sort_keys=True, default=repr).encode()).hexdigest()
        self.hits = self.misses = 0

    def key(self, args: Any, statics: tuple[Any, ...]) -> str:
        leaves, tree = jax.tree.flatten(args)
        h = hashlib.sha256(self._base.encode())
        h.update(repr((str(tree), [_aval(x) for x in leaves], statics)).encode())
        return h.hexdigest()

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}.exported"

    def has(self, args: Any, statics: tuple[Any, ...]) -> bool:
        """Whether the program for these arguments is kept (then its compile is a load: ~0.15 s
        for a SmolLM2 program on CPU, against seconds to compile it)."""
        return self._path(self.key(args, statics)).is_file()

    def load(self, key: str) -> jax.export.Exported | None:
        try:
            data = self._path(key).read_bytes()
            os.utime(self._path(key))  # used: the last to be pruned
        except OSError:
            return None
        try:
            return jax.export.deserialize(bytearray(data))
        except Exception as e:  # a torn or foreign file: traced again and rewritten
            log.warning("program cache: %s unreadable (%s); tracing it again", self._path(key).name, e)
            return None

    def store(self, key: str, exported: jax.export.Exported) -> None:
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.dir)  # 0600
            with os.fdopen(fd, "wb") as f:
                f.write(exported.serialize())
            os.replace(tmp, self._path(key))
            self._prune()
        except OSError as e:  # a read-only or full cache: served all the same, traced next time
            log.warning("program cache: could not write %s: %s", self.dir, e)

    def _prune(self) -> None:
        """Keep the MAX_ENTRIES most recently used entries (each change of the sources or the
        configuration leaves a server's ~20 behind)."""
        entries = []
        for p in self.dir.glob("*.exported"):
            with contextlib.suppress(OSError):  # (another process pruning too)
                entries.append((p.stat().st_mtime, p))
        for _, p in sorted(entries)[:-MAX_ENTRIES]:
            p.unlink(missing_ok=True)

    def compile(self, fn: Callable[..., Any], args: Any, statics: tuple[Any, ...], out_tree: Any,
                donate_argnums: tuple[int, ...], custom_calls: tuple[str, ...]) -> Any:  # fmt: skip
        """`jax.jit(fn, donate_argnums).lower(*args, *statics).compile()` for `fn(*args, *statics)`
        returning a tree of structure `out_tree`, from this cache when the entry is there (no
        trace), else traced, exported, stored. The compiled program takes `args`' trees, as a
        jitted `fn` with `statics` bound would. `custom_calls`: the FFI targets the program may
        call (exported modules name them; jax only vouches for its own)."""
        leaves, in_tree = jax.tree.flatten(args)
        key = self.key(args, statics)
        exported = self.load(key)
        if exported is None:
            self.misses += 1
            seen: list[Any] = []

            def flat(*xs):
                out, tree = jax.tree.flatten(fn(*jax.tree.unflatten(in_tree, xs), *statics))
                seen.append(tree)
                return out

            checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in custom_calls]
            exported = jax.export.export(jax.jit(flat), disabled_checks=checks)(*leaves)
            if seen[0] != out_tree:  # the caller's structure is what a hit unflattens with
                raise RuntimeError(f"program cache: the step returns {seen[0]}, expected {out_tree}")
            self.store(key, exported)
        else:
            self.hits += 1

        def call(*a):
            return out_tree.unflatten(exported.call(*jax.tree.leaves(a)))

        try:
            with _cpu_backend_ready():
                return jax.jit(call, donate_argnums=donate_argnums).lower(*args).compile()
        except Exception:
            self._path(key).unlink(missing_ok=True)  # not kept to fail again
            raise


@contextlib.contextmanager
def _cpu_backend_ready() -> Iterator[None]:
    """Lowering a call to an exported module first initializes jax's LAPACK handlers for CPU
    (`_ensure_backends_initialized`), which imports SciPy: 0.4 s of a warm start on 2 cores, for
    custom calls no step program makes. Skipped here; a module that did need them would fail
    to compile, and the caller traces it as before (ModelExecutor._compile)."""
    from jax._src.export import _export

    with _PATCHING:  # (one at a time: two threads' saves and restores could leave it patched)
        saved = getattr(_export, "_ensure_backends_initialized", None)
        if saved is None:  # another jax: its own initialization stands
            yield
            return
        _export._ensure_backends_initialized = lambda platforms: None
        try:
            yield
        finally:
            _export._ensure_backends_initialized = saved


_PATCHING = threading.Lock()

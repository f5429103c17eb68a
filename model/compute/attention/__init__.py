"""Attention backends behind one interface (model/compute/attention/base.py), registered here, one
line each; the compute plan (model/compute/plan.py) picks one by platform and the
`attention_backend` option. This module imports no JAX (the server's options list the names in
the frontend); an implementation is imported when a runner builds it.

    backend     where          what
    cpu_kernel  CPU (auto)     a C++ custom call on every core (model/compute/kernels/cpu_attention.cc),
                               the native backend's cache; auto uses it where it builds (g++)
    native      CPU            pure JAX, work items over key chunks dealt to lanes on the host;
                               a runtime trip count (free on CPU), cost per tile's own context
    bucketed    GPU (auto)     pure JAX, static shapes: programs per context bucket, a loop
                               bound known at compile time (no device-to-host sync per layer)
    pallas      TPU (auto)     jax's Pallas ragged paged attention kernel, with its KV layout
    pallas_ragged  TPU         ringserve's own Pallas kernel (tpu_ragged.py): K|V unpadded on the lanes
    pallas_gpu  GPU            jax's Pallas (Triton) paged decode kernel; extend steps bucketed
    none        benchmarks     writes K/V but attends to nothing: the step's floor

Pallas kernels also run on CPU in their interpreters (`attention_interpret=True`), which is how
the tests check them against the native path. Adding a backend: its module (a subclass of
`AttentionBackend` with a `make` classmethod) and one line in `REGISTRY`.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from ringserve.model.compute.platform import PLATFORMS


@dataclasses.dataclass(frozen=True, slots=True)
class Backend:
    """One backend's facts, as the plan reads them."""

    name: str
    impl: str  # "module:Class" in this package
    platforms: tuple[str, ...]  # where it runs compiled (anywhere under Pallas's interpreter where `interpretable`)
    auto: tuple[str, ...] = ()  # platforms where `auto` picks it (the first in REGISTRY's order that can run)
    interpretable: bool = False  # runs in Pallas's interpreter on any platform (attention_interpret)
    sharded: bool = True  # runs on a `tp` mesh (a custom call that is not: tp_size 1 only)
    deterministic: bool = True  # sums in an order no step shape changes (else the deterministic mode swaps in DETERMINISTIC)
    kernel: str | None = None  # the CPU custom call it needs (model/compute/kernels/<kernel>.py)

    def load(self) -> Any:
        module, _, cls = self.impl.partition(":")
        return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


ANY = PLATFORMS
REGISTRY = {b.name: b for b in (
    Backend("cpu_kernel", "cpu_kernel:CpuKernelAttention", ("cpu",), auto=("cpu",), sharded=False, kernel="cpu_attention"),
    Backend("native", "native:NativeAttention", ANY, auto=("cpu",)),
    Backend("bucketed", "bucketed:BucketedAttention", ANY, auto=("gpu",)),
    Backend("pallas", "pallas_tpu:PallasTPUAttention", ("tpu",), auto=("tpu",), interpretable=True, deterministic=False),
    Backend("pallas_ragged", "pallas_ragged:PallasRaggedAttention", ("tpu",), interpretable=True, deterministic=False),
    Backend("pallas_gpu", "pallas_gpu:PallasGPUAttention", ("gpu",), interpretable=True, deterministic=False),
    Backend("none", "base:NoAttention", ANY),
)}  # fmt: skip
DETERMINISTIC = "bucketed"  # the pure-JAX tiles sum in an order no shape changes
NAMES = ("auto", *REGISTRY)  # the `attention_backend` option's choices

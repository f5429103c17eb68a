"""Attention backends behind one interface (model/compute/attention/base.py), picked by platform and
the `attention_backend` option:

    backend     where          what
    cpu_kernel  CPU (auto)     a C++ custom call on every core (model/compute/kernels/cpu_attention.cc),
                               the native backend's cache; auto uses it where it builds (g++)
    native      CPU            pure JAX, work items over key chunks dealt to lanes on the host;
                               a runtime trip count (free on CPU), cost per tile's own context
    bucketed    GPU (auto)     pure JAX, static shapes: programs per context bucket, a loop
                               bound known at compile time (no device-to-host sync per layer)
    pallas      TPU (auto)     jax's Pallas ragged paged attention kernel, with its KV layout
    pallas_gpu  GPU            jax's Pallas (Triton) paged decode kernel; extend steps bucketed
    none        benchmarks     writes K/V but attends to nothing: the step's floor

Pallas kernels also run on CPU in their interpreters (`attention_interpret=True`), which is how
the tests check them against the native path.
"""

from __future__ import annotations

import logging
from typing import Any

from ringserve.model.compute.attention.base import AttentionBackend, AttnGeometry, NoAttention, StepShape

log = logging.getLogger(__name__)

BACKENDS = ("auto", "native", "cpu_kernel", "bucketed", "pallas", "pallas_gpu", "none")
_AUTO = {"cpu": "native", "gpu": "bucketed", "cuda": "bucketed", "rocm": "bucketed", "tpu": "pallas"}

__all__ = ["BACKENDS", "AttentionBackend", "AttnGeometry", "StepShape", "make_backend", "resolve_backend"]


def resolve_backend(requested: str, platform: str, interpret: bool = False, tp: int = 1) -> str:
    """The backend that runs: `requested`, or the platform's default for "auto". Pallas kernels
    need their platform, or `interpret` (Pallas's interpreter, for tests on CPU)."""
    if requested not in BACKENDS:
        raise ValueError(f"attention_backend={requested!r}: choose one of {list(BACKENDS)}")
    name = _AUTO.get(platform, "native") if requested == "auto" else requested
    if name == "native" and requested == "auto" and tp == 1:  # the kernel is not sharded over `tp`
        from ringserve.model.compute.kernels import cpu_attention

        if (why := cpu_attention.reason()) is None:
            name = "cpu_kernel"
        else:
            log.info("attention_backend=auto: the native backend (the C++ kernel: %s)", why)
    if name == "cpu_kernel" and platform != "cpu":
        raise ValueError(f"attention_backend='cpu_kernel' runs on CPU only; this platform is {platform!r}")
    if name == "cpu_kernel" and tp != 1:
        raise ValueError(f"attention_backend='cpu_kernel' needs tp_size=1 (got {tp}): the kernel is not sharded")
    if name == "cpu_kernel" and (why := _kernel_reason()) is not None:
        raise ValueError(f"attention_backend='cpu_kernel' is not available here: {why}")
    if name == "pallas" and platform != "tpu" and not interpret:
        raise ValueError(
            f"attention_backend='pallas' needs a TPU; this platform is {platform!r} "
            "(attention_interpret=True runs the kernel in Pallas's TPU interpreter)"
        )
    if name == "pallas_gpu" and platform not in ("gpu", "cuda", "rocm") and not interpret:
        raise ValueError(
            f"attention_backend='pallas_gpu' needs a GPU; this platform is {platform!r} "
            "(attention_interpret=True runs the kernel in Pallas's interpreter)"
        )
    return name


def _kernel_reason() -> str | None:
    from ringserve.model.compute.kernels import cpu_attention

    return cpu_attention.reason()


def make_backend(name: str, geo: AttnGeometry, cfg: Any, mesh: Any = None) -> AttentionBackend:
    """The backend object for a resolved name (cfg: the executor's config, for tunables; mesh:
    the `tp` mesh, for kernels that run per device under shard_map)."""
    if name == "native":
        from ringserve.model.compute.attention.native import NativeAttention

        return NativeAttention(geo, cfg.attn_chunk_tokens)
    if name == "cpu_kernel":
        from ringserve.model.compute.attention.cpu_kernel import CpuKernelAttention

        return CpuKernelAttention(geo, cfg.attn_chunk_tokens)
    if name == "none":
        return NoAttention(geo)
    if name == "bucketed":
        from ringserve.model.compute.attention.bucketed import BucketedAttention

        return BucketedAttention(geo, cfg.context_bucket_min)
    if name == "pallas":
        from ringserve.model.compute.attention.pallas_tpu import PallasTPUAttention

        return PallasTPUAttention(geo, interpret=cfg.attention_interpret, tp=cfg.tp_size, mesh=mesh)
    if name == "pallas_gpu":
        from ringserve.model.compute.attention.pallas_gpu import PallasGPUAttention

        return PallasGPUAttention(
            geo, cfg.context_bucket_min, interpret=cfg.attention_interpret, tp=cfg.tp_size, mesh=mesh
        )
    raise ValueError(f"attention backend {name!r} is not known")

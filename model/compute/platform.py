"""What a platform name means, without JAX (the frontend and the launcher read it before any
runner starts): its family (`platform_of`) and the defaults that differ by platform. The compute
plan (model/compute/plan.py) makes every other platform choice."""

from __future__ import annotations

PLATFORMS = ("cpu", "gpu", "tpu")

# A prefill step's own cost in prefill tokens, where measured: on CPU a step is ~40 ms plus
# ~1.6 ms a token (SmolLM2 f32, 2 cores, bench.step_floor extend:1x16..1x512). Elsewhere 0 (never
# cut): on an accelerator a small step costs what a decode step does, not measured here.
PREFILL_STEP_COST = {"cpu": 32}


def platform_of(name: str) -> str:
    """"cpu", "gpu" or "tpu" for a JAX platform name ("cuda" and "rocm" are GPUs)."""
    return "gpu" if name in ("gpu", "cuda", "rocm") else name


def prefill_step_cost(name: str) -> int:
    """The default `prefill_step_cost` on platform `name` (actors/scheduler/prefill.py `BucketFit`)."""
    return PREFILL_STEP_COST.get(platform_of(name), 0)

"""RoPE of a GGUF file (model/checkpoints/gguf.py): llama.cpp stores the base and a linear
scaling in metadata (`{arch}.rope.freq_base`, `{arch}.rope.scaling.*`), but llama3 scaling only as
a `rope_freqs` tensor of per-frequency divisors, from which the llama3 parameters are recovered
(and checked to reproduce every frequency) or the file is refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ringserve.model.config import RopeConfig, rope_inv_freq


def rope_parameters(
    get: Callable[..., Any], path: Path, arch: str, head_dim: int, rope_freqs: np.ndarray | None
) -> dict[str, Any]:
    """config.json's `rope_parameters` of a GGUF (`get`: its metadata; `rope_freqs`: its
    `rope_freqs.weight`, if any): the base, linear scaling, or llama3's recovered from the divisors."""
    theta = float(get(f"{arch}.rope.freq_base", 10000.0))
    scaling = get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise ValueError(f"{path}: RoPE scaling {scaling!r} is not supported (only linear and llama3)")
    if scaling == "linear":
        factor = get(f"{arch}.rope.scaling.factor")
        if factor is None:
            raise ValueError(f"{path}: missing GGUF metadata {arch + '.rope.scaling.factor'!r}")
        return {"rope_type": "linear", "rope_theta": theta, "factor": float(factor)}
    if rope_freqs is None or np.all(rope_freqs == 1.0):
        return {"rope_type": "default", "rope_theta": theta}
    return _llama3_from_rope_freqs(rope_freqs, theta, head_dim, path)


def _llama3_from_rope_freqs(divisors: np.ndarray, theta: float, head_dim: int, path: Path) -> dict[str, Any]:
    """Recover llama3 RoPE parameters from llama.cpp's per-frequency divisors.

    llama.cpp rotates frequency i by base_i / divisors[i]; the llama3 rule makes the divisor 1
    above the high-frequency cutoff, `factor` below the low one, and blends between them. The
    divisors fix `factor` (their max); the cutoffs depend on original_max_position_embeddings,
    low_freq_factor and high_freq_factor, taken from the values every Llama 3.x release uses
    (1, 4 and a power of two), and accepted only if they reproduce every frequency."""

    base = rope_inv_freq(RopeConfig(theta=theta), head_dim)
    if divisors.shape != base.shape:
        raise ValueError(f"{path}: rope_freqs has {divisors.size} entries, expected head_dim/2 = {base.size}")
    want = base / divisors
    factor = float(divisors.max())
    for original in (2**k for k in range(8, 18)):
        params = {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": original}  # fmt: skip
        cfg = RopeConfig(
            theta=theta, rope_type="llama3", factor=factor, original_max_position_embeddings=original
        )
        if np.allclose(rope_inv_freq(cfg, head_dim), want, rtol=1e-6, atol=0.0):
            return params
    raise ValueError(
        f"{path}: rope_freqs (per-frequency RoPE divisors, max {factor:g}) do not match llama3 scaling with "
        f"low_freq_factor=1, high_freq_factor=4 and any power-of-two original context; not supported"
    )

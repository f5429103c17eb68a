"""Expert parallelism's two forms (model/layers/expert_parallel.py) on forced CPU devices: psum and
all_to_all give the one-device combination of the same routing (random experts, float32), over
2 and 4 devices, with tokens piled onto one device's experts (the a2a capacity's worst case),
both grouped-matmul paths (the CPU tiles and ragged_dot) and int8 experts; the plan picks the
form by the step's rows. The families' end-to-end check against HF is tests/model/test_moe.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ringserve.model.compute.dots import Dot
from ringserve.model.compute.grouped import GroupedDot
from ringserve.model.layers.expert_parallel import capacity, combine_pairs, expert_parallel
from ringserve.model.layers.mlp import silu
from ringserve.model.layers.moe import expert_product

ROOT = Path(__file__).resolve().parents[2]
E, K, H, INTER = 8, 3, 16, 24


def problem(tokens: int, skew: bool, quant: bool, seed: int = 0):
    """x [T, H], routing (top_p [T, k], distinct top_i [T, k]; `skew`: every token on experts 0
    and 1, both device 0's at ep 2 or 4: the a2a form's fullest destination) and the three
    projections' weights."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(tokens, H)).astype(np.float32)
    pool = 2 if skew else E  # skew: experts 0 and 1 only (device 0's, ep <= 4), k = 2 of them
    k = min(K, pool)
    top_i = np.stack([rng.choice(pool, k, replace=False) for _ in range(tokens)]).astype(np.int32)
    top_p = rng.random((tokens, k)).astype(np.float32)
    shapes = ((E, H, INTER), (E, H, INTER), (E, INTER, H))
    ws: tuple[tuple[np.ndarray, ...], ...]
    if quant:  # int8 [E, out, in] + scale [E, out]
        ws = tuple((rng.integers(-127, 128, (e, o, i), dtype=np.int8), rng.random((e, o), np.float32) / 64)
                   for e, i, o in shapes)  # fmt: skip
    else:
        ws = tuple((rng.normal(size=s).astype(np.float32) / 4,) for s in shapes)
    return x, top_p, top_i, ws


def run_forms(ep: int, tokens: int, skew: bool, quant: bool, grouped: GroupedDot) -> dict[str, np.ndarray]:
    """The combined output [T, H] of one device, psum and a2a over `ep` of this process's devices."""
    x, top_p, top_i, ws = problem(tokens, skew, quant)
    dot = Dot()

    def mlp(xs, sizes, row0, arrays, layer, grouped):
        wg, wu, wd = arrays
        h = silu(expert_product(xs, sizes, row0, wg, layer, grouped, dot, quant))
        h = h * expert_product(xs, sizes, row0, wu, layer, grouped, dot, quant)
        return expert_product(h, sizes, row0, wd, layer, grouped, dot, quant)

    mesh = jax.make_mesh((ep,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    split = tuple(tuple(jax.device_put(a, jax.NamedSharding(mesh, jax.P("tp"))) for a in w) for w in ws)
    out = {"local": np.asarray(jax.jit(lambda x, p, i, ws: combine_pairs(
        x, p, i, E, lambda xs, s: mlp(xs, s, 0, ws, None, grouped)))(x, top_p, top_i, ws))}  # fmt: skip
    for form in ("psum", "a2a"):
        f = jax.jit(
            lambda x, p, i, ws, form=form: expert_parallel(form, ep, mlp, grouped, x, p, i, ws, jnp.int32(0))
        )
        out[form] = np.asarray(f(x, top_p, top_i, split))
    return out


SCRIPT = """
import numpy as np
from ringserve.model.compute.grouped import GroupedDot
from tests.model.test_expert_parallel import run_forms
for ep, tokens, skew, quant, grouped in ((4, 8, False, False, GroupedDot("tiles")), (4, 16, True, False, GroupedDot()),
                                         (4, 12, False, True, GroupedDot("tiles")), (2, 4, True, True, GroupedDot())):
    out = run_forms(ep, tokens, skew, quant, grouped)
    for form in ("psum", "a2a"):
        np.testing.assert_allclose(out[form], out["local"], rtol=2e-5, atol=2e-5, err_msg=f"{form} ep {ep}")
    assert np.abs(out["local"]).max() > 0.1
print("ok")
"""


@pytest.mark.slow
def test_psum_and_all_to_all_equal_one_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_capacity_is_the_worst_case():
    """A token's k experts are distinct: at most min(k, E / ep) of them on one device."""
    assert capacity(64, 8, 128, 8) == 8 * 8  # Qwen3-30B-A3B at ep 8: 16 experts a device >= k
    assert capacity(64, 8, 16, 8) == 8 * 2  # 2 experts a device: a token sends it 2 pairs at most
    assert capacity(4, 3, 8, 4) == 1 * 2


def test_the_form_follows_the_rows():
    """psum below the plan's `moe_a2a_rows`, all_to_all from it on when ep divides the rows."""
    from types import SimpleNamespace

    from ringserve.model.layers.moe import Experts

    def form(ep, a2a_rows, tokens):
        return Experts.form(SimpleNamespace(ep=ep, a2a_rows=a2a_rows), tokens)  # type: ignore[arg-type]

    assert [form(4, 64, t) for t in (16, 64, 66, 256)] == ["psum", "a2a", "psum", "a2a"]
    assert form(1, 64, 256) == "local" and form(4, None, 256) == "psum"

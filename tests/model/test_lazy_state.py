"""Many hosts read only their own shards (model/weights/state.py build_lazy_state): its tree has
build_host_state's structure, shapes and dtypes; any slice of a leaf equals that slice of the
built array; and a shard reads only the rows of its HF tensor that it needs."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest

from ringserve.model.checkpoints.load import load_checkpoint
from ringserve.model.families import family
from ringserve.model.weights.state import build_host_state, build_lazy_state


class Recorder(np.ndarray):
    """An HF tensor that records the index of every read."""

    reads: list


def recording(tensors: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, list]]:
    out, log = {}, {}
    for name, a in tensors.items():
        r = np.asarray(a).view(Recorder)
        r.reads = log[name] = []
        out[name] = r
    return out, log


def _getitem(self, idx):
    self.reads.append(idx)
    return np.asarray(self)[idx]


Recorder.__getitem__ = _getitem  # type: ignore[method-assign]


@pytest.mark.parametrize("stacked", [True, False])
def test_lazy_leaves_equal_the_built_state_slice_by_slice(tiny_dir, stacked):
    cfg, tensors = load_checkpoint(tiny_dir("llama"))
    dt = ml_dtypes.bfloat16
    built = build_host_state(family(cfg.family), cfg, tensors, dt, stacked)
    lazy = build_lazy_state(family(cfg.family), cfg, tensors, dt, stacked)
    assert jax.tree.structure(built) == jax.tree.structure(lazy)
    for b, z in zip(jax.tree.leaves(built), jax.tree.leaves(lazy), strict=True):
        assert (b.shape, b.dtype) == (z.shape, z.dtype)
        whole = z[tuple(slice(None) for _ in b.shape)]
        np.testing.assert_array_equal(whole, b)
        half = tuple(slice(0, max(1, n // 2)) if i == b.ndim - 1 else slice(None) for i, n in enumerate(b.shape))
        np.testing.assert_array_equal(z[half], b[half])
    with pytest.raises(ValueError, match="missing"):
        build_lazy_state(family(cfg.family), cfg, {k: v for k, v in tensors.items() if "norm" not in k}, dt, stacked)


def test_a_shard_reads_only_its_rows(tiny_dir):
    cfg, tensors = load_checkpoint(tiny_dir("llama"))
    rec, log = recording(tensors)
    lazy = build_lazy_state(family(cfg.family), cfg, rec, np.float32, stacked=True)
    q = lazy["layers"]["self_attn"]["q_proj"]["weight"]  # [L, H, Hq*D], column-parallel: split on out
    out = q.shape[2]
    shard = q[slice(None), slice(None), slice(out // 2, out)]
    assert shard.shape == (cfg.num_layers, cfg.hidden_size, out // 2)
    for layer in range(cfg.num_layers):
        reads = log[f"model.layers.{layer}.self_attn.q_proj.weight"]
        assert reads == [(slice(out // 2, out), slice(None))]  # HF [out, in]: its second half of rows only
    assert log["model.layers.0.mlp.up_proj.weight"] == []  # nothing read before it is asked for

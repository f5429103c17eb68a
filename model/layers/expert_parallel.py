"""How routed tokens reach their experts (model/layers/moe.py `Experts`): on one device, or with
the experts split over the mesh's `tp` devices (expert parallelism, `ep_size`; E / ep experts a
device, model/compute/mesh.py `ep_split`) in one of two forms, both under shard_map:

    psum   every device holds every token (they are replicated between the tensor-parallel
           attention layers), sorts all T * k (token, expert) pairs by expert, multiplies its own
           experts' run of them (the rest stay zero), weights and sums them per token, and one
           psum of the combined float32 [T, H] adds the devices' parts (k times fewer bytes than
           summing the [T * k, H] pairs)
    a2a    device d takes its T / ep tokens, sorts their pairs by expert (so by the device
           holding it), and one all_to_all sends each device the pairs of its experts; it
           multiplies them, a second all_to_all brings the results back, the pairs are weighted
           and summed per token, and an all_gather gives every device all T tokens again for
           the next attention

    a2a send buffer of device d, [ep, C, H]: one slot run per destination, C = capacity
        dest 0: [ pairs of d's tokens whose expert is on device 0 | zero ... ]
        dest 1: [ ...                                             | zero ... ]
    C = (T / ep) * min(k, E / ep): a token's k experts are distinct, so at most min(k, E / ep)
    of them live on one device; no pair is ever dropped, and the shapes stay static.
    The receiver tags its empty slots with expert E / ep (past its own), which sort last and
    fall outside every group.

The compute plan picks the form per program by its static row count (model/compute/plan.py
`moe_a2a_rows`: all_to_all from that many rows on, psum below). While the attention is
tensor-parallel every device already holds every token, so psum is the cheaper form at every
size compiled: its one all-reduce of [T, H] against the a2a form's [T * min(k, E / ep), H] of
padded slots each way (Qwen3-30B-A3B, ep 8 on v6e:2x4, 256 rows: 2.1 MB against 18.9 MB a
layer); the plan keeps psum, and a2a is for tokens split over the devices (data-parallel
attention). Figures: bench/RESULTS.md "TPU ahead-of-time compiles", bench/moe_ep.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ringserve.model.compute.mesh import ep_mesh

Multiply = Callable[[jax.Array, jax.Array], jax.Array]  # (rows [P, H] sorted by expert, sizes [E]) -> [P, H]


def combine_pairs(
    x: jax.Array, top_p: jax.Array, top_i: jax.Array, experts: int, multiply: Multiply
) -> jax.Array:
    """sum_j top_p[t, j] * y[t, j], float32 [T, H], where y are `multiply`'s outputs for the T * k
    (token, expert) pairs sorted by expert (pair p = t * k + j; `experts` groups).

        pair p = t * k + j  --argsort(expert of p)-->  [e0 e0 e0 e1 e2 e2 ...]
        group sizes [E] = how many pairs chose each expert;  the inverse permutation puts them back
    """
    t, k = top_i.shape
    pair_expert = top_i.reshape(-1)
    order = jnp.argsort(pair_expert, stable=True)  # pairs grouped by expert
    sizes = jnp.bincount(pair_expert, length=experts).astype(jnp.int32)
    ys = multiply(jnp.take(x, order // k, axis=0), sizes)  # [T * k, H], grouped
    back = jnp.take(ys, jnp.argsort(order), axis=0).reshape(t, k, -1)  # token order
    return jnp.einsum("tkh,tk->th", back.astype(jnp.float32), top_p)


def capacity(tokens: int, k: int, experts: int, ep: int) -> int:
    """Slots a device reserves for each destination in the a2a form (the module docstring)."""
    return tokens // ep * min(k, experts // ep)


def expert_parallel(form: str, ep: int, mlp: Callable[..., jax.Array], grouped: Any, x: jax.Array, top_p: jax.Array,
                    top_i: jax.Array, arrays: Any, layer: jax.Array) -> jax.Array:  # fmt: skip
    """The routed experts' combined output, float32 [T, H] on every device, in `form` ("psum" or
    "a2a"); `arrays`: the projections' weights split by expert over `tp` ([E, ...] or a scan's
    [L, E, ...] stack, and int8 scales [(L,) E, out]); `mlp(xs, sizes, row0, arrays, layer,
    grouped)` multiplies a device's experts' rows (moe.py `Experts.mlp`)."""

    def psum(x, top_p, top_i, arrays, layer):
        mine = arrays[0][0].shape[-3]  # E / ep
        first = jax.lax.axis_index("tp") * mine

        def multiply(xs, sizes):
            row0 = (jnp.cumsum(sizes) - sizes)[first]  # my experts' run of the sorted pairs
            return mlp(xs, jax.lax.dynamic_slice(sizes, (first,), (mine,)), row0, arrays, layer, grouped)

        return jax.lax.psum(combine_pairs(x, top_p, top_i, mine * ep, multiply), "tp")

    def a2a(x, top_p, top_i, arrays, layer):
        mine = arrays[0][0].shape[-3]  # E / ep
        n, k = top_i.shape[0] // ep, top_i.shape[1]
        c = capacity(top_i.shape[0], k, mine * ep, ep)
        me = jax.lax.axis_index("tp") * n
        xl, pl, il = (jax.lax.dynamic_slice_in_dim(a, me, n) for a in (x, top_p, top_i))
        pair_expert = il.reshape(-1)  # [n * k], pair p = t * k + j
        order = jnp.argsort(pair_expert, stable=True)
        expert = pair_expert[order]
        dest = expert // mine  # ascending: the pairs of each destination are one run
        counts = jnp.bincount(dest, length=ep)
        slot = jnp.arange(n * k) - (jnp.cumsum(counts) - counts)[dest]  # < c (the docstring's bound)
        send = jnp.zeros((ep, c, x.shape[1]), x.dtype).at[dest, slot].set(jnp.take(xl, order // k, axis=0))
        tags = jnp.full((ep, c), mine, jnp.int32).at[dest, slot].set(expert - dest * mine)
        rows = jax.lax.all_to_all(send, "tp", 0, 0).reshape(ep * c, -1)  # [source, slot] flattened
        tags = jax.lax.all_to_all(tags, "tp", 0, 0).reshape(-1)
        by_expert = jnp.argsort(tags, stable=True)  # empty slots (tag `mine`) last
        sizes = jnp.bincount(tags, length=mine + 1)[:mine].astype(jnp.int32)
        ys = mlp(jnp.take(rows, by_expert, axis=0), sizes, 0, arrays, layer, grouped)
        ys = jnp.take(ys, jnp.argsort(by_expert), axis=0).reshape(ep, c, -1)
        back = jax.lax.all_to_all(ys, "tp", 0, 0)  # [dest, slot]: my pairs' results
        pairs = jnp.take(back[dest, slot], jnp.argsort(order), axis=0).reshape(n, k, -1)
        out = jnp.einsum("tkh,tk->th", pairs.astype(jnp.float32), pl)
        return jax.lax.all_gather(out, "tp", axis=0, tiled=True)

    # by expert: a weight [(L,) E, ..] and a scale [(L,) E, out] (the layer axis: a stack read in place)
    specs = tuple(
        tuple(P(*(None,) * (a.ndim - (3 if j == 0 else 2)), "tp") for j, a in enumerate(t)) for t in arrays
    )
    run = jax.shard_map({"psum": psum, "a2a": a2a}[form], mesh=ep_mesh(ep), in_specs=(P(), P(), P(), specs, P()),
                        out_specs=P(), check_vma=False)  # fmt: skip
    return run(x, top_p, top_i, arrays, layer)

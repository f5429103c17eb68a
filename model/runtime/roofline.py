"""An analytic step time for a compiled program on a chip: the bytes it must read, the flops it
must do and the bytes it must move between chips, each against the chip's published limit
(model/compute/tpu_topology.py). An estimate, labelled so: a step cannot beat its largest term,
and this reports that floor with the term that sets it (HBM, MXU or ICI).

    bytes (per chip) = the weights' shards (the embedding table is gathered, not read, unless
                       the head is tied to it) + the KV the attention reads, in the backend's
                       layout (padded heads and lanes included) + the step's new KV written
    flops (per chip) = 2 x tokens x the layers' matmul weights + 2 x sampled rows x the head's
                       + attention's 4 x heads x head_dim per (query, key) pair, over tp; a
                       mixture of experts' expert weights count k / E of theirs (a token
                       multiplies its k experts; routing taken as balanced over the devices)
    ICI              = the compiled program's collectives (result bytes; a scanned layer body
                       counted once per layer) moved over half the chip's ICI (a ring: two of
                       its links), plus LATENCY_S each; a device keeps 1 / tp of an all-gather's
                       result and of an all-to-all's (its own slot run), an all-reduce moves
                       2 (tp - 1) / tp of it (expert parallelism's two forms:
                       model/layers/expert_parallel.py)
    step             = max(bytes / HBM, flops / peak) + ICI (a decode step's collectives wait
                       for the layer before them and the next layer waits for them)

Context: a program with no context bucket (the ragged kernels) holds any; the estimate takes
`context` tokens cached per row. Decode, verify and multi-step rows each read their context;
an extend program is taken as one prompt chunk of its tokens after `context` cached tokens.
Not XLA's `cost_analysis()`: it counts a while body once, the Pallas kernel as nothing.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ringserve.model.compute.step_inputs import StepShape
from ringserve.model.compute.tpu_topology import Chip

LATENCY_S = 5e-6  # a collective's fixed cost on ICI (assumed: a few microseconds a hop)


def _leaf_bytes(path: Any, a: Any) -> tuple[str, int, int]:
    name = jax.tree_util.keystr(path)
    shape = a.sharding.shard_shape(a.shape) if a.sharding is not None else a.shape
    return name, int(np.prod(shape)) * np.dtype(a.dtype).itemsize, int(np.prod(shape))


def estimate(
    ex: Any, shape: StepShape, chip: Chip, context: int, collectives: dict[str, dict[str, int]] | None
) -> dict:
    """The analytic step of program `shape` of executor `ex` (model/runtime/aot.py) on `chip`
    with `context` tokens cached per row (see the module docstring)."""
    mc, tp = ex.model_config, ex.mesh.size
    leaves = [_leaf_bytes(p, a) for p, a in jax.tree_util.tree_flatten_with_path(ex.params_avals)[0]]
    tied = not any("lm_head" in n for n, _, _ in leaves)
    embed = [x for x in leaves if "embed" in x[0]]
    head = embed if tied else [x for x in leaves if "lm_head" in x[0]]
    layers = [x for x in leaves if "embed" not in x[0] and "lm_head" not in x[0]]
    # norms are a rounding error against the matmuls; a token multiplies k of E experts
    active = mc.num_experts_per_tok / mc.num_experts if mc.num_experts else 1.0
    layer_elems = sum(e * (active if "['experts']" in n else 1.0) for n, _, e in layers)
    head_elems = sum(e for _, _, e in head)
    weight_bytes = sum(b for _, b, _ in layers) + sum(b for _, b, _ in head)

    t, r = shape.tokens, shape.rows
    sampled = r * max(1, shape.verify)
    kv_token = ex.kv_bytes_per_token()
    heads_local = mc.num_heads / tp if mc.num_heads % tp == 0 else mc.num_heads
    if shape.block == 1 or shape.verify:  # decode, verify, multi-step: every row reads its context
        steps = shape.verify if shape.multistep else 1
        kv_tokens = r * context * steps
        pairs = t * context
    else:  # one prompt chunk of t tokens after `context` cached
        kv_tokens = context + t
        pairs = t * context + t * t // 2
    kv_read = kv_tokens * kv_token
    kv_write = t * kv_token
    total = weight_bytes * (shape.verify if shape.multistep else 1) + kv_read + kv_write
    flops = (
        2 * t * layer_elems + 2 * sampled * head_elems + 4 * pairs * heads_local * mc.head_dim * mc.num_layers
    )

    ici_bytes, ici_count = 0.0, 0
    if tp > 1 and collectives:
        for op, c in collectives.items():
            moved = {"all-reduce": 2 * (tp - 1) / tp, "reduce-scatter": tp - 1}.get(op, (tp - 1) / tp)
            ici_bytes += moved * (c["bytes_per_layer"] * mc.num_layers + c["bytes_outside"])
            ici_count += c["per_layer"] * mc.num_layers + c["outside"]
    terms = {"HBM": total / chip.hbm_bandwidth, "MXU": flops / chip.bf16_flops,
             "ICI": ici_bytes / (chip.ici_bandwidth / 2) + ici_count * LATENCY_S}  # fmt: skip
    step = max(terms["HBM"], terms["MXU"]) + terms["ICI"]
    # tokens out per step: multi-step rows `verify` each, verify rows at least one (drafts accepted
    # are the workload's), decode rows one; an extend step's are the prompts' (not counted)
    out_tokens = r * shape.verify if shape.multistep else (r if shape.block == 1 or shape.verify else 0)
    return {
        "context": context,
        "bytes_per_chip": int(total), "weight_bytes_per_chip": int(weight_bytes), "kv_read_bytes_per_chip": int(kv_read),
        "kv_bytes_per_token_per_chip": kv_token, "flops_per_chip": int(flops), "ici_bytes": int(ici_bytes),
        "ici_collectives": ici_count, "hbm_s": terms["HBM"], "mxu_s": terms["MXU"], "ici_s": terms["ICI"],
        "step_s": step, "bound": max(terms, key=lambda k: terms[k]),
        "tokens_per_s": out_tokens / step if out_tokens else None,
    }  # fmt: skip

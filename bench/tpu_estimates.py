"""Analytic decode estimates (model/runtime/roofline.py) at the published TPU workloads, beside
their published figures: what `ringserve compile` estimates, at the workloads' own batch, context
and chips, without compiling (the programs are built for the topology, not compiled; the
collectives are the ideal two all-reduces a layer, which the compiled programs show). Estimates,
not measurements: no TPU has been reached from here. Needs libtpu (tools/install_libtpu.sh).

    python -m ringserve.bench.tpu_estimates
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# (anchor, model shape, topology, tp, decode batch, mean context of a decode step, published)
WORKLOADS = [
    (
        "tpu-inference Llama-3.1-8B 1,800/128 (CI floor)",
        "llama-3-8b",
        "v6e:1x1",
        1,
        64,
        1864,
        ">= 10.77 req/s",
    ),
    ("sglang-jax Qwen3-8B 1k/1k batch 64", "qwen3-8b", "v6e:2x2", 4, 64, 1536, "5,297 tok/s"),
    ("sglang-jax Qwen3-8B 1k/1k batch 256", "qwen3-8b", "v6e:2x2", 4, 256, 1536, "7,572 tok/s"),
    ("JetStream Llama-3-8B batch 128 (bf16)", "llama-3-8b", "v5e:2x4", 8, 128, 1024, "8,249 tok/s"),
]


def estimate_row(model: str, topology: str, tp: int, batch: int, context: int) -> dict:
    from ringserve.model.checkpoints.config_shapes import model_config
    from ringserve.model.compute.step_inputs import StepShape
    from ringserve.model.compute.tpu_topology import ensure_libtpu, tpu_topology
    from ringserve.model.runtime.aot import AbstractExecutor
    from ringserve.model.runtime.executor import ExecutorConfig
    from ringserve.model.runtime.roofline import estimate

    ensure_libtpu()
    topo = tpu_topology(topology)
    mc, _ = model_config(model)
    cfg = ExecutorConfig(dtype="bfloat16", attention_backend="pallas", page_size=64, num_pages=1024, max_batch=batch,
                         max_extend_tokens=4096, extend_block=64, max_context_len=4096, tp_size=tp)  # fmt: skip
    ex = AbstractExecutor(mc, cfg, topo.devices)
    per_layer = {
        "per_layer": 2,
        "outside": 0,
        "bytes_per_layer": 2 * batch * mc.hidden_size * 2,
        "bytes_outside": 0,
    }
    coll = {"all-reduce": per_layer} if tp > 1 else None
    return estimate(ex, StepShape(1, batch, batch), topo.chip, context, coll)


def main() -> None:
    print("| workload (published) | topology, tp | batch, context | bytes/chip | est. step ms (HBM / MXU / ICI) "
          "| bound | est. decode tok/s | published |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, model, topology, tp, batch, context, published in WORKLOADS:
        e = estimate_row(model, topology, tp, batch, context)
        print(f"| {name} | {topology}, {tp} | {batch}, {context} | {e['bytes_per_chip'] / 1e9:.2f} GB | "
              f"{e['step_s'] * 1e3:.2f} ({e['hbm_s'] * 1e3:.2f} / {e['mxu_s'] * 1e3:.2f} / {e['ici_s'] * 1e3:.2f}) | "
              f"{e['bound']} | {e['tokens_per_s']:,.0f} | {published} |")  # fmt: skip


if __name__ == "__main__":
    main()

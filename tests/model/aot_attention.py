"""Compile one TPU attention backend's write + attend for a TPU topology, ahead of time, with
libtpu (run in a subprocess by tests/model/test_tpu_aot.py, so the test process's JAX stays on
CPU). Prints one JSON line per program: {"tokens", "rows", "ok", "error", "seconds", "temp_mib", "kv_mib",
"cache_copies"} (with "hlo": true, the compiled HLO too).

    python -m tests.model.aot_attention '{"topology": "v5e:1x1", "backend": "pallas", "heads": 9,
        "kv_heads": 3, "head_dim": 64, "page": 64, "context": 4096, "programs": [[256, 256], [4096, 256]]}'

Optional: "windows" (the two layers' sliding windows, 0: global), "geometry" (more AttnGeometry
fields: "local_pages"), "traced_layer" (the layer an argument, as the scanned loop's).
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ringserve.model.compute.attention import REGISTRY
from ringserve.model.compute.attention.base import AttnGeometry
from ringserve.model.compute.options import ComputeOptions
from ringserve.model.compute.plan import ComputePlan
from ringserve.model.compute.step_inputs import StepShape
from ringserve.model.runtime.programs import step_avals


def compile_programs(a: dict) -> list[dict]:
    name = a["topology"]
    bounds = {"chips_per_host_bounds": (1, 1, 1)} if name.endswith("1x1") else {}
    topo = topologies.get_topology_desc(platform="tpu", topology_name=name, **bounds)
    tp = a.get("tp", 1)
    mesh = Mesh(np.array(topo.devices[:tp]), ("tp",), axis_types=(AxisType.Auto,))
    plan = ComputePlan.resolve(ComputeOptions(dtype="bfloat16", attention_backend=a["backend"]), "tpu", tp, tp)
    geo = AttnGeometry(num_layers=2, num_pages=a.get("num_pages", 1025), page_size=a["page"], num_heads=a["heads"],
                       num_kv_heads=a["kv_heads"], head_dim=a["head_dim"], max_pages=a["context"] // a["page"],
                       dtype=jnp.bfloat16, windows=windows(a), **a.get("geometry", {}))  # fmt: skip
    rep = NamedSharding(mesh, PartitionSpec())
    out = []
    with jax.default_device(topo.devices[0]):
        attn = REGISTRY[plan.attention].load().make(geo, plan, mesh)
        kv = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s))
                   for x, s in zip(attn.kv_avals(), attn.kv_specs(tp), strict=True))  # fmt: skip

        def layer(kv, q, k, v, fb, *at):
            at = at[0] if at else jnp.int32(1)
            kv = attn.write(kv, at, k, v, fb)
            return kv, attn.attend(q, kv, at, fb)

        # the layer: 1 (a constant), or with "traced_layer" an argument (the scanned loop's: the
        # local and global page spaces and windows both compiled in, picked at run time)
        at = (jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),) if a.get("traced_layer") else ()
        for tokens, rows in a["programs"]:
            shape = StepShape(1 if tokens == rows else 64, tokens, rows)
            fb = step_avals(shape, attn.plan_avals(shape), geo.max_pages, rep, 1, local=geo.local_pages > 0)[0]
            q, k = (jax.ShapeDtypeStruct((tokens, h, geo.head_dim), jnp.bfloat16, sharding=rep)
                    for h in (geo.num_heads, geo.num_kv_heads))  # fmt: skip
            t0 = time.time()
            rec = {"tokens": tokens, "rows": rows, "ok": True, "error": None}
            try:
                c = jax.jit(layer, donate_argnums=(0,)).lower(kv, q, k, k, fb, *at).compile()
                mem = c.memory_analysis()
                rec.update(temp_mib=round(mem.temp_size_in_bytes / 2**20, 1), kv_mib=round(kv[0].size * 2 / 2**20, 1))
                cache = f"bf16[{','.join(map(str, kv[0].shape))}]"  # a copy of the whole cache (a layout change)
                rec["cache_copies"] = sum(1 for ln in c.as_text().splitlines() if f"= {cache}" in ln and " copy(" in ln)
                if a.get("hlo"):
                    rec["hlo"] = c.as_text()
            except Exception as e:  # noqa: BLE001 -- the compiler's error is the report
                rec.update(ok=False, error=str(e)[:2000])
            rec["seconds"] = round(time.time() - t0, 1)
            out.append(rec)
    return out


def windows(a: dict) -> tuple[int, ...] | None:
    """The two layers' windows: "windows" as given, else "sliding_window" on both, else none."""
    if a.get("windows"):
        return tuple(a["windows"])
    return (a["sliding_window"],) * 2 if a.get("sliding_window") else None


if __name__ == "__main__":
    for rec in compile_programs(json.loads(sys.argv[1])):
        print(json.dumps(rec), flush=True)

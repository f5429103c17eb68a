"""Ahead-of-time compiles of the executor's step programs for devices this host does not have
(`ringserve compile`, actors/cli/compile.py): a TPU topology's compile-only devices from libtpu
(model/compute/tpu_topology.py), with the model built from its config.json alone.

`AbstractExecutor` is the program-making half of `ModelExecutor` (model/runtime/executor.py):
the same plan, attention backend, state and KV avals, step function, program keys and abstract
arguments (it inherits `_kv_avals` and `_program_args`, so a program compiled here is the one
the server would compile), and none of the rest: no weights read, no KV pool, no device memory.
`compile_program` lowers and compiles one program and reads back what the compiler says of it:
the compile's error or seconds, the memory per chip (`memory_analysis`), the collectives.

Collectives are counted in the compiled HLO: all-reduce, all-gather, reduce-scatter, all-to-all
(an async pair's `-start` counted once). With the layers in a scan the layer's body is one while
loop's body and appears once: those counted in it are per layer, the rest are the step's own.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from ringserve.model.compute.plan import ComputePlan
from ringserve.model.compute.step_inputs import Buckets, StepShape
from ringserve.model.config import ModelConfig
from ringserve.model.families import family
from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor, _statics
from ringserve.model.runtime.programs import Key, compile_order
from ringserve.model.weights.lora import LoraPool

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def family_name(shape: StepShape) -> str:
    """decode, extend (prefill and mixed steps), verify or multistep: the program families of
    `Buckets.families`."""
    if shape.multistep:
        return "multistep"
    if shape.verify:
        return "verify"
    return "decode" if shape.block == 1 else "extend"


class AbstractLoraPool(LoraPool):
    """The adapter pool's shapes without its device arrays (`avals`)."""

    def resume(self) -> None:  # no device arrays: only the shapes are wanted
        self.weights = None

    def avals(self) -> Any:
        return jax.tree.map(
            lambda z: jax.ShapeDtypeStruct(z.shape, z.dtype, sharding=self.sharding), self._zeros()
        )


class AbstractExecutor(ModelExecutor):
    """ModelExecutor's programs for `cfg` over `devices` (any platform's, compile-only ones
    included), from `mc` alone. See the module docstring."""

    def __init__(self, mc: ModelConfig, cfg: ExecutorConfig, devices: tuple[Any, ...]):  # noqa: PLR0915
        self.cfg = cfg
        shapes = cfg.shapes
        if cfg.tp_size > len(devices):
            raise ValueError(f"tp_size={cfg.tp_size}: the topology has {len(devices)} chips")
        self.mesh = Mesh(np.array(devices[: cfg.tp_size]), ("tp",), axis_types=(AxisType.Auto,))
        self.plan = plan = ComputePlan.resolve(cfg.compute, devices[0].platform, cfg.tp_size, self.mesh.size,
                                               rope_positions=shapes.max_pages * shapes.page_size, ep=cfg.ep_size)  # fmt: skip
        self.model_config = mc
        self.family = family(mc.family)
        self._build_model(mc)
        opts = cfg.compute
        self.buckets = Buckets.make(
            shapes.max_batch, shapes.max_extend_tokens, opts.extend_block, opts.decode_bucket_step
        )
        self.max_slots = shapes.max_batch
        self.params_avals = self.model.state_avals(self.mesh)
        self.kv_avals = self._kv_avals()
        self.lora = None
        if cfg.lora_slots:
            rep = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
            pool = AbstractLoraPool(self.family, mc, cfg.lora_slots, cfg.lora_rank, cfg.lora_targets,
                                    plan.layer_loop == "scan", plan.jnp_dtype, rep)  # fmt: skip
            self.lora, self.lora_avals = pool, pool.avals()
        self._jitted = jax.jit(self._step_fn(), donate_argnums=(1, 2), static_argnums=(7, 8, 9))
        self.contexts = self.attn.context_buckets()
        self.order, self.lead = compile_order(self.buckets, self.contexts, shapes.verify_tokens, shapes.top_logprobs_num,
                                              plan.lead_small_programs, shapes.decode_steps, shapes.decode_steps_rows)  # fmt: skip

    def lower(self, key: Key) -> Any:
        """The lowered program of `key`, under the mesh's first device (Mosaic asks the default
        device's kind)."""
        shape, top_n = key
        with jax.default_device(self.mesh.devices.flat[0]):
            return self._jitted.lower(*self._program_args(shape), *_statics(shape, top_n))

    def num_params(self) -> int:
        """Elements of the whole state (every chip's shards together)."""
        return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(self.params_avals))

    def weight_bytes(self) -> int:
        """Bytes of the state on one chip (each leaf's shard)."""
        return sum(_shard_bytes(a) for a in jax.tree.leaves(self.params_avals))

    def kv_layout_bytes_per_token(self) -> int:
        """KV bytes one token holds in every layer on all chips together, in the backend's layout
        (padding included)."""
        kv, _ = self.kv_avals
        geo = self.attn.geo
        total = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in kv)
        return total * geo.num_layers // self._places()

    def kv_bytes_per_token(self) -> float:
        """KV bytes one token holds in every layer on one chip, in the backend's layout (padding included)."""
        kv, _ = self.kv_avals
        return sum(_shard_bytes(a) for a in kv) * self.attn.geo.num_layers / self._places()

    def _places(self) -> int:
        """The KV arrays' token places: total_pages x page_size, every layer's pages (a local
        page space's included), each place one layer's K and V of a token."""
        geo = self.attn.geo
        return geo.total_pages * geo.page_size


def _shard_bytes(a: Any) -> int:
    shape = a.sharding.shard_shape(a.shape) if a.sharding is not None else a.shape
    return int(np.prod(shape)) * np.dtype(a.dtype).itemsize


@dataclasses.dataclass
class Compiled:
    """What compiling one program tells (`compile_program`)."""

    ok: bool
    error: str | None
    seconds: float
    memory: dict[str, int]
    collectives: dict[
        str, dict[str, int]
    ]  # op -> {"per_layer", "outside", "bytes_per_layer", "bytes_outside"}


def compile_program(ex: AbstractExecutor, key: Key) -> Compiled:
    """Lower and compile the program of `key`; the compiler's error (its first lines) if it
    fails."""
    t0 = time.perf_counter()
    try:
        with jax.default_device(ex.mesh.devices.flat[0]):
            compiled = ex.lower(key).compile()
    except Exception as e:  # noqa: BLE001 -- the compiler's refusal is the report
        return Compiled(False, _first_lines(f"{type(e).__name__}: {e}"), time.perf_counter() - t0, {}, {})
    seconds = time.perf_counter() - t0
    return Compiled(True, None, seconds, memory_of(compiled), count_collectives(compiled.as_text(),
                                                                            ex.plan.layer_loop == "scan"))  # fmt: skip


def _first_lines(text: str, n: int = 6, width: int = 400) -> str:
    return "\n".join(line[:width] for line in text.strip().splitlines()[:n])


def memory_of(compiled: Any) -> dict[str, int]:
    """The compiled program's memory on one chip (XLA's memory analysis): arguments, outputs,
    temporaries, aliased (donated) bytes, code, and the peak they make."""
    m = compiled.memory_analysis()
    if m is None:
        return {}
    out = {
        f: int(getattr(m, f"{f}_size_in_bytes", 0))
        for f in ("argument", "output", "temp", "alias", "generated_code")
    }
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) ", re.M)
_WHILE_BODY = re.compile(r"body=%?([\w.\-]+)")
_OP = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_SHAPE = re.compile(r"(pred|s8|u8|s16|u16|bf16|f16|s32|u32|f32|s64|u64|f64)\[([\d,]*)\]")
_ITEM = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
         "s64": 8, "u64": 8, "f64": 8}  # fmt: skip


def _computations(hlo: str) -> dict[str, str]:
    """HLO text split into its computations by name."""
    out: dict[str, str] = {}
    name: str | None = None
    lines: list[str] = []
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            m = _COMP.match(line)
            name, lines = (m.group(1) if m else line), []
            continue
        if line.startswith("}"):
            if name is not None:
                out[name] = "\n".join(lines)
            name = None
            continue
        if name is not None:
            lines.append(line)
    return out


def _ops(body: str) -> list[tuple[str, int]]:
    """(collective, result bytes) of each collective in one computation's text."""
    found = []
    for line in body.splitlines():
        m = _OP.search(line)
        if m is None:
            continue
        result = m.group(1)
        shapes = _SHAPE.findall(result)
        if m.group(3) and len(shapes) > 1:  # an async start's result: (operands..., results...)
            shapes = shapes[len(shapes) // 2 :]
        nbytes = sum(
            _ITEM[t] * int(np.prod([int(d) for d in dims.split(",") if d] or [1])) for t, dims in shapes
        )
        found.append((m.group(2), nbytes))
    return found


def count_collectives(hlo: str, scanned: bool) -> dict[str, dict[str, int]]:
    """Per collective: how many the layer loop's body holds (per layer; scanned layers only, else
    0) and how many the rest of the program does, with their result bytes (a collective in
    another loop is counted once)."""
    comps = _computations(hlo)
    per = {name: _ops(text) for name, text in comps.items()}
    bodies = set(_WHILE_BODY.findall(hlo))
    # the layer's body is the largest (the sampler's loops are a few ops each); its trip count is
    # not in the text
    layer = (
        max((b for b in bodies if b in comps), key=lambda b: len(comps[b]), default=None) if scanned else None
    )
    out = {c: {"per_layer": 0, "outside": 0, "bytes_per_layer": 0, "bytes_outside": 0} for c in COLLECTIVES}
    for name, ops in per.items():
        where = "per_layer" if name == layer else "outside"
        for op, nbytes in ops:
            out[op][where] += 1
            out[op]["bytes_" + where] += nbytes
    return out

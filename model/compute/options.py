"""The compute options: what a user may ask of how the model computes, as one section of the
server's options (ServerArgs.compute, actors/server_args.py) that reaches the executor unchanged
(model/runtime/executor.py ExecutorConfig.compute). No JAX here: the frontend validates it.
The compute plan (model/compute/plan.py) resolves it, once, against the platform."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

from ringserve.model.compute.attention import NAMES as ATTENTION_BACKENDS

DTYPES = ("float32", "bfloat16", "float16")
CPU_MATMULS = ("auto", "xla", "onednn", "kernel")
LAYER_LOOPS = ("auto", "scan", "unrolled")
QUANT_MODES = ("int8",)


def _opt(default, help: str, **kw):
    return dataclasses.field(default=default, metadata={"help": help, **kw})


@dataclasses.dataclass(frozen=True, slots=True)
class ComputeOptions:
    dtype: Literal["float32", "bfloat16", "float16"] = _opt(
        "float32", "compute and KV dtype (bf16 on TPU; f32 is faster on CPU without AVX512-BF16)"
    )
    quantization: Literal["int8"] | None = _opt(
        None, "weight-only int8: projections, LM head and embedding held as int8 with a f32 scale per output "
        "column (per token row for the embedding), quantized at load and at every weight update; compute stays "
        "in dtype (a GGUF's Q8_0 blocks are requantized per column)"
    )
    attention_backend: str = _opt(
        "auto", "attention: auto (CPU cpu_kernel where g++ builds it, else native; GPU bucketed; TPU pallas) or one "
        "by name ('none': benchmarks only)", choices=ATTENTION_BACKENDS,
    )
    attention_interpret: bool = _opt(False, "run Pallas attention kernels in their interpreter (CPU tests)")
    cpu_matmul: Literal["auto", "xla", "onednn", "kernel"] = _opt(
        "auto", "projections and LM head on CPU: XLA's dot, oneDNN's matmul (pip install 'ringserve[onednn]'; "
        "bf16/f16 on AVX512-BF16/AMX), or kernel: ringserve's own for decode's few rows (g++, built on first use), "
        "larger steps on oneDNN for bf16/int8 where installed, else XLA; auto: the best of these that runs here "
        "(tp_size 1)"
    )
    layer_loop: Literal["auto", "scan", "unrolled"] = _opt(
        "auto", "decoder layers: one scan over stacked weights, or unrolled over per-layer weights (auto: unrolled "
        "on CPU with XLA's dot alone)"
    )
    layer_unroll: int = _opt(1, "decoder layers per iteration of the layer scan")
    attn_chunk_tokens: int = _opt(64, "keys per work item of the native (CPU) attention")
    context_bucket_min: int = _opt(
        512, "smallest context length compiled by static-loop attention (bucketed, pallas_gpu); then x2"
    )
    extend_block: int = _opt(16, "query tile of prefill steps (attention works on tiles of this many tokens)")
    decode_bucket_step: int = _opt(
        8, "decode batch sizes compiled: powers of two up to 2x this, then every this many up to "
        "max_running_requests (SGLang's cuda graph sizes); 0: powers of two only (fewer programs, more padding)"
    )
    lora_gather: bool = _opt(False, "LoRA's per-row product in its gather form (punica's BGMV) instead of the dense one")
    enable_deterministic_inference: bool = _opt(
        False,
        "batch-invariant kernels: a request's greedy tokens and seeded samples (and logprobs) are bitwise the same "
        "whatever its batch neighbours, bucket, chunking, overlap, retracts or cached prefix (costs speed)",
    )

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: choose one of {list(DTYPES)}")
        if self.quantization is not None and self.quantization not in QUANT_MODES:
            raise ValueError(f"quantization={self.quantization!r}: choose None or one of {list(QUANT_MODES)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r}: choose one of {list(ATTENTION_BACKENDS)}")
        if self.cpu_matmul not in CPU_MATMULS:
            raise ValueError(f"cpu_matmul={self.cpu_matmul!r}: must be one of {list(CPU_MATMULS)}")
        if self.layer_loop not in LAYER_LOOPS:
            raise ValueError(f"layer_loop={self.layer_loop!r}: must be 'auto', 'scan' or 'unrolled'")
        for name in ("layer_unroll", "attn_chunk_tokens", "context_bucket_min", "extend_block"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.decode_bucket_step < 0:
            raise ValueError(f"decode_bucket_step={self.decode_bucket_step}: must be >= 0 (0: powers of two)")

    @property
    def deterministic(self) -> bool:
        return self.enable_deterministic_inference


def assemble(obj: Any, flat: dict[str, Any], where: str = "option") -> None:
    """Fill the frozen dataclass `obj` of sections (dataclass-typed fields with defaults) and plain
    fields from flat keyword options: each name goes to the section that has a field of that
    name, or to a field of `obj` itself; a section may also be given whole (and have names
    replaced in it: `dataclasses.replace(obj, page_size=8)` passes every section and the name).
    ValueError naming an unknown option (with close matches). How ServerArgs and ExecutorConfig
    take SGLang's flat names (keywords, CLI flags) while their sections travel whole."""
    import difflib

    cls: Any = type(obj)
    hints = _hints(cls)
    sections = {f.name: hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])}
    owner = {g.name: s for s, tp in sections.items() for g in dataclasses.fields(tp)}
    own = {f.name: f for f in dataclasses.fields(cls) if f.name not in sections}
    given: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {s: {} for s in sections}
    for k, v in flat.items():
        if k in sections and dataclasses.is_dataclass(v):
            given[k] = v
        elif k in owner:
            parts[owner[k]][k] = v
        elif k in own:
            given[k] = v
        else:
            close = difflib.get_close_matches(k, sorted(set(own) | set(owner)), n=3)
            raise ValueError(f"unknown {where} {k!r}" + (f"; did you mean {close}?" if close else ""))
    for s, tp in sections.items():
        base = given.get(s)
        value = tp(**parts[s]) if base is None else dataclasses.replace(base, **parts[s]) if parts[s] else base
        object.__setattr__(obj, s, value)
    for name, f in own.items():
        if name in given:
            value = given[name]
        elif f.default is not dataclasses.MISSING:
            value = f.default
        else:
            value = f.default_factory()  # type: ignore[misc,operator]
        object.__setattr__(obj, name, value)


def flat_fields(obj) -> dict:
    """{name: value} of every option of a sectioned dataclass, sections flattened (`assemble`'s inverse)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            out |= flat_fields(v)
        else:
            out[f.name] = v
    return out


@functools.cache
def _hints(cls: Any) -> dict[str, Any]:
    import typing

    return typing.get_type_hints(cls)

"""The jitted step: forward + sample over the paged KV cache, one program per shape bucket.

`ModelExecutor` owns the parameters (sharded over the `tp` mesh), the KV cache and the future
buffer on device. Every (block, NB) bucket is compiled ahead of time at start-up (with a
progress bar); `run` only ever calls those compiled executables, so nothing can recompile
while serving (`trace_count` counts traces and tests pin it).

The KV cache and the future buffer are donated to every step and replaced by its outputs, so
the update is in place. Future buffer: `future[slot]` holds the last token sampled for the
request in `slot` (entry `max_slots` is the sink for padding rows); an input id `-(slot + 1)`
reads it on device, which is what lets the scheduler run one batch ahead (overlap).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from model.attention import resolve_backend
from model.checkpoints.weights import load_checkpoint
from model.llama import CausalLM, hf_to_ours
from model.mesh import kv_sharding, make_mesh, param_spec, replicated
from model.sampler import SampleOut, sample
from model.step_inputs import Buckets, DeviceRow, ForwardBatch, HostBatch, SamplingBatch, build_batch

log = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True, slots=True)
class ExecutorConfig:
    page_size: int = 16
    num_pages: int = 2048  # including the sink page 0
    max_context_len: int = 4096
    max_batch: int = 64  # largest decode bucket (= max running requests)
    max_extend_tokens: int = 1024  # largest extend bucket, in padded tokens
    extend_block: int = 16  # query block of extend steps
    attn_chunk_tokens: int = 256  # keys read per attention loop iteration
    dtype: str = "float32"
    tp_size: int = 1
    top_logprobs_num: int = 0  # N of the top-N logprobs every step returns (0 = off)
    attention_backend: str = "auto"
    precompile: bool = True  # compile every bucket at start-up

    @property
    def max_pages(self) -> int:
        """Page-table width: pages of the longest context, rounded up to whole attention chunks."""
        chunk_pages = self.chunk_pages
        pages = -(-self.max_context_len // self.page_size)
        return -(-pages // chunk_pages) * chunk_pages

    @property
    def chunk_pages(self) -> int:
        return max(1, self.attn_chunk_tokens // self.page_size)

    @property
    def num_token_locations(self) -> int:
        """KV token locations on device (page 0 included)."""
        return self.num_pages * self.page_size


def enable_compilation_cache(path: str | Path | None = None) -> Path:
    """Persist XLA executables on disk (process-wide), keyed by XLA on program and backend:
    the second start-up with the same shapes loads its buckets instead of compiling them."""
    from model.checkpoints.paths import cache_dir

    p = Path(path) if path is not None else cache_dir("xla")
    p.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(p))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return p


class ModelExecutor:
    def __init__(self, model_path: str | Path, cfg: ExecutorConfig = ExecutorConfig()):
        if cfg.dtype not in DTYPES:
            raise ValueError(f"dtype={cfg.dtype!r}: choose one of {sorted(DTYPES)}")
        self.cfg = cfg
        self.mesh = make_mesh(cfg.tp_size)
        self.backend = resolve_backend(cfg.attention_backend, jax.devices()[0].platform)
        self.model_config, tensors = load_checkpoint(model_path)
        mc = self.model_config
        if cfg.max_context_len > mc.max_position_embeddings:
            log.warning(
                "max_context_len %d > model's max_position_embeddings %d",
                cfg.max_context_len,
                mc.max_position_embeddings,
            )
        self.buckets = Buckets.make(cfg.max_batch, cfg.max_extend_tokens, cfg.extend_block)
        self.max_slots = cfg.max_batch  # future buffer entries (one per request slot) + sink
        self.host_tensors = tensors  # HF-named, as served (weight updates replace them whole)
        self.graphdef, self.params = self._build(tensors)
        self.new_kv()
        self.params_avals = jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.params
        )  # what every compiled program takes (weight updates must match it)
        self.trace_count = 0
        self._jitted = jax.jit(self._step, donate_argnums=(1, 2))
        self._programs: dict[tuple[int, int], object] = {}
        self._logits_fn: Callable | None = None
        if cfg.precompile:
            self.compile_all()

    # ---- set-up -------------------------------------------------------------------------------
    def _build(self, tensors: dict[str, np.ndarray]):
        """(graphdef, params): the module tree from HF-named host arrays, each leaf placed on its
        `tp` sharding. Raises ValueError naming a missing or misshapen tensor."""
        from tqdm import tqdm

        w = hf_to_ours(self.model_config, tensors, DTYPES[self.cfg.dtype])
        graphdef, host_state = nnx.split(CausalLM(self.model_config, w))
        flat, treedef = jax.tree_util.tree_flatten_with_path(host_state)
        placed = []
        for path, leaf in tqdm(flat, desc="placing weights", unit="tensor", disable=len(flat) < 64):
            names = tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)
            spec = param_spec(names, np.shape(leaf), self.model_config, self.cfg.tp_size)
            placed.append(jax.device_put(leaf, NamedSharding(self.mesh, spec)))
        return graphdef, jax.tree_util.tree_unflatten(treedef, placed)

    def build_params(self, tensors: dict[str, np.ndarray]):
        """A new parameter tree beside the served one (same structure, avals and shardings)."""
        _, params = self._build(tensors)
        want = jax.tree_util.tree_map(lambda a: (a.shape, a.dtype, a.sharding), self.params_avals)
        got = jax.tree_util.tree_map(lambda a: (a.shape, a.dtype, a.sharding), params)
        same_tree = str(jax.tree_util.tree_structure(params)) == str(jax.tree_util.tree_structure(self.params_avals))
        if not same_tree or want != got:
            raise ValueError("the new weights do not fit the compiled programs (structure, shapes or shardings)")
        return params

    def swap_params(self, params, tensors: dict[str, np.ndarray]) -> None:
        old, self.params, self.host_tensors = self.params, params, tensors
        if old is not None:
            for leaf in jax.tree_util.tree_leaves(old):
                leaf.delete()

    def drop_params(self) -> None:
        """Free the weights on the device (release_memory_occupation); the host copy stays."""
        self.swap_params(None, self.host_tensors)

    def new_kv(self) -> None:
        """A zeroed KV cache and future buffer (start-up, resume_memory_occupation)."""
        mc, cfg = self.model_config, self.cfg
        kv_shape = (mc.num_kv_heads, cfg.num_token_locations, mc.head_dim)
        zeros = jax.jit(lambda: jnp.zeros(kv_shape, DTYPES[cfg.dtype]), out_shardings=kv_sharding(self.mesh, mc))
        self.kv: list[tuple[Any, Any]] | None = [(zeros(), zeros()) for _ in range(mc.num_layers)]
        self.future: Any = jax.device_put(jnp.zeros(self.max_slots + 1, jnp.int32), replicated(self.mesh))

    def drop_kv(self) -> None:
        """Free the KV cache and future buffer on the device (release_memory_occupation)."""
        for leaf in jax.tree_util.tree_leaves((self.kv, self.future)):
            leaf.delete()
        self.kv, self.future = None, None

    def _step(self, params, kv, future, batch: ForwardBatch, sp: SamplingBatch):
        self.trace_count += 1  # Python side effect: runs once per trace, never per call
        model = nnx.merge(self.graphdef, params)
        ids = jnp.where(batch.input_ids < 0, future[jnp.maximum(-batch.input_ids - 1, 0)], batch.input_ids)
        h, kv = model(ids, batch, kv, self.cfg.page_size, self.cfg.chunk_pages)
        logits = model.logits(h[batch.sample_idx])
        out = sample(logits, sp, self.cfg.top_logprobs_num)
        future = future.at[batch.sample_slot].set(out.tokens)
        return kv, future, out

    def compile_all(self) -> float:
        """AOT-compile every bucket (progress bar); returns seconds spent."""
        from tqdm import tqdm

        t0 = time.perf_counter()
        for key in tqdm(self.buckets.keys(), desc="compiling buckets", unit="bucket"):
            self._program(key)
        return time.perf_counter() - t0

    def _program(self, key: tuple[int, int]):
        prog = self._programs.get(key)
        if prog is None:
            blk, nb = key
            t = blk * nb
            rep = replicated(self.mesh)

            def spec(shape, dtype):
                return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

            fwd = ForwardBatch(
                spec((t,), jnp.int32), spec((t,), jnp.int32), spec((t,), jnp.int32),
                spec((nb, self.cfg.max_pages), jnp.int32), spec((nb,), jnp.int32),
                spec((nb,), jnp.int32), spec((nb,), jnp.int32),
            )  # fmt: skip
            smp = SamplingBatch(
                spec((nb,), jnp.float32), spec((nb,), jnp.int32), spec((nb,), jnp.float32),
                spec((nb,), jnp.float32), spec((nb,), jnp.uint32), spec((nb,), jnp.int32),
                spec((), jnp.bool_), spec((), jnp.bool_),
            )  # fmt: skip
            prog = self._jitted.lower(self.params_avals, self.kv, self.future, fwd, smp).compile()
            self._programs[key] = prog
        return prog

    # ---- serving ------------------------------------------------------------------------------
    def run(self, rows: list[DeviceRow]) -> tuple[SampleOut, list[int]]:
        """One step over `rows`; returns the (device) sample output and each row's sample index."""
        hb = build_batch(rows, self.buckets, self.cfg.page_size, self.cfg.max_pages, self.max_slots)
        return self.run_host_batch(hb), hb.rows

    def run_host_batch(self, hb: HostBatch) -> SampleOut:
        if hb.key not in self._programs and self.cfg.precompile:
            raise RuntimeError(f"bucket {hb.key} was not compiled at start-up")
        prog = self._program(hb.key)
        rep = replicated(self.mesh)
        fwd = jax.device_put(hb.forward, rep)
        smp = jax.device_put(hb.sampling, rep)
        self.kv, self.future, out = prog(self.params, self.kv, self.future, fwd, smp)
        return out

    def logits(self, rows: list[DeviceRow]) -> tuple[np.ndarray, list[int]]:
        """Full-vocabulary f32 logits of each segment's last token (writes KV like `run`).

        A diagnostic path for parity tests and tools: it is jitted on demand, never used while
        serving, and does not count in `trace_count`."""
        hb = build_batch(rows, self.buckets, self.cfg.page_size, self.cfg.max_pages, self.max_slots)
        if self._logits_fn is None:

            def fwd(params, kv, batch):
                model = nnx.merge(self.graphdef, params)
                h, kv = model(batch.input_ids, batch, kv, self.cfg.page_size, self.cfg.chunk_pages)
                return kv, model.logits(h[batch.sample_idx])

            self._logits_fn = jax.jit(fwd, donate_argnums=(1,))
        self.kv, logits = self._logits_fn(
            self.params, self.kv, jax.device_put(hb.forward, replicated(self.mesh))
        )
        return np.asarray(logits)[hb.rows], hb.rows

    @property
    def num_programs(self) -> int:
        return len(self._programs)

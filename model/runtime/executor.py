"""`ModelExecutor`: the facade the runner calls. It owns the model's state (the Decoder module's
`nnx.Param`s, model/weights/state.py, each on its `tp` sharding, and on CPU the custom calls' packed
copies of it, model/weights/memory.py), the KV cache and the FutureMap on device
(model/runtime/kv_pool.py), and the compiled step programs (model/runtime/programs.py) of the traced step
(model/runtime/step.py), which take the state as their first argument, the step's inputs
(model/compute/step_inputs.py) and the ones kept on device for steps that need none of their own
(model/runtime/step_constants.py).

    ex = ModelExecutor(path, ExecutorConfig(...))     resolve the compute plan, load, place, compile
    ex.plan, ex.family                                how it computes (model/compute/plan.py), what it serves
    out, rows, accepted = ex.run(device_rows)         one step (model/compute/step_inputs.py DeviceRows)
    so = ex.run_step(device_rows)                     the same, with the prompt positions' logprobs
    ex.build_params / swap_params / drop_params       weights while serving (model/runtime/weight_sync.py;
    ex.build_params_on_device                         from JAX arrays: model/weights/device_state.py)
    ex.kv_pool.new / drop                             device memory (release / resume)
    ex.lora                                           the LoRA adapter pool (model/weights/lora.py), or None

Nothing recompiles while serving: `run` only calls programs compiled at start-up (or in the
background, `background_compile`: until they all are, a step runs padded in the smallest
compiled program that holds it, or waits for one; tiny model, 2 CPU cores: serving 13 s after
start instead of ~50 s). `trace_count` counts traces (a program read back from the program cache,
model/runtime/program_cache.py, counts as the trace it replaces) and tests pin it. The KV cache and the
FutureMap are donated to every step and replaced by its outputs, so their update is in place.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from ringserve.kvmem.allocator import cdiv
from ringserve.model.checkpoints.load import load_checkpoint, release_pages
from ringserve.model.compute.attention.base import AttentionBackend, AttnGeometry
from ringserve.model.compute.mesh import make_mesh, replicated
from ringserve.model.compute.options import ComputeOptions, assemble
from ringserve.model.compute.plan import ComputePlan, custom_calls
from ringserve.model.compute.step_inputs import (
    Buckets,
    DeviceRow,
    HostBatch,
    NoProgramYet,
    ProgramShapes,
    StepShape,
    build_batch,
)
from ringserve.model.config import ModelConfig
from ringserve.model.families import family
from ringserve.model.layers.decoder import CausalLM
from ringserve.model.layers.lora import LoraBatch
from ringserve.model.runtime.kv_pool import KVPool
from ringserve.model.runtime.program_cache import ProgramCache
from ringserve.model.runtime.program_cache import usable as program_cache_usable
from ringserve.model.runtime.programs import Key, ProgramSet, compile_order, step_avals
from ringserve.model.runtime.sampler import PROMPT_BIT, PositionLogprobs, SampleOut
from ringserve.model.runtime.step import make_logits, make_step
from ringserve.model.runtime.step_constants import StepConstants
from ringserve.model.runtime.vocab import VocabSplit
from ringserve.model.weights import memory as weight_memory
from ringserve.model.weights.lora import LoraPool
from ringserve.model.weights.state import build_host_state, build_lazy_state, checked_layout

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True, slots=True, init=False)
class ExecutorConfig:
    """The executor's options, in sections that travel whole: how the model computes (the
    server's compute section, unchanged), what the programs hold (derived once from the server's
    options, ServerArgs.program_shapes), and the runner's own. Made from sections and/or flat
    names (`ExecutorConfig(dtype="bfloat16", page_size=16)`: tests, tools)."""

    compute: ComputeOptions = ComputeOptions()
    shapes: ProgramShapes = ProgramShapes()
    tp_size: int = 1
    ep_size: int = 1  # mixture-of-experts: the experts split over the tp devices (1 or tp_size)
    precompile: bool = True  # compile every bucket at start-up
    background_compile: bool = False  # serve once a covering set is compiled; the rest on a thread
    lora_slots: int = 0  # LoRA adapter pool slots incl. the empty slot 0 (max_loras_per_batch + 1); 0 = off
    lora_rank: int = 0  # max_lora_rank: every slot's rank (adapters of lower rank are zero-padded)
    lora_targets: tuple[str, ...] = ()  # the projections adapters may train (model/checkpoints/peft.py)
    program_cache: bool = False  # keep the traced programs on disk (model/runtime/program_cache.py; CPU, one device)

    def __init__(self, **options: Any) -> None:
        assemble(self, options, "executor option")


class StepOut(NamedTuple):
    """One step's device outputs (`ModelExecutor.run_step`); JAX dispatch is asynchronous, so
    reading them waits for the step."""

    out: SampleOut  # the samples: the first `num_samples`, row after row
    accepted: jax.Array  # [R] int32 drafts each row accepted (0 for a plain row)
    prompt: PositionLogprobs  # logprobs at the wanted prompt positions: the first `num_positions`
    num_samples: int
    num_positions: int
    hidden: jax.Array | None = None  # [T, H] f32 the step's tokens' last hidden states (return_hidden_states)
    routed: jax.Array | None = None  # [T, M, k] int32 the step's tokens' routed experts (return_routed_experts)


class ModelExecutor:
    def __init__(self, model_path: str | Path, cfg: ExecutorConfig = ExecutorConfig()):
        self.cfg = cfg
        shapes = cfg.shapes
        self.mesh = make_mesh(cfg.tp_size)
        # how this platform computes, decided once (model/compute/plan.py): on CPU its kernels start
        # building side by side as it resolves, while the checkpoint below is memory-mapped
        self.plan = ComputePlan.resolve(cfg.compute, jax.devices()[0].platform, cfg.tp_size, self.mesh.size,
                                        rope_positions=shapes.max_pages * shapes.page_size, ep=cfg.ep_size)  # fmt: skip
        plan = self.plan
        self.model_config, tensors = load_checkpoint(model_path)
        mc = self.model_config
        self.family = family(mc.family)
        if shapes.max_context_len > mc.max_position_embeddings:
            log.warning("max_context_len %d > model's max_position_embeddings %d",
                        shapes.max_context_len, mc.max_position_embeddings)  # fmt: skip
        self._build_model(mc)
        opts = cfg.compute
        self.buckets = Buckets.make(shapes.max_batch, shapes.max_extend_tokens, opts.extend_block, opts.decode_bucket_step)
        self.constants = StepConstants(replicated(self.mesh), self.mask_words, shapes.token_ids_logprob_num, self.buckets)
        self.max_slots = shapes.max_batch  # FutureMap entries (one per request slot) + sink
        self.host_tensors = tensors  # HF-named, as served (weight updates replace them whole)
        checked_layout(self.family, mc, tensors)  # a missing or misshapen tensor is refused before anything runs
        # what every compiled program takes first (the Decoder's state, model/weights/state.py; updates
        # must match it) and the KV cache's arrays: the programs compile against these
        self.params_avals = self.model.state_avals(self.mesh)
        self._device_builder: Any = None  # build_params_on_device's jitted walk, made at its first use
        if plan.packs_weights:
            weight_memory.reserve_pairs(self.params_avals)
        self.kv_avals = self._kv_avals()
        self._serving = threading.Event()  # set once the lead programs, weights and KV pool are ready
        self.kv_pool = KVPool(self.kv_avals, self._serving)
        self._settled = threading.Event()  # set once no more programs will compile (all, or failed)
        # Building the weights (host copies from the memory-mapped checkpoint, then the device's:
        # SmolLM2 f32 0.5-2.5 s on CPU), then the KV pool (kv_pool.new) run on a thread while the
        # lead programs are traced, lowered and loaded here, which need only the avals above.
        # One after the other: the host copy and the checkpoint's pages are gone before the
        # pool's pages come (at once, f32 peak RSS would be ~1 GB higher).
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ringserve-load")
        building = pool.submit(self._build, tensors)
        zeroing = pool.submit(self.kv_pool.new)
        pool.shutdown(wait=False)  # its thread ends with the tasks
        self.lora: LoraPool | None = None  # adapters: a pool of fixed shapes every program takes
        if cfg.lora_slots:
            self.lora = LoraPool(self.family, mc, cfg.lora_slots, cfg.lora_rank, cfg.lora_targets,
                                 plan.layer_loop == "scan", plan.jnp_dtype, replicated(self.mesh))  # fmt: skip
            self.lora_avals = _avals(self.lora.weights)
        self.trace_count = 0
        # extend programs sample their producing rows (few: a prefill's) in groups, in a device
        # loop; prompt positions' logprobs likewise (the plan's groups)
        step = self._step_fn()

        def traced(*args):
            self.trace_count += 1  # Python side effect: runs once per trace, never per call
            return step(*args)

        self._traced = traced
        self._jitted = jax.jit(traced, donate_argnums=(1, 2), static_argnums=(7, 8, 9))
        self._on_disk: ProgramCache | None = None
        self._not_on_disk: set[StepShape] = set()  # programs `_compile_best` found not kept
        if cfg.program_cache and plan.program_cache(self.mesh.size) and program_cache_usable():
            self._on_disk = ProgramCache({"executor": dataclasses.asdict(cfg), "model": repr(mc), "plan": repr(plan)})
            plan.load_kernels()  # (before a program is read back)
        self._logits_fn = jax.jit(make_logits(self.model), donate_argnums=(1,))
        counts_aval = self.kv_avals[1][2]
        rep = replicated(self.mesh)
        self._set_counts = jax.jit(_set_row, donate_argnums=(0,), out_shardings=counts_aval.sharding).lower(
            counts_aval, jax.ShapeDtypeStruct((), np.int32, sharding=rep),
            jax.ShapeDtypeStruct(counts_aval.shape[1:], np.int32, sharding=rep)).compile()  # fmt: skip
        contexts = self.attn.context_buckets()
        order, lead = compile_order(self.buckets, contexts, shapes.verify_tokens, shapes.top_logprobs_num,
                                    plan.lead_small_programs, shapes.decode_steps, shapes.decode_steps_rows)  # fmt: skip
        self.programs = ProgramSet(self._compile, order, lead, contexts)
        log.info("%d step programs: %d shapes x %d context bucket(s) (attention %s)", len(order),
                 len(order) // len(contexts), len(contexts), plan.attention)  # fmt: skip

        def loaded() -> None:  # the weights and the KV pool, before any other program compiles
            self.params = building.result()
            if not self._fits(self.params):
                raise RuntimeError("the built state does not match its avals (model/layers/decoder.py: state_avals)")
            self._packed = [weight_memory.register(self.params, plan.dot)]  # the packed copies' owner
            weakref.finalize(self, weight_memory.release, self._packed)
            zeroing.result()
            self._serving.set()

        if cfg.precompile:
            self.programs.compile_all(background=cfg.background_compile and jax.process_count() == 1, then=loaded,
                                      done=self._settled.set)  # fmt: skip
        else:
            loaded()
            self._settled.set()

    # ---- weights ------------------------------------------------------------------------------

    def _build_model(self, mc: ModelConfig) -> None:
        """The attention backend, the model and the logits' vocabulary split of `mc` as the plan
        says: the server's and `ringserve compile`'s alike (model/runtime/aot.py). ValueError
        where the shapes give a local page space to a model that does not mix sliding and
        global layers (AttnGeometry)."""
        shapes, plan = self.cfg.shapes, self.plan
        geo = AttnGeometry(
            num_layers=mc.num_layers, num_pages=shapes.num_pages, page_size=shapes.page_size,
            num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
            max_pages=shapes.max_pages, dtype=plan.jnp_dtype, windows=mc.layer_windows,
            softcap=mc.attn_logit_softcap,
            query_scale=None if mc.query_pre_attn_scalar is None else mc.query_pre_attn_scalar**-0.5,
            deterministic=plan.deterministic, local_pages=shapes.local_pages,
        )  # fmt: skip
        self.attn: AttentionBackend = plan.make_backend(geo, self.mesh)
        if shapes.decode_steps > 1 and self.attn.plan_avals(Buckets.multistep_shape(2, shapes.decode_steps)):
            raise ValueError(f"decode_steps={shapes.decode_steps}: multi-step decode runs its steps' attention without "
                             f"a host plan, which the {plan.attention} backend needs (cpu_kernel has none)")  # fmt: skip
        self.model: CausalLM = self.family.causal_lm(mc, plan, self.attn)
        # the logits and the penalties' token counts split by vocabulary over `tp` (None: whole)
        self.vocab = VocabSplit.of(self.mesh, mc.vocab_size)
        if shapes.routed_experts and not self.model.routed_shape[0]:
            raise ValueError(f"enable_return_routed_experts: {mc.family} has no mixture-of-experts layers to report "
                             "(routing replay is for MoE models)")  # fmt: skip

    def _step_fn(self) -> Any:
        """The step function every program traces (model/runtime/step.py), as the plan and the
        shapes say: the server's and `ringserve compile`'s alike."""
        plan, shapes = self.plan, self.cfg.shapes
        return make_step(self.model, plan.sample_group, plan.fixed_rows, plan.position_group, shapes.processed_logprobs,
                         shapes.hidden_states, shapes.routed_experts, self.vocab)  # fmt: skip

    def _build(self, tensors: dict[str, np.ndarray]) -> Any:
        """The Decoder's state from HF-named host arrays (model/weights/state.py; per-layer weights when
        the layers run unrolled), each Param on its `tp` sharding. Raises ValueError naming a
        missing or misshapen tensor. Many hosts: each reads only its own devices' shards of the
        (memory-mapped) tensors (build_lazy_state), never the whole model into host memory."""
        build = build_lazy_state if jax.process_count() > 1 else build_host_state
        plan = self.plan
        host = build(self.family, self.model_config, tensors, plan.jnp_dtype, plan.layer_loop == "scan", plan.quant)
        params = jax.block_until_ready(self.model.place(host, self.mesh))
        release_pages(tensors)  # the checkpoint's pages, read once, leave this process's RSS
        if plan.host_buffers:  # the device buffers are these host arrays (no copy)
            me = weakref.ref(self)  # an executor that failed to start is not kept waiting for

            def after() -> bool | None:  # serving, the KV pool's pages in; None: the executor is gone
                ex = me()
                if ex is None:
                    return None
                return ex._settled.is_set() and ex.kv_pool.settled()

            threading.Thread(target=weight_memory.huge_pages_when, args=(host, after), name="ringserve-huge-pages",
                             daemon=True).start()  # fmt: skip
        return params

    def build_params(self, tensors: dict[str, np.ndarray]) -> Any:
        """A new state beside the served one (same structure, avals and shardings)."""
        params = self._build(tensors)
        if not self._fits(params):
            raise ValueError("the new weights do not fit the compiled programs (structure, shapes or shardings)")
        return params

    def build_params_on_device(self, tensors: dict[str, Any]) -> Any:
        """`build_params` from HF-named JAX arrays on any of this process's devices (and host
        arrays: the served ones a partial update keeps), built on the device straight onto the
        served shardings (model/weights/device_state.py); the jitted walk is made once."""
        if self._device_builder is None:
            from ringserve.model.weights.device_state import DeviceStateBuilder

            self._device_builder = DeviceStateBuilder(self.family, self.model_config, self.plan.jnp_dtype,
                                                      self.plan.layer_loop == "scan", self.plan.quant, self.params_avals)  # fmt: skip
        params = jax.block_until_ready(self._device_builder(tensors))
        if not self._fits(params):
            self.discard_params(params)
            raise ValueError("the new weights do not fit the compiled programs (structure, shapes or shardings)")
        return params

    def _fits(self, params: Any) -> bool:
        """Whether `params` has the structure, shapes, dtypes and shardings the programs take."""
        return _avals(params) == self.params_avals

    def swap_params(self, params: Any, tensors: dict[str, np.ndarray]) -> None:
        old, self.params, self.host_tensors = self.params, params, tensors
        weight_memory.release(self._packed)  # before the old buffers are freed (their addresses get reused)
        if old is not None:
            for leaf in jax.tree_util.tree_leaves(old):
                leaf.delete()
        self._packed[0] = weight_memory.register(params, self.plan.dot)

    def close(self) -> None:
        """Stop the background compile and free the weights, the KV pool and the slots' state on
        the device: an executor in a process that goes on after it (runner_in_process)."""
        self.programs.stop()
        if self.kv_pool.kv is not None:
            self.kv_pool.drop()
        if getattr(self, "params", None) is not None:
            self.drop_params()

    def discard_params(self, params: Any) -> None:
        """Free a state built by `build_params` that will not be served (an update refused)."""
        for leaf in jax.tree_util.tree_leaves(params):
            leaf.delete()

    def drop_params(self) -> None:
        """Free the weights on the device; the host copy stays."""
        self.swap_params(None, self.host_tensors)

    # ---- device memory (the KV cache and FutureMap live in self.kv_pool, model/runtime/kv_pool.py) ------
    def _kv_avals(self) -> Any:
        """The KV cache's arrays and the slots' state (the FutureMap's tokens and positions, the
        penalties' token counts: model/runtime/sampler.py), abstract (shape, dtype, sharding):
        what the programs compile against and the pool makes."""
        kv = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(self.mesh, s))
                   for a, s in zip(self.attn.kv_avals(), self.attn.kv_specs(self.cfg.tp_size), strict=True))  # fmt: skip
        rep = replicated(self.mesh)
        future = jax.ShapeDtypeStruct((self.max_slots + 1,), np.int32, sharding=rep)
        by_token = rep if self.vocab is None else self.vocab.sharding(2)  # split as the logits are
        counts = jax.ShapeDtypeStruct((self.max_slots + 1, self.model_config.vocab_size), np.int32, sharding=by_token)
        return kv, (future, future, counts)

    # ---- programs -----------------------------------------------------------------------------
    def _program_args(self, shape: StepShape) -> tuple[Any, ...]:
        """The abstract arguments the program of `shape` compiles against."""
        fwd, smp, lb, row_slot = step_avals(shape, self.attn.plan_avals(shape), self.cfg.shapes.max_pages,
                                            replicated(self.mesh), self.mask_words, self.cfg.shapes.token_ids_logprob_num,
                                            self.buckets.positions(shape), self.attn.geo.local_pages > 0)  # fmt: skip
        kv, future = self.kv_avals
        lora = LoraBatch(row_slot, self.lora_avals) if self.lora is not None else None
        return (self.params_avals, kv, future, fwd, smp, lb, lora)

    def _compile_best(self, smallest: StepShape, need: int, loaded_only: bool) -> bool:
        """Compile the program of `smallest` (the shape that best holds a waiting step, with the
        shortest context bucket >= `need`) here and now, ahead of the background compile's order;
        with `loaded_only`, only where it is kept on disk (a load, not a compile). True if it did."""
        top_n = self.cfg.shapes.top_logprobs_num
        ctx = self.programs.smallest_context(smallest, top_n, need, compiled=False)
        if ctx is None:
            return False
        shape = smallest._replace(context=ctx)
        if loaded_only:
            if self._on_disk is None or shape in self._not_on_disk:
                return False
            if not self._on_disk.has(self._program_args(shape), _statics(shape, top_n)):
                self._not_on_disk.add(shape)  # (asked again each padded step until compiled)
                return False
        return self.programs.compile_now((shape, top_n))

    def _compile(self, key: Key) -> Any:
        shape, top_n = key
        args = self._program_args(shape)
        if self._on_disk is not None:
            hits = self._on_disk.hits
            try:
                prog = self._on_disk.compile(self._traced, args, _statics(shape, top_n), self._out_tree(),
                                             donate_argnums=(1, 2), custom_calls=custom_calls())  # fmt: skip
            except Exception as e:  # (a jax whose export differs): traced as ever
                log.warning("program %s: not through the program cache (%s: %s)", key, type(e).__name__, e)
            else:
                self.trace_count += self._on_disk.hits - hits  # read back: counted as the trace it replaces
                return prog
        return self._jitted.lower(*args, *_statics(shape, top_n)).compile()

    def _out_tree(self) -> Any:
        """The structure every step program returns (model/runtime/step.py): kv, the slots' state,
        the samples, the accepted drafts, the prompt positions' logprobs, the hidden states, the
        routed experts."""
        kv, future = self.kv_avals
        return jax.tree.structure((kv, future, SampleOut(*range(6)), 0, PositionLogprobs(*range(4)), 0, 0))

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until the background compile is over; True once every program is compiled."""
        return self.programs.wait(timeout)

    def compile_status(self) -> dict[str, Any]:
        return self.programs.status()

    @property
    def mask_words(self) -> int:
        """int32 words of one grammar mask: ceil(V / 32) (model/runtime/sampler.py)."""
        return cdiv(self.model_config.vocab_size, 32)

    @property
    def num_programs(self) -> int:
        """Programs compiled so far."""
        return len(self.programs.compiled)

    @property
    def num_programs_total(self) -> int:
        """Programs there are to compile (num_programs reaches it once start-up compiling ends)."""
        return len(self.programs.order)

    # ---- serving ------------------------------------------------------------------------------
    def prepare(self, rows: list[DeviceRow], verify: int = 0, multistep: bool = False) -> HostBatch:
        """The host side of a step: padded inputs, the program's shape, the backend's plan
        (`multistep`: `verify` decode steps in one program, model/runtime/step.py)."""
        top_n, need = self.cfg.shapes.top_logprobs_num, 0
        ok: Callable[[StepShape], bool] | None = None
        if self.programs.pending:  # still compiling: the smallest compiled program that holds the step
            try:
                need = self.attn.context_for(max(r.committed_len + r.extend_len for r in rows))
            except ValueError:  # empty, or too long: build_batch says which
                pass
            else:

                def ok(s: StepShape) -> bool:
                    return self.programs.smallest_context(s, top_n, need) is not None

        while True:
            seen = len(self.programs.compiled)  # (a program compiled after this is one more to try)
            try:
                hb = build_batch(rows, self.buckets, self.cfg.shapes.page_size, self.cfg.shapes.max_pages, self.max_slots, verify, ok,
                                 self.cfg.shapes.token_ids_logprob_num, multistep, self.attn.geo.local_pages > 0)  # fmt: skip
            except NoProgramYet as e:  # (CPU: a prefill longer than the smallest program's) compiled here, now
                if self._compile_best(e.smallest, need, loaded_only=False) or self.programs.wait_for_more(seen):
                    continue
                raise
            # padded in a larger program while the smallest one is kept on disk: loaded here, now
            # (SmolLM2 f32, a 30-token prompt in the 3072-token program: 3.9 s; loading its own 0.15)
            if hb.smallest != hb.shape and self._compile_best(hb.smallest, need, loaded_only=True):
                continue
            break
        ctx = self.attn.context_for(hb.max_kv_len) if ok is None else self.programs.smallest_context(hb.shape, top_n, need)
        assert ctx is not None  # `ok` accepted this shape for that reason
        hb.shape = hb.shape._replace(context=ctx)
        hb.forward = hb.forward._replace(attn=self.attn.plan(hb.forward, hb.shape))
        return hb

    def run(self, rows: list[DeviceRow], verify: int = 0) -> tuple[SampleOut, list[int], jax.Array]:
        """One step over `rows` (with `verify` = k + 1: verify rounds of that many tokens at the
        scheduler's bounds). Returns the (device) sample output, where each row's samples sit
        in it (row after row: k1 = max(1, verify) each) and the drafts each row accepted."""
        so = self.run_step(rows, verify)
        return so.out, list(range(so.num_samples)), so.accepted

    def run_step(self, rows: list[DeviceRow], verify: int = 0, multistep: bool = False) -> StepOut:
        """`run`, with the logprobs at the rows' wanted prompt positions (`StepOut`); with
        `multistep`, `verify` decode steps in one program (each row yields that many tokens)."""
        hb = self.prepare(rows, verify, multistep)
        out, accepted, prompt, hidden, routed = self.run_host_batch(hb)
        return StepOut(out, accepted, prompt, hb.num_samples, hb.num_positions, hidden, routed)

    def run_host_batch(self, hb: HostBatch) -> tuple[SampleOut, jax.Array, PositionLogprobs, jax.Array, jax.Array]:
        key = (hb.shape, self.cfg.shapes.top_logprobs_num)
        if key not in self.programs.compiled and self.cfg.precompile:
            raise RuntimeError(f"program {key} was not compiled at start-up")
        prog = self.programs.get(key)
        # The host arrays go to the compiled program as they are: it moves them to its input
        # shardings in one batched transfer (CPU, 17 arrays: 0.2 ms, against 1.5 ms for a
        # jax.device_put of the same tree first).
        lora = None
        if self.lora is not None:
            if self.lora.weights is None:
                raise RuntimeError("the LoRA adapter pool is released (resume_memory_occupation first)")
            lora = LoraBatch(hb.lora_slot, self.lora.weights)
        elif hb.lora_slot is not None and hb.lora_slot.any():
            raise ValueError("a row names a LoRA adapter slot, but this executor serves no adapters")
        kvp = self.kv_pool
        kvp.kv, kvp.future, out, accepted, prompt, hidden, routed = prog(self.params, kvp.kv, kvp.future, hb.forward,
                                                                   self.constants.sampling(hb), self.constants.logprob(hb),
                                                                   lora)  # fmt: skip
        self.kv_pool.stepped(out.tokens)  # (its first step lets the pool's pages in)
        return out, accepted, prompt, hidden, routed

    def start_counts(self, slot: int, origin: np.ndarray, output: np.ndarray) -> None:
        """Set `slot`'s token counts (the penalties', model/runtime/sampler.py) to a request's
        prompt `origin` and its output so far; the steps count its tokens from there. One
        compiled program (the row is built here, on the host: [V] int32), run in order with the
        steps (the counts are donated through both)."""
        row = np.zeros(self.model_config.vocab_size, np.int32)
        row[origin] = PROMPT_BIT
        row += np.bincount(output, minlength=len(row)).astype(np.int32)
        kvp = self.kv_pool
        tok, pos, counts = kvp.future
        kvp.future = (tok, pos, self._set_counts(counts, np.int32(slot), row))

    def logits(self, rows: list[DeviceRow]) -> tuple[np.ndarray, list[int]]:
        """Full-vocabulary f32 logits of each row's last token (writes KV like `run`).

        A diagnostic path for parity tests and tools: jitted on demand, never used while
        serving, and not counted in `trace_count`."""
        hb = self.prepare(rows)
        kvp = self.kv_pool
        kvp.kv, logits = self._logits_fn(self.params, kvp.kv, jax.device_put(hb.forward, replicated(self.mesh)))
        return np.asarray(logits)[: hb.num_samples], list(range(hb.num_samples))


def _set_row(a: jax.Array, i: jax.Array, row: jax.Array) -> jax.Array:
    """a with row i replaced by `row`."""
    return jax.lax.dynamic_update_slice(a, row[None], (i, jnp.int32(0)))


def _statics(shape: StepShape, top_n: int) -> tuple[int, int, bool]:
    """The step function's static arguments for a program of `shape` (model/runtime/step.py)."""
    return top_n, shape.verify, shape.multistep


def _avals(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)

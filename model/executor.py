"""`ModelExecutor`: the facade the runner calls. It owns the model's state (the Decoder module's
`nnx.Param`s, model/params.py, each on its `tp` sharding), the KV cache (its attention backend's
arrays) and the FutureMap on device, and the compiled step programs (model/programs.py) of the
traced step (model/step.py), which take the state as their first argument.

    ex = ModelExecutor(path, ExecutorConfig(...))     load, place, compile (progress bar)
    out, rows, accepted = ex.run(device_rows)         one step (model/step_inputs.py DeviceRows)
    so = ex.run_step(device_rows)                     the same, with the prompt positions' logprobs
    ex.build_params / swap_params / drop_params       weights while serving (model/weight_sync.py)
    ex.new_kv / drop_kv                               device memory (release / resume)
    ex.lora                                           the LoRA adapter pool (model/lora.py), or None

Nothing recompiles while serving: `run` only calls programs compiled at start-up (or in the
background, `background_compile`: until they all are, a step runs padded in the smallest
compiled program that holds it, or waits for one; tiny model, 2 CPU cores: serving 13 s after
start instead of ~50 s). `trace_count` counts traces (a program read back from the program cache,
model/program_cache.py, counts as the trace it replaces) and tests pin it. The KV cache and the FutureMap are donated
to every step and replaced by its outputs, so their update is in place.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from kvmem.allocator import cdiv
from model.attention import AttentionBackend, AttnGeometry, make_backend, resolve_backend
from model.checkpoints.weights import load_checkpoint, release_pages
from model.compute_paths import custom_calls, load_kernels, prebuild_kernels, resolve_dot, resolve_layer_loop
from model.kernels import cpu_memory
from model.layers import INVARIANT_ROWS
from model.llama import CausalLM
from model.lora import LoraBatch, LoraPool
from model.mesh import make_mesh, place_host_array, replicated
from model.params import QUANT_MODES, build_host_state, build_lazy_state, checked_layout, huge_pages
from model.program_cache import ProgramCache, usable
from model.programs import Key, ProgramSet, compile_order, step_avals
from model.sampler import PositionLogprobs, SampleOut
from model.step import make_logits, make_step
from model.step_inputs import (
    Buckets,
    DeviceRow,
    HostBatch,
    LogprobBatch,
    NoProgramYet,
    StepShape,
    build_batch,
)

log = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Seconds a new KV pool waits, once the server serves, for its first step before its pages are
# brought in anyway (new_kv)
FIRST_STEP_WAIT_S = 1.0


@dataclasses.dataclass(frozen=True, slots=True)
class ExecutorConfig:
    page_size: int = 16
    num_pages: int = 2048  # including the sink page 0
    max_context_len: int = 4096
    max_batch: int = 64  # largest decode bucket (= max running requests)
    max_extend_tokens: int = 1024  # largest extend bucket, in packed tokens
    extend_block: int = 16  # query tile of extend steps
    decode_bucket_step: int = 8  # decode batches: powers of two up to 2x this, then every this many
    dtype: str = "float32"
    tp_size: int = 1
    top_logprobs_num: int = 0  # N of the top-N logprobs every step returns (0 = off)
    token_ids_logprob_num: int = 0  # K: token_ids_logprob a row may ask for (every step takes K per row)
    attention_backend: str = "auto"
    attention_interpret: bool = False  # run Pallas kernels in their interpreter (tests on CPU)
    attn_chunk_tokens: int = 64  # native attention: keys per work item
    context_bucket_min: int = 512  # static-loop backends: smallest context compiled (then x2 up to max)
    layer_loop: str = "auto"  # "scan": stacked weights, one lax.scan; "unrolled": per-layer weights (auto: CPU)
    layer_unroll: int = 1  # decoder layers per scan iteration (layer_loop "scan")
    cpu_matmul: str = "auto"  # "xla" | "onednn" | "kernel" (model/kernels/) | "auto": model/compute_paths.py resolve_dot
    quantization: str | None = None  # "int8": weight-only int8 projections, LM head, embedding (model/params.py)
    precompile: bool = True  # compile every bucket at start-up
    background_compile: bool = False  # serve once a covering set is compiled; the rest on a thread
    verify_tokens: int = 0  # speculative decoding: tokens per verify round (k + 1); 0 = off
    decode_steps: int = 1  # multi-step decode: decode steps a program runs one after another (1 = off)
    decode_steps_rows: int = 4  # multi-step decode programs for decode batches of up to this many rows
    deterministic: bool = False  # batch-invariant kernels (enable_deterministic_inference)
    lora_slots: int = 0  # LoRA adapter pool slots incl. the empty slot 0 (max_loras_per_batch + 1); 0 = off
    lora_rank: int = 0  # max_lora_rank: every slot's rank (adapters of lower rank are zero-padded)
    lora_targets: tuple[str, ...] = ()  # the projections adapters may train (model/checkpoints/peft.py)
    lora_gather: bool = False  # the adapters' product in its gather form, not the dense one (model/lora.py)
    program_cache: bool = False  # keep the traced programs on disk (model/program_cache.py; CPU, one device)

    @property
    def max_pages(self) -> int:
        """Page-table width: pages of the longest context."""
        return cdiv(self.max_context_len, self.page_size)


class StepOut(NamedTuple):
    """One step's device outputs (`ModelExecutor.run_step`); JAX dispatch is asynchronous, so
    reading them waits for the step."""

    out: SampleOut  # the samples: the first `num_samples`, row after row
    accepted: jax.Array  # [R] int32 drafts each row accepted (0 for a plain row)
    prompt: PositionLogprobs  # logprobs at the wanted prompt positions: the first `num_positions`
    num_samples: int
    num_positions: int


def _huge_pages(host: Any, after: Callable[[], bool | None]) -> None:
    """model/params.py `huge_pages` on a thread of its own, once `after()` is true (None: give
    up), beside the steps already running on these weights (it moves no value). It waits for
    every program to be loaded and for the KV pool's pages to be in: started beside the lead
    programs' loading, it made a warm start's executor ~1.7 s slower (SmolLM2 f32: 1.6-2.2 ->
    3.5-4.0 s; the collapse took 1.4-2.3 s there against 0.14 s alone), and started as the
    executor serves, the server's first answer ~0.6 s later (launch to the first answered
    request, 5 starts each, alternating: medians 3.32 -> 3.96 s)."""
    import time

    while not (ready := after()):
        if ready is None:
            return
        time.sleep(0.25)
    t0 = time.perf_counter()
    moved = huge_pages(host)
    log.debug("weights on huge pages: %.0f MB in %.2f s", moved / 1e6, time.perf_counter() - t0)


def _release_packed(owner: list[tuple[int | None, int | None] | None]) -> None:
    """Release the weights registered under owner[0] (oneDNN's packed copies, the kernel's
    packed pairs), once."""
    if owner[0] is not None:
        from model.kernels import cpu_matmul, onednn

        onednn.release_weights(owner[0][0])
        cpu_matmul.release_weights(owner[0][1])
        owner[0] = None


class ModelExecutor:
    def __init__(self, model_path: str | Path, cfg: ExecutorConfig = ExecutorConfig()):
        if cfg.dtype not in DTYPES:
            raise ValueError(f"dtype={cfg.dtype!r}: choose one of {sorted(DTYPES)}")
        if cfg.quantization is not None and cfg.quantization not in QUANT_MODES:
            raise ValueError(f"quantization={cfg.quantization!r}: choose None or one of {list(QUANT_MODES)}")
        self.cfg = cfg
        self.mesh = make_mesh(cfg.tp_size)
        self.platform = jax.devices()[0].platform
        if self.platform == "cpu":
            prebuild_kernels(cfg)
        self.backend = resolve_backend(cfg.attention_backend, self.platform, cfg.attention_interpret, cfg.tp_size)
        if cfg.deterministic and self.backend in ("pallas", "pallas_gpu"):
            # the kernels' tiling is theirs; the pure-JAX tiles sum in an order no shape changes
            log.warning("enable_deterministic_inference: attention backend %s -> bucketed", self.backend)
            self.backend = "bucketed"
        self.model_config, tensors = load_checkpoint(model_path)
        mc = self.model_config
        if cfg.max_context_len > mc.max_position_embeddings:
            log.warning("max_context_len %d > model's max_position_embeddings %d",
                        cfg.max_context_len, mc.max_position_embeddings)  # fmt: skip
        geo = AttnGeometry(
            num_layers=mc.num_layers, num_pages=cfg.num_pages, page_size=cfg.page_size,
            num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
            max_pages=cfg.max_pages, dtype=DTYPES[cfg.dtype], sliding_window=mc.sliding_window,
            deterministic=cfg.deterministic,
        )  # fmt: skip
        self.attn: AttentionBackend = make_backend(self.backend, geo, cfg, self.mesh)
        if cfg.decode_steps > 1 and self.attn.plan_avals(Buckets.multistep_shape(2, cfg.decode_steps)):
            raise ValueError(f"decode_steps={cfg.decode_steps}: multi-step decode runs its steps' attention without a "
                             f"host plan, which the {self.backend} backend needs (cpu_kernel has none)")  # fmt: skip
        self.dot = resolve_dot(cfg, self.platform)
        self.layer_loop = resolve_layer_loop(cfg.layer_loop, self.platform, self.dot)
        self.model = CausalLM(mc, self.attn, DTYPES[cfg.dtype], cfg.tp_size, self.layer_loop, cfg.layer_unroll,
                              cfg.deterministic, logits_vocab_major=self.platform == "cpu",
                              lora_gather=cfg.lora_gather, dot=self.dot, quant=cfg.quantization,
                              rope_table_positions=cfg.max_pages * cfg.page_size if self.platform == "cpu" else None)  # fmt: skip
        self.buckets = Buckets.make(cfg.max_batch, cfg.max_extend_tokens, cfg.extend_block, cfg.decode_bucket_step)
        self.max_slots = cfg.max_batch  # FutureMap entries (one per request slot) + sink
        self.host_tensors = tensors  # HF-named, as served (weight updates replace them whole)
        checked_layout(mc, tensors)  # a missing or misshapen tensor is refused before anything runs
        # what every compiled program takes first (the Decoder's state, model/params.py; updates
        # must match it) and the KV cache's arrays: the programs compile against these
        self.params_avals = self.model.state_avals(self.mesh)
        self._reserve_pairs(self.params_avals)
        self.kv_avals = self._kv_avals()
        self._kv_generation = 0  # new_kv / drop_kv count up: a pool's page-populating thread stops
        self._populating: cpu_memory.Populating | None = None  # the KV pool's page-populating thread
        self._pool_first_out: jax.Array | None = None  # the KV pool's first step's tokens (new_kv)
        self._serving = threading.Event()  # set once the lead programs, weights and KV pool are ready
        self._settled = threading.Event()  # set once no more programs will compile (all, or failed)
        # Building the weights (host copies from the memory-mapped checkpoint, then the device's:
        # SmolLM2 f32 0.5-2.5 s on CPU), then the KV pool (new_kv) run on a thread while the
        # lead programs are traced, lowered and loaded here, which need only the avals above.
        # One after the other: the host copy and the checkpoint's pages are gone before the
        # pool's pages come (at once, f32 peak RSS would be ~1 GB higher).
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ringserve-load")
        building = pool.submit(self._build, tensors)
        zeroing = pool.submit(self.new_kv)
        pool.shutdown(wait=False)  # its thread ends with the tasks
        self.lora: LoraPool | None = None  # adapters: a pool of fixed shapes every program takes
        if cfg.lora_slots:
            self.lora = LoraPool(mc, cfg.lora_slots, cfg.lora_rank, cfg.lora_targets, self.layer_loop == "scan",
                                 DTYPES[cfg.dtype], replicated(self.mesh))  # fmt: skip
            self.lora_avals = _avals(self.lora.weights)
        self.trace_count = 0
        # Extend programs sample their (few real) rows in groups, in a loop, where loops are cheap.
        # Prompt positions' logprobs (extend programs) likewise, in groups: 64 on CPU (SmolLM2,
        # 255 positions: +0.23 s over a 0.74 s step; groups of 16: +0.37 s, of 256: +2.8 s), 128 on
        # accelerators, where each iteration of a runtime-count loop costs a host round trip
        # (not measured there yet).
        cpu = self.platform == "cpu"
        step = make_step(self.model, 16 if cpu else None, INVARIANT_ROWS if cfg.deterministic else None,
                         64 if cpu else 128)  # fmt: skip

        def traced(*args):
            self.trace_count += 1  # Python side effect: runs once per trace, never per call
            return step(*args)

        self._traced = traced
        self._jitted = jax.jit(traced, donate_argnums=(1, 2), static_argnums=(7, 8, 9))
        self._on_disk: ProgramCache | None = None
        self._not_on_disk: set[StepShape] = set()  # programs `_compile_best` found not kept
        if cfg.program_cache and usable(self.platform, cfg.tp_size):
            self._on_disk = ProgramCache({
                "executor": dataclasses.asdict(cfg), "model": repr(mc), "attention": self.backend, "dot": self.dot,
                "layer_loop": self.layer_loop})  # fmt: skip
            if self.platform == "cpu":
                load_kernels(cfg)  # (before a program is read back)
        self._logits_fn = jax.jit(make_logits(self.model), donate_argnums=(1,))
        contexts = self.attn.context_buckets()
        order, lead = compile_order(self.buckets, contexts, cfg.verify_tokens, cfg.top_logprobs_num, cpu,
                                    cfg.decode_steps, cfg.decode_steps_rows)  # fmt: skip
        self.programs = ProgramSet(self._compile, order, lead, contexts)

        def loaded() -> None:  # the weights and the KV pool, before any other program compiles
            self.params = building.result()
            if not self._fits(self.params):
                raise RuntimeError("the built state does not match its avals (model/llama.py: state_avals)")
            self._packed = [self._register_packed(self.params)]  # oneDNN's packed copies' owner (swap_params)
            weakref.finalize(self, _release_packed, self._packed)
            zeroing.result()
            self._serving.set()

        if cfg.precompile:
            self.programs.compile_all(background=cfg.background_compile and jax.process_count() == 1, then=loaded,
                                      done=self._settled.set)  # fmt: skip
        else:
            loaded()
            self._settled.set()

    # ---- weights ------------------------------------------------------------------------------
    def _build(self, tensors: dict[str, np.ndarray]) -> Any:
        """The Decoder's state from HF-named host arrays (model/params.py; per-layer weights when
        the layers run unrolled), each Param on its `tp` sharding. Raises ValueError naming a
        missing or misshapen tensor. Many hosts: each reads only its own devices' shards of the
        (memory-mapped) tensors (build_lazy_state), never the whole model into host memory."""
        build = build_lazy_state if jax.process_count() > 1 else build_host_state
        host = build(self.model_config, tensors, DTYPES[self.cfg.dtype], self.layer_loop == "scan",
                     self.cfg.quantization)  # fmt: skip
        params = jax.block_until_ready(self.model.place(host, self.mesh))
        release_pages(tensors)  # the checkpoint's pages, read once, leave this process's RSS
        if self.platform == "cpu" and self.mesh.size == 1:  # the device buffers are these host arrays (no copy)
            me = weakref.ref(self)  # an executor that failed to start is not kept waiting for

            def after() -> bool | None:  # serving, the KV pool's pages in; None: the executor is gone
                ex = me()
                if ex is None:
                    return None
                populating = ex._populating
                return ex._settled.is_set() and (populating is None or not populating.is_alive())

            threading.Thread(target=_huge_pages, args=(host, after), name="ringserve-huge-pages", daemon=True).start()
        return params

    def _reserve_pairs(self, avals: Any) -> None:
        """The memory of the kernel's packed pairs of these weights, faulted in on a thread
        while the programs load, before `_register_packed` packs into it (model/kernels/
        cpu_matmul.py `reserve`): packed into fresh pages, SmolLM2 bf16's first step after a
        warm start took 0.2-0.9 s on this project's VM (perf: 92% of it the kernel clearing
        pages), and a served start's first answer came 0.35-0.76 s after its /v1/models did,
        0.09-0.19 s after a reserve (6 starts each). At start only: a weight update packs after the old
        copies are freed, and a reserve beside them would hold both."""
        if self.platform == "cpu" and self.mesh.size == 1 and self.dot.startswith("kernel"):
            from model.kernels import cpu_matmul

            cpu_matmul.reserve(jax.tree_util.tree_leaves(avals))

    def build_params(self, tensors: dict[str, np.ndarray]) -> Any:
        """A new state beside the served one (same structure, avals and shardings)."""
        params = self._build(tensors)
        if not self._fits(params):
            raise ValueError("the new weights do not fit the compiled programs (structure, shapes or shardings)")
        return params

    def _fits(self, params: Any) -> bool:
        """Whether `params` has the structure, shapes, dtypes and shardings the programs take."""
        return _avals(params) == self.params_avals

    def swap_params(self, params: Any, tensors: dict[str, np.ndarray]) -> None:
        old, self.params, self.host_tensors = self.params, params, tensors
        _release_packed(self._packed)  # before the old buffers are freed (their addresses get reused)
        if old is not None:
            for leaf in jax.tree_util.tree_leaves(old):
                leaf.delete()
        self._packed[0] = self._register_packed(params)

    def _register_packed(self, params: Any) -> tuple[int | None, int | None] | None:
        """Register the weights with the custom calls that read packed copies of them: oneDNN's (its
        blocked layout, model/kernels/onednn_matmul.cc) and ringserve's kernel (bf16 weights in
        pairs along K, model/kernels/pairs.h); the tokens to release them by, or None where no
        step multiplies through either."""
        if params is None or not self.dot.startswith(("onednn", "kernel")):
            return None
        from model.kernels import cpu_matmul, onednn

        leaves = jax.tree_util.tree_leaves(params)
        ours = cpu_matmul.register_weights(leaves) if self.dot.startswith("kernel") else None
        return onednn.register_weights(leaves) if "onednn" in self.dot else None, ours

    def discard_params(self, params: Any) -> None:
        """Free a state built by `build_params` that will not be served (an update refused)."""
        for leaf in jax.tree_util.tree_leaves(params):
            leaf.delete()

    def drop_params(self) -> None:
        """Free the weights on the device; the host copy stays."""
        self.swap_params(None, self.host_tensors)

    # ---- device memory --------------------------------------------------------------------------
    def new_kv(self) -> None:
        """A zeroed KV cache (the backend's arrays) and FutureMap (token, position per slot + sink).
        On CPU the cache's pages come on first write, brought in by a thread once the server
        serves (model/kernels/cpu_memory.py: XLA's zeros first-touched SmolLM2 f32's 2.1 GiB
        before the first request, 6.7 s of a 13 s warm start on this project's VM)."""
        kv, future = self.kv_avals
        self.kv: Any = tuple(cpu_memory.zeros(a) for a in kv)
        self.future: Any = tuple(place_host_array(np.zeros(f.shape, f.dtype), f.sharding) for f in future)
        generation = self._kv_generation = self._kv_generation + 1
        self._pool_first_out = None
        me = weakref.ref(self)  # the thread must not keep an executor (and its pool) that failed to start

        def stop() -> bool:
            ex = me()
            return ex is None or ex._kv_generation != generation

        serving_since: float | None = None  # when `after` first saw the server serving

        def after() -> bool | None:
            """Once the server serves and the pool's first step is done, or it served
            FIRST_STEP_WAIT_S with none; None once the pool is gone."""
            nonlocal serving_since
            ex = me()
            if ex is None or stop():
                return None
            if not ex._serving.is_set():
                return False
            if ex._pool_first_out is not None:
                try:
                    ex._pool_first_out.block_until_ready()
                except Exception:  # noqa: BLE001 -- a failed (or freed) step: the pages come all the same
                    log.debug("the KV pool's first step did not finish; bringing its pages in", exc_info=True)
                return True
            now = time.monotonic()
            serving_since = now if serving_since is None else serving_since
            return now - serving_since >= FIRST_STEP_WAIT_S

        # once the server serves: beside the lead programs' tracing it was ready ~1.5 s later.
        # Beside the background compile it slows the loads (their executables' mappings wait for
        # its faults on the process's mmap lock: SmolLM2's first background program 5.6 s instead
        # of 0.14), but a step compiles its own program at once (`prepare`); after every program
        # (tried) it ran beside the first steps once all were compiled (`ringserve generate`'s
        # tiny-model throughput 4.1-4.3k tok/s against 6.8-7.2k). After the pool's first step:
        # beside it, that step (usually the server's first request) took 0.13-0.79 s instead of
        # 0.10-0.12 (SmolLM2 bf16, a 2-token prompt right after a warm start).
        self._populating = cpu_memory.populate(self.kv, stop=stop, after=after)

    def _kv_avals(self) -> Any:
        """The KV cache's and FutureMap's arrays, abstract (shape, dtype, sharding): `kv_avals`,
        what the programs compile against and `new_kv` makes."""
        kv = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(self.mesh, s))
                   for a, s in zip(self.attn.kv_avals(), self.attn.kv_specs(self.cfg.tp_size), strict=True))  # fmt: skip
        future = jax.ShapeDtypeStruct((self.max_slots + 1,), np.int32, sharding=replicated(self.mesh))
        return kv, (future, future)

    def drop_kv(self) -> None:
        """Free the KV cache and FutureMap on the device."""
        self._kv_generation += 1  # a thread still bringing its pages in stops
        for leaf in jax.tree_util.tree_leaves((self.kv, self.future)):
            leaf.delete()
        self.kv, self.future = None, None

    # ---- programs -----------------------------------------------------------------------------
    def _program_args(self, shape: StepShape) -> tuple[Any, ...]:
        """The abstract arguments the program of `shape` compiles against."""
        fwd, smp, lb, row_slot = step_avals(shape, self.attn.plan_avals(shape), self.cfg.max_pages,
                                            replicated(self.mesh), self.mask_words, self.cfg.token_ids_logprob_num,
                                            self.buckets.positions(shape))  # fmt: skip
        kv, future = self.kv_avals
        lora = LoraBatch(row_slot, self.lora_avals) if self.lora is not None else None
        return (self.params_avals, kv, future, fwd, smp, lb, lora)

    def _compile_best(self, smallest: StepShape, need: int, loaded_only: bool) -> bool:
        """Compile the program of `smallest` (the shape that best holds a waiting step, with the
        shortest context bucket >= `need`) here and now, ahead of the background compile's order;
        with `loaded_only`, only where it is kept on disk (a load, not a compile). True if it did."""
        top_n = self.cfg.top_logprobs_num
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
        """The structure every step program returns (model/step.py): kv, the FutureMap, the
        samples, the accepted drafts, the prompt positions' logprobs."""
        kv, future = self.kv_avals
        return jax.tree.structure((kv, future, SampleOut(*range(5)), 0, PositionLogprobs(*range(4))))

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until the background compile is over; True once every program is compiled."""
        return self.programs.wait(timeout)

    def compile_status(self) -> dict[str, Any]:
        return self.programs.status()

    @property
    def mask_words(self) -> int:
        """int32 words of one grammar mask: ceil(V / 32) (model/sampler.py)."""
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
        (`multistep`: `verify` decode steps in one program, model/step.py)."""
        top_n, need = self.cfg.top_logprobs_num, 0
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
                hb = build_batch(rows, self.buckets, self.cfg.page_size, self.cfg.max_pages, self.max_slots, verify, ok,
                                 self.cfg.token_ids_logprob_num, multistep)  # fmt: skip
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
        out, accepted, prompt = self.run_host_batch(hb)
        return StepOut(out, accepted, prompt, hb.num_samples, hb.num_positions)

    def run_host_batch(self, hb: HostBatch) -> tuple[SampleOut, jax.Array, PositionLogprobs]:
        key = (hb.shape, self.cfg.top_logprobs_num)
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
        self.kv, self.future, out, accepted, prompt = prog(self.params, self.kv, self.future, hb.forward,
                                                           self._with_mask(hb), self._with_logprob(hb), lora)  # fmt: skip
        if self._pool_first_out is None:  # (new_kv: the pool's pages come in after it)
            self._pool_first_out = out.tokens
        return out, accepted, prompt

    @functools.cached_property
    def _all_allowed(self) -> dict[int, jax.Array]:
        """Samples per step -> an all-ones grammar mask on device."""
        return {}

    def _with_mask(self, hb: HostBatch) -> Any:
        """The step's sampling inputs with a grammar mask: the rows' (model/step_inputs.py), or
        when no row is constrained an all-ones one kept on device (never sent again)."""
        smp, n = hb.sampling, hb.shape.rows * max(1, hb.shape.verify)
        if smp.mask is not None:
            if smp.mask.shape != (n, self.mask_words):
                raise ValueError(f"grammar masks of shape {smp.mask.shape}, expected {(n, self.mask_words)}")
            return smp
        ones = self._all_allowed.get(n)
        if ones is None:
            ones = self._all_allowed[n] = place_host_array(np.full((n, self.mask_words), -1, np.int32),
                                                           replicated(self.mesh))  # fmt: skip
        return smp._replace(mask=ones)

    @functools.cached_property
    def _zeros(self) -> dict[tuple[int, ...], jax.Array]:
        """Shape -> int32 zeros on device (the logprob inputs of steps that want none)."""
        return {}

    def _zeros_of(self, *shape: int) -> jax.Array:
        z = self._zeros.get(shape)
        if z is None:
            z = self._zeros[shape] = place_host_array(np.zeros(shape, np.int32), replicated(self.mesh))
        return z

    def _with_logprob(self, hb: HostBatch) -> LogprobBatch:
        """The step's logprob inputs (model/step_inputs.py LogprobBatch): the rows', or where no
        row wants token_ids_logprob or prompt positions, zeros kept on device (never sent again),
        so a step without them moves nothing more to the device."""
        lb, r, p = hb.logprob, hb.shape.rows, self.buckets.positions(hb.shape)
        if lb.ids is None:
            lb = lb._replace(ids=self._zeros_of(r, self.cfg.token_ids_logprob_num))
        if p and lb.index is None:
            z = self._zeros_of(p)
            lb = lb._replace(index=z, target=z, row=z, count=self._zeros_of())
        return lb

    def logits(self, rows: list[DeviceRow]) -> tuple[np.ndarray, list[int]]:
        """Full-vocabulary f32 logits of each row's last token (writes KV like `run`).

        A diagnostic path for parity tests and tools: jitted on demand, never used while
        serving, and not counted in `trace_count`."""
        hb = self.prepare(rows)
        self.kv, logits = self._logits_fn(self.params, self.kv, jax.device_put(hb.forward, replicated(self.mesh)))
        return np.asarray(logits)[: hb.num_samples], list(range(hb.num_samples))


def _statics(shape: StepShape, top_n: int) -> tuple[int, int, bool]:
    """The step function's static arguments for a program of `shape` (model/step.py)."""
    return top_n, shape.verify, shape.multistep


def _avals(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)

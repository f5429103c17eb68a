"""Every engine option: one frozen `ServerArgs` of sections, the CLI flags generated from them.

    model        ModelOptions        what is served
    compute      ComputeOptions      how the model computes (model/compute/options.py): the executor
                                     takes this section as it is (model/runtime/executor.py)
    memory       MemoryOptions       the KV pool, running requests, context length
    scheduling   SchedulingOptions   prefill chunks and buckets, policies, overlap, multi-step decode
    speculation  SpeculativeOptions  n-gram drafts
    outputs      OutputOptions       logprobs, seeds, streaming, structured outputs
    lora         LoraOptions         adapters
    startup      StartupOptions      compiled programs and their caches
    parallel     ParallelOptions     tp, dp, many hosts
    serving      ServingOptions      HTTP, processes, supervision, tracing

Options keep SGLang's flat names: they are the flags (`--page-size`), the keywords
(`Engine(page_size=16)`, `ServerArgs(page_size=16)`), and a read-only view (`args.page_size` is
`args.memory.page_size`), as SGLang's own ServerArgs is read by the frameworks that drive it. A
name belongs to one section; a section travels whole where one part of the engine needs it.

Nothing mutates a ServerArgs after construction: derived values are properties, and a variant is
made with `dataclasses.replace` (flat names or whole sections). Validation happens once, in
`__post_init__`, and names the field and the limit.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing
from typing import Any, Literal, get_args, get_origin

from ringserve.kvmem import cdiv
from ringserve.model.compute.options import ComputeOptions, assemble, flat_fields
from ringserve.model.compute.platform import prefill_step_cost
from ringserve.model.compute.step_inputs import ProgramShapes


def _opt(default: Any, help: str, **kw: Any) -> Any:
    return dataclasses.field(default=default, metadata={"help": help, **kw})


class _Section:
    """A section of ServerArgs (a frozen dataclass of options; ServerArgs validates them)."""

    __slots__ = ()


@dataclasses.dataclass(frozen=True, slots=True)
class ModelOptions(_Section):
    """The model."""

    model_path: str | None = _opt(
        None, "'tiny' (generated), 'smollm2' (fetched), a model directory or a .gguf file; None = smollm2"
    )
    served_model_name: str | None = _opt(None, "the model's name in the OpenAI API; None: its directory's name")


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryOptions(_Section):
    """Memory: KV pool, requests, context."""

    page_size: int = _opt(16, "tokens per KV page")
    max_total_tokens: int | None = _opt(
        None, "KV pool size in tokens (rounded down to pages; page 0 is reserved); None: sized at start-up to the "
        "smaller of what max_running_requests requests of context_length need and what mem_fraction_static leaves "
        "after the weights (actors/transport/memory.py)"
    )
    mem_fraction_static: float | None = _opt(
        None, "share of a device's memory for the weights + KV pool, in (0, 1] (SGLang's flag); None: 0.85 on GPU "
        "and TPU, 0.2 on CPU, where the 'device' is the host's available RAM and also holds the OS, the other "
        "processes, XLA's compile scratch and the runner's host copy of the checkpoint"
    )
    max_running_requests: int = _opt(64, "requests decoded together (largest decode bucket; slot pool rows)")
    context_length: int = _opt(4096, "longest prompt + output of one request")


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulingOptions(_Section):
    """Scheduling."""

    chunked_prefill_size: int = _opt(
        2048, "max new tokens per prefill step, all its requests together (a longer prompt is cut into chunks, as "
        "SGLang's); -1 disables chunking"
    )
    max_prefill_tokens: int = _opt(2048, "max new tokens in one prefill batch (largest extend bucket)")
    prefill_step_cost: int | None = _opt(
        None, "a prefill step's own cost in prefill tokens: a step whose extend program would hold more padding than "
        "cutting it at the bucket below and computing the rest in steps of its own costs is cut there "
        "(actors/scheduler/prefill.py `BucketFit`); 0: never cut; None: 32 on CPU (measured), 0 elsewhere"
    )
    enable_mixed_chunk: bool = _opt(False, "run a prefill chunk and the decode batch in one step")
    schedule_policy: Literal["fcfs", "lpm"] = _opt(
        "fcfs", "waiting-queue order: first come or longest prefix match"
    )
    disable_radix_cache: bool = _opt(False, "cache no prefixes (RL rollouts often run this way)")
    disable_overlap_schedule: bool = _opt(False, "schedule batch N+1 only after batch N's tokens are back")
    decode_steps: int = _opt(
        1, "multi-step decode: when nothing waits and at most decode_steps_max_batch requests decode, one decode "
        "batch runs this many steps on the device (tokens stream this many at a time; a request that stops "
        "inside a run drops the rest): the host's work per step is paid once a run (cpu_kernel attention); 1: off"
    )
    decode_steps_max_batch: int = _opt(4, "largest decode batch that runs multi-step (decode_steps > 1)")
    new_token_ratio_init: float = _opt(0.7, "initial share of max_new_tokens reserved per running request")
    new_token_ratio_min: float = _opt(0.1, "floor of that share")
    new_token_ratio_decay_steps: int = _opt(600, "decode steps to decay from init to min")


@dataclasses.dataclass(frozen=True, slots=True)
class SpeculativeOptions(_Section):
    """Speculative decoding."""

    speculative_algorithm: Literal["none", "ngram"] = _opt(
        "none", "speculative decoding: 'ngram' drafts from each request's own context (prompt lookup)"
    )
    speculative_num_draft_tokens: int = _opt(4, "draft tokens per verify round (ngram)")
    speculative_ngram_max_match: int = _opt(4, "longest suffix n-gram looked up in the context (ngram)")


@dataclasses.dataclass(frozen=True, slots=True)
class OutputOptions(_Section):
    """Sampling and outputs: logprobs, seeds, streaming, structured outputs."""

    sampling_defaults: Literal["model", "openai"] = _opt(
        "model", "the sampling parameters a request leaves out: the model's (temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_new_tokens from its generation_config.json, as SGLang's --sampling-defaults model and vLLM's "
        "--generation-config auto), or openai: the plain API defaults (temperature 1, top_p 1)"
    )
    max_top_logprobs_num: int = _opt(5, "top_logprobs_num a request may ask for (compiled into every step)")
    max_token_ids_logprob: int = _opt(
        16, "token ids a request's token_ids_logprob may name (their logprobs are read in every step)"
    )
    seed: int = _opt(0, "default sampling seed of requests that give none")
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = _opt(
        "raw_logprobs", "what output logprobs are of (vLLM's names): raw_logprobs, the model's distribution (after a "
        "grammar's mask only); processed_logprobs, the distribution each token was drawn from (after min_new_tokens, "
        "logit_bias, the penalties, temperature and top-k / top-p / min-p, renormalised over what they keep); "
        "prompt logprobs are raw either way"
    )
    enable_return_hidden_states: bool = _opt(
        False, "requests may ask for return_hidden_states (the last layer's state at each position; every step "
        "program returns its tokens' states: compiled in)"
    )
    enable_return_routed_experts: bool = _opt(
        False, "requests may ask for return_routed_experts (routing replay: the expert ids each MoE layer routed "
        "each position to, SGLang's meta_info['routed_experts']; every step program returns its tokens' ids: "
        "compiled in; a model without MoE layers is refused)"
    )
    stream_interval: int = _opt(1, "tokens between streamed chunks")
    incremental_streaming_output: bool = _opt(
        False, "streamed chunks of /generate, the Engine and the Client hold only what is new since the last "
        "(text, output_ids, their logprobs); off: each holds everything so far (SGLang's default); OpenAI's "
        "routes stream deltas either way"
    )
    constrained_json_whitespace_pattern: str | None = _opt(
        None, "regex of the whitespace a json_schema-constrained output may put between tokens (None: any)"
    )
    constrained_json_disable_any_whitespace: bool = _opt(
        False, "json_schema-constrained outputs are compact: no whitespace between tokens"
    )


@dataclasses.dataclass(frozen=True, slots=True)
class LoraOptions(_Section):
    """LoRA adapters (SGLang's flags)."""

    enable_lora: bool = _opt(False, "serve LoRA adapters: a per-request lora_path names one (compiled into every step)")
    max_lora_rank: int = _opt(16, "largest adapter rank served (every adapter is zero-padded to it)")
    max_loras_per_batch: int = _opt(
        8, "adapter slots on the device: adapters loaded at once (a batch mixes any of them and none)"
    )
    lora_target_modules: tuple[str, ...] = _opt(
        ("all",), "projections adapters may train: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or all"
    )
    lora_paths: tuple[str, ...] = _opt((), "adapters loaded at start-up, NAME=PATH each (PEFT directories)")


@dataclasses.dataclass(frozen=True, slots=True)
class StartupOptions(_Section):
    """Start-up: compiled programs and their caches."""

    precompile: bool = _opt(True, "compile every shape bucket at start-up")
    serve_while_compiling: bool = _opt(
        True,
        "serve once the largest bucket of each kind is compiled and compile the rest in the background "
        "(steps pad to the smallest compiled bucket meanwhile); off: serve after all are compiled",
    )
    xla_cache: bool = _opt(
        True, "keep compiled step programs in $RINGSERVE_CACHE/xla, on CPU the traced ones in "
        "$RINGSERVE_CACHE/programs (later start-ups take seconds)"
    )
    runner_in_process: bool = _opt(
        False, "run the runner as a thread of the process that starts the engine, on its devices (a trainer's: "
        "one process owns a TPU host's chips; ringserve.integrations.tunix), the other actors as processes; "
        "dp_size 1 on one host"
    )


@dataclasses.dataclass(frozen=True, slots=True)
class ParallelOptions(_Section):
    """Parallelism: tensor, data, many hosts (SGLang's names; every host runs the same command but --node-rank)."""

    tp_size: int = _opt(1, "tensor-parallel devices (the `tp` mesh axis); with nnodes > 1, of every host together")
    ep_size: int = _opt(
        1, "expert-parallel devices of mixture-of-experts models: 1 (every device holds every expert) or tp_size "
        "(the experts split over the tp devices, attention still tensor-parallel)"
    )
    dp_size: int = _opt(
        1, "data-parallel groups on this host: independent scheduler + runner + detokenizer each, on tp_size devices "
        "of its own (dp_size * tp_size devices in all)"
    )
    load_balance_method: Literal["round_robin", "total_requests", "total_tokens", "cache_aware"] = _opt(
        "cache_aware", "dp_size > 1: which group a request goes to (an explicit data_parallel_rank wins)"
    )
    nnodes: int = _opt(1, "hosts serving one model together (one runner each, one jax.distributed program)")
    node_rank: int = _opt(0, "this host's rank: 0 runs the frontend, scheduler and detokenizer; > 0 only a runner")
    dist_init_addr: str | None = _opt(
        None, "HOST:PORT of node 0's jax.distributed coordinator (nnodes > 1); the relay listens on HOST:relay_port"
    )
    relay_port: int = _opt(0, "node 0's step relay port (0: the coordinator's port + 1)")
    dist_token: str | None = _opt(
        None, "shared secret of the hosts' step relay, the same on every host; None: $RINGSERVE_DIST_TOKEN",
        secret=True,
    )
    dist_timeout: int = _opt(300, "seconds the hosts wait for each other at start-up (jax.distributed, relay)")
    dist_heartbeat_s: int = _opt(
        10, "seconds without a heartbeat after which jax.distributed ends every host (a hung host's backstop)"
    )
    dist_local_runners: bool = _opt(
        False, "nnodes > 1 on one machine, in one engine: every node's runner is spawned here and reads the step "
        "ring directly (tests; no relay)"
    )
    weight_group_timeout: int = _opt(
        600, "seconds a runner waits to join a trainer's weight-update group (init_weights_update_group) and for "
        "each tensor broadcast in it; past it the group is left and the old weights keep serving"
    )


@dataclasses.dataclass(frozen=True, slots=True)
class ServingOptions(_Section):
    """Serving: HTTP, processes, supervision, tracing."""

    host: str = _opt("127.0.0.1", "HTTP bind address (localhost by default)")
    port: int = _opt(30000, "HTTP port (0: any free port)")
    ring_bytes: int = _opt(1 << 22, "data bytes of each shared-memory ring (a power of two)")
    spin_us: int = _opt(50, "microseconds a ring reader spins before sleeping")
    log_level: Literal["debug", "info", "warning", "error"] = _opt("info", "log level of every actor")
    supervise: bool = _opt(
        True,
        "when the scheduler, runner or detokenizer dies, start them again and resubmit every request in flight "
        "(its caller sees one stream); off: the engine ends and every caller gets EngineDead",
    )
    max_restarts: int = _opt(3, "supervise: restarts allowed within restart_window_s; one more crash ends the engine")
    restart_window_s: float = _opt(60.0, "supervise: the window (seconds) max_restarts counts crashes in")
    step_trace: int = _opt(
        0, "keep timings of the last N steps for get_server_info()['step_trace'] (0: off; `ringserve bench --profile`)"
    )
    jax_profile_dir: str | None = _opt(
        None, "write a jax.profiler trace of the runner (ready to shutdown) into this directory (Perfetto, TensorBoard)"
    )


SECTIONS: dict[str, tuple[type, str]] = {  # attribute -> (type, the --help group's title)
    "model": (ModelOptions, "model"),
    "compute": (ComputeOptions, "model compute: dtype, quantization, attention, kernels, compiled shapes"),
    "memory": (MemoryOptions, "memory: KV pool, running requests, context"),
    "scheduling": (SchedulingOptions, "scheduling"),
    "speculation": (SpeculativeOptions, "speculative decoding"),
    "outputs": (OutputOptions, "sampling and outputs"),
    "lora": (LoraOptions, "LoRA adapters"),
    "startup": (StartupOptions, "start-up: compiled programs and their caches"),
    "parallel": (ParallelOptions, "parallelism: tensor, data, many hosts"),
    "serving": (ServingOptions, "serving: HTTP, processes, supervision, tracing"),
}
_OWNER = {f.name: s for s, (tp, _) in SECTIONS.items() for f in dataclasses.fields(tp)}  # flat name -> section
OPTIONS = frozenset(_OWNER)  # every option's flat name (a flag, a keyword)


@dataclasses.dataclass(frozen=True, slots=True, init=False)
class ServerArgs:
    model: ModelOptions
    compute: ComputeOptions
    memory: MemoryOptions
    scheduling: SchedulingOptions
    speculation: SpeculativeOptions
    outputs: OutputOptions
    lora: LoraOptions
    startup: StartupOptions
    parallel: ParallelOptions
    serving: ServingOptions

    def __init__(self, **options: Any) -> None:
        """From flat option names (SGLang's) and/or whole sections; ValueError naming an unknown
        option or a bad value."""
        assemble(self, options, "server option")
        self.__post_init__()

    def __getattr__(self, name: str) -> Any:
        """The flat, read-only view: `args.page_size` is `args.memory.page_size`."""
        section = _OWNER.get(name)
        if section is None:
            raise AttributeError(f"ServerArgs has no option {name!r}")
        return getattr(object.__getattribute__(self, section), name)

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        for section, (tp, _) in SECTIONS.items():
            hints = _hints(tp)
            for f in dataclasses.fields(tp):
                v = getattr(getattr(self, section), f.name)
                choices = f.metadata.get("choices") or _literal_choices(hints[f.name])
                if choices is not None:
                    need(v in choices, f"{f.name}={v!r}: choose one of {list(choices)}")
        need(self.tp_size >= 1, f"tp_size={self.tp_size}: must be >= 1")
        need(self.ep_size in (1, self.tp_size), f"ep_size={self.ep_size}: must be 1 or tp_size={self.tp_size}")
        need(1 <= self.dp_size <= 64, f"dp_size={self.dp_size}: must be in [1, 64]")
        need(
            self.page_size >= 1 and self.page_size & (self.page_size - 1) == 0,
            f"page_size={self.page_size}: must be a power of two >= 1",
        )
        need(
            self.max_running_requests >= 1, f"max_running_requests={self.max_running_requests}: must be >= 1"
        )
        need(self.context_length >= 2, f"context_length={self.context_length}: must be >= 2")
        need(not self.runner_in_process or (self.dp_size == 1 and self.nnodes == 1),
             f"runner_in_process: one runner on this host's devices (dp_size={self.dp_size}, nnodes={self.nnodes})")  # fmt: skip
        if self.max_total_tokens is not None:  # None: sized at start-up (actors/transport/memory.py)
            need(
                self.max_total_tokens >= 2 * self.page_size,
                f"max_total_tokens={self.max_total_tokens}: must hold at least 2 pages of {self.page_size}",
            )
            need(self.num_pages >= self.min_pages,
                 f"max_total_tokens={self.max_total_tokens}: the KV pool must hold one request of context_length="
                 f"{self.context_length} plus a page ({self.min_pages * self.page_size} tokens)")  # fmt: skip
        need(self.mem_fraction_static is None or 0.0 < self.mem_fraction_static <= 1.0,
             f"mem_fraction_static={self.mem_fraction_static}: must be in (0, 1]")  # fmt: skip
        need(
            self.chunked_prefill_size == -1 or self.chunked_prefill_size >= 1,
            f"chunked_prefill_size={self.chunked_prefill_size}: -1 (off) or >= 1",
        )
        need(self.prefill_step_cost is None or self.prefill_step_cost >= 0,
             f"prefill_step_cost={self.prefill_step_cost}: must be >= 0 (0: never cut a prefill step at a bucket)")  # fmt: skip
        need(
            self.max_prefill_tokens >= self.extend_block,
            f"max_prefill_tokens={self.max_prefill_tokens}: must be >= extend_block={self.extend_block}",
        )
        need(
            self.max_prefill_tokens % self.extend_block == 0,
            f"max_prefill_tokens={self.max_prefill_tokens}: must be a multiple of extend_block={self.extend_block}",
        )
        need(
            0.0 <= self.new_token_ratio_min <= self.new_token_ratio_init <= 1.0,
            "new_token_ratio_min <= new_token_ratio_init must lie in [0, 1]",
        )
        need(
            self.ring_bytes >= 4096 and self.ring_bytes & (self.ring_bytes - 1) == 0,
            f"ring_bytes={self.ring_bytes}: must be a power of two >= 4096",
        )
        need(
            0 <= self.max_top_logprobs_num <= 64,
            f"max_top_logprobs_num={self.max_top_logprobs_num}: must be in [0, 64]",
        )
        need(
            0 <= self.max_token_ids_logprob <= 256,
            f"max_token_ids_logprob={self.max_token_ids_logprob}: must be in [0, 256]",
        )
        need(
            1 <= self.speculative_num_draft_tokens <= 16,
            f"speculative_num_draft_tokens={self.speculative_num_draft_tokens}: must be in [1, 16]",
        )
        need(
            1 <= self.speculative_ngram_max_match <= 16,
            f"speculative_ngram_max_match={self.speculative_ngram_max_match}: must be in [1, 16]",
        )
        need(1 <= self.decode_steps <= 16, f"decode_steps={self.decode_steps}: must be in [1, 16]")
        need(self.decode_steps_max_batch >= 1, f"decode_steps_max_batch={self.decode_steps_max_batch}: must be >= 1")
        need(
            not (self.speculative and self.decode_steps > 1),
            "speculative decoding and decode_steps > 1 cannot be combined (both run rounds of several tokens)",
        )
        need(
            not (self.speculative and self.enable_mixed_chunk),
            "speculative decoding and enable_mixed_chunk cannot be combined (a verify round is a step of its own)",
        )
        need(
            not (self.constrained_json_disable_any_whitespace and self.constrained_json_whitespace_pattern),
            "constrained_json_whitespace_pattern and constrained_json_disable_any_whitespace cannot be combined",
        )
        if self.constrained_json_whitespace_pattern is not None:
            from llguidance import LLMatcher

            g = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=typing.cast(Any, self.json_options))
            err = LLMatcher.validate_grammar(g)
            need(not err, f"constrained_json_whitespace_pattern={self.constrained_json_whitespace_pattern!r}: {err}")
        need(self.max_restarts >= 0, f"max_restarts={self.max_restarts}: must be >= 0")
        need(self.restart_window_s > 0, f"restart_window_s={self.restart_window_s}: must be > 0 seconds")
        need(self.step_trace >= 0, f"step_trace={self.step_trace}: must be >= 0 (0: off)")
        need(0 <= self.port <= 65535, f"port={self.port}: must be in [0, 65535] (0: any free port)")
        need(self.nnodes >= 1, f"nnodes={self.nnodes}: must be >= 1")
        need(0 <= self.node_rank < self.nnodes, f"node_rank={self.node_rank}: must be in [0, nnodes={self.nnodes})")
        if self.nnodes > 1:
            need(self.tp_size % self.nnodes == 0,
                 f"tp_size={self.tp_size}: must be a multiple of nnodes={self.nnodes} (it counts every host's devices)")  # fmt: skip
            need(self.dist_init_addr is not None and self.dist_addr[1] > 0,
                 "nnodes > 1 needs dist_init_addr HOST:PORT (node 0's jax.distributed coordinator)")  # fmt: skip
        need(0 <= self.relay_port <= 65535, f"relay_port={self.relay_port}: must be in [0, 65535] (0: dist port + 1)")
        need(self.dist_timeout >= 1, f"dist_timeout={self.dist_timeout}: must be >= 1 second")
        need(self.nnodes == 1 or self.dp_size == 1,
             f"dp_size={self.dp_size} with nnodes={self.nnodes}: data-parallel groups over many hosts are not supported yet")  # fmt: skip
        need(self.weight_group_timeout >= 1, f"weight_group_timeout={self.weight_group_timeout}: must be >= 1 second")
        need(self.dist_heartbeat_s >= 1, f"dist_heartbeat_s={self.dist_heartbeat_s}: must be >= 1 second")
        self._check_lora(need)

    def _set_lora(self, **kw: Any) -> None:
        """Normalize a lora option once (lists and dicts given as keywords: held as tuples)."""
        object.__setattr__(self, "lora", dataclasses.replace(self.lora, **kw))

    def _check_lora(self, need: Any) -> None:
        if isinstance(self.lora_paths, dict):  # {name: path}, as a keyword: the NAME=PATH strings
            self._set_lora(lora_paths=tuple(f"{k}={v}" for k, v in self.lora_paths.items()))
        for f in ("lora_paths", "lora_target_modules"):  # lists (CLI, keywords) held as tuples
            v = getattr(self, f)
            need(isinstance(v, list | tuple) and all(isinstance(x, str) for x in v), f"{f}={v!r}: a list of strings")
            self._set_lora(**{f: tuple(v)})
        need(1 <= self.max_lora_rank <= 1024, f"max_lora_rank={self.max_lora_rank}: must be in [1, 1024]")
        need(1 <= self.max_loras_per_batch <= 256,
             f"max_loras_per_batch={self.max_loras_per_batch}: must be in [1, 256]")  # fmt: skip
        from ringserve.model.checkpoints.peft import parse_target_modules

        parse_target_modules(self.lora_target_modules)
        names = list(self.lora_adapters)
        need(self.enable_lora or not self.lora_paths, "lora_paths: adapters need enable_lora")
        need(len(names) <= self.max_loras_per_batch,
             f"lora_paths: {len(names)} adapters, more than max_loras_per_batch={self.max_loras_per_batch} slots")  # fmt: skip
        need(not (self.enable_lora and self.nnodes > 1),
             "enable_lora cannot be combined with nnodes > 1 yet (the adapter pool is placed on one host's devices)")  # fmt: skip
        need(not (self.enable_lora and self.enable_deterministic_inference),
             "enable_lora cannot be combined with enable_deterministic_inference yet (the adapter product is not batch-invariant)")  # fmt: skip

    @property
    def lora_adapters(self) -> dict[str, str]:
        """lora_paths as {name: path}, in the given order (slot 1, 2, ...). ValueError on a
        malformed entry or a name given twice."""
        out: dict[str, str] = {}
        for entry in self.lora_paths:
            name, eq, path = entry.partition("=")
            if not eq or not name or not path:
                raise ValueError(f"lora_paths: {entry!r} must be NAME=PATH")
            if name in out:
                raise ValueError(f"lora_paths: adapter name {name!r} given twice")
            out[name] = path
        return out

    @property
    def num_pages(self) -> int:
        """Pages in the KV pool, the reserved sink page 0 included. Only once the pool is sized:
        every actor's ServerArgs is (`resolve_memory`, actors/transport/memory.py)."""
        if self.max_total_tokens is None:
            raise RuntimeError("max_total_tokens is unresolved: size the KV pool first (actors/transport/memory.py)")
        return self.max_total_tokens // self.page_size

    @property
    def max_extend_tokens(self) -> int:
        """Tokens of the largest extend program: a prefill batch's budget with a block of room per
        running request (mixed decode rows), or a verify step's rounds, whichever is more."""
        verify = self.speculative_num_draft_tokens + 1 if self.speculative else 0
        most = max(self.max_prefill_tokens + self.extend_block * self.max_running_requests,
                   verify * self.max_running_requests + self.extend_block)  # fmt: skip
        return most // self.extend_block * self.extend_block

    def for_platform(self, plat: str) -> ServerArgs:
        """These args with the platform's defaults filled in (the frontend, before any actor starts)."""
        if self.prefill_step_cost is not None:
            return self
        return self.replace(prefill_step_cost=prefill_step_cost(plat))

    def replace(self, **options: Any) -> ServerArgs:
        """These args with some options changed (flat names or whole sections): `dataclasses.replace`."""
        return dataclasses.replace(self, **options)

    @property
    def program_shapes(self) -> ProgramShapes:
        """What the compiled step programs hold (the scheduler plans within them, the executor
        compiles them): derived here, once."""
        return ProgramShapes(
            page_size=self.page_size, num_pages=self.num_pages, max_context_len=self.context_length,
            max_batch=self.max_running_requests, max_extend_tokens=self.max_extend_tokens,
            top_logprobs_num=self.max_top_logprobs_num, token_ids_logprob_num=self.max_token_ids_logprob,
            verify_tokens=self.speculative_num_draft_tokens + 1 if self.speculative else 0,
            decode_steps=self.decode_steps, decode_steps_rows=self.decode_steps_max_batch,
            processed_logprobs=self.logprobs_mode == "processed_logprobs", hidden_states=self.enable_return_hidden_states,
            routed_experts=self.enable_return_routed_experts,
        )  # fmt: skip

    @property
    def min_pages(self) -> int:
        """The smallest pool: the sink page, one request of context_length, one page more."""
        return cdiv(self.context_length, self.page_size) + 2

    @property
    def dist_addr(self) -> tuple[str, int]:
        """(host, port) of `dist_init_addr` ('[::1]:P' and 'host:P' both parse)."""
        host, sep, port = (self.dist_init_addr or "").rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"dist_init_addr={self.dist_init_addr!r}: must be HOST:PORT")
        return host.strip("[]"), int(port)

    @property
    def relay_addr(self) -> tuple[str, int]:
        """(host, port) node 0's step relay listens on: the coordinator's host, relay_port or port + 1."""
        host, port = self.dist_addr
        return host, self.relay_port or port + 1

    @property
    def multihost(self) -> bool:
        return self.nnodes > 1

    @property
    def background_compile(self) -> bool:
        """Serve while compiling: never on many hosts, where every runner must launch the same
        program at the same step (a runner-local "smallest compiled program" could differ between
        hosts and hang the collective: tpu-inference #3486), so each compiles everything first."""
        return self.serve_while_compiling and not self.multihost

    @property
    def restartable(self) -> bool:
        """The supervisor restarts dead actors: not on many hosts (no partial recovery: one host's
        runner cannot rejoin a jax.distributed program; the orchestrator restarts the slice)."""
        return self.supervise and not self.multihost

    @property
    def speculative(self) -> bool:
        return self.speculative_algorithm != "none"

    @property
    def enable_overlap(self) -> bool:
        return not self.disable_overlap_schedule

    @property
    def json_options(self) -> dict[str, Any]:
        """llguidance's JSON compile options from the constrained_json_* flags."""
        if self.constrained_json_disable_any_whitespace:
            return {"whitespace_flexible": False}
        if self.constrained_json_whitespace_pattern is not None:
            return {"whitespace_pattern": self.constrained_json_whitespace_pattern}
        return {}

    def public(self) -> dict[str, Any]:
        """Every option by its flat name, secrets masked (what get_server_info shows)."""
        return {k: "<secret>" if _field(k).metadata.get("secret") and v else v for k, v in flat_fields(self).items()}

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        """One flag per option (but those in `skip`), in one --help group per section: --model-path,
        --page-size, ..., each with its help text and default."""
        for tp, title in SECTIONS.values():
            group = parser.add_argument_group(title)
            hints = _hints(tp)
            for f in dataclasses.fields(tp):
                if f.name not in skip:
                    _add_flag(group, f, hints[f.name])

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        return cls(**{k: getattr(args, k) for k in _OWNER if hasattr(args, k)})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        """Build from keyword options, naming any unknown one (with close matches)."""
        return cls(**kwargs)


def _field(name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(SECTIONS[_OWNER[name]][0]) if f.name == name)


def _add_flag(parser: Any, f: dataclasses.Field, tp: Any) -> None:
    flag = "--" + f.name.replace("_", "-")
    helptext = f"{f.metadata.get('help', '')} (default: {f.default!r})"
    if tp is bool:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=helptext)
        return
    choices = f.metadata.get("choices") or _literal_choices(tp)
    if choices is not None:  # an optional Literal's None is its default, not a flag value
        parser.add_argument(flag, choices=[c for c in choices if c is not None], default=f.default, help=helptext)
        return
    if get_origin(tp) is tuple:  # a list of strings: --flag a b c
        parser.add_argument(flag, nargs="*", type=str, default=f.default, help=helptext)
        return
    base = next((a for a in get_args(tp) if a is not type(None)), tp) if _is_optional(tp) else tp
    parser.add_argument(flag, type=base, default=f.default, help=helptext)


@functools.cache
def _hints(tp: type) -> dict[str, Any]:
    return typing.get_type_hints(tp)


def _literal_choices(tp: Any) -> tuple | None:
    """A Literal's values (an optional Literal's, and None)."""
    if _is_optional(tp):
        inner = [a for a in get_args(tp) if a is not type(None)]
        return (*get_args(inner[0]), None) if len(inner) == 1 and get_origin(inner[0]) is Literal else None
    return get_args(tp) if get_origin(tp) is Literal else None


def _is_optional(tp: Any) -> bool:
    return get_origin(tp) in (typing.Union, types.UnionType) and type(None) in get_args(tp)

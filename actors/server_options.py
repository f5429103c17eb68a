"""The sections of ServerArgs (actors/server_args.py): every option's name, type, default and
help text, one frozen dataclass a section, and the CLI flag each option becomes. ServerArgs
assembles the sections and validates them; nothing here checks a value.

    SECTIONS   attribute -> (the section's type, its --help group's title)
    OWNER      an option's flat name -> its section's attribute (`page_size` -> "memory")
    OPTIONS    every option's flat name (a flag, a keyword)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing
from typing import Any, Literal, get_args, get_origin

from ringserve.model.compute.options import ComputeOptions


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
    max_swa_tokens: int | None = _opt(
        None, "the sliding-window layers' own KV pool in tokens, for models that mix sliding and global layers "
        "(Gemma 2 and 3): their pages wholly outside the window are freed (kvmem/local.py); None: sized at start-up "
        "to every running request's window plus a prefill chunk, where that is less than the global pool "
        "(actors/transport/memory.py); 0: the sliding layers keep every page, in the global pool"
    )
    swa_window: int = _opt(
        0, "the sliding layers' window in tokens: read from the model at start-up with max_swa_tokens (set it by "
        "hand only with max_swa_tokens)"
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
OWNER = {f.name: s for s, (tp, _) in SECTIONS.items() for f in dataclasses.fields(tp)}  # flat name -> section
OPTIONS = frozenset(OWNER)  # every option's flat name (a flag, a keyword)


def option_field(name: str) -> dataclasses.Field:
    """The dataclass field of the option named `name` in its section."""
    return next(f for f in dataclasses.fields(SECTIONS[OWNER[name]][0]) if f.name == name)


def add_flag(parser: Any, f: dataclasses.Field, tp: Any) -> None:
    """Option `f` (of type `tp`) as a flag: a bool --x/--no-x, a Literal its choices, a tuple of
    strings nargs, else its (optional's inner) type."""
    flag = "--" + f.name.replace("_", "-")
    helptext = f"{f.metadata.get('help', '')} (default: {f.default!r})"
    if tp is bool:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=helptext)
        return
    choices = f.metadata.get("choices") or literal_choices(tp)
    if choices is not None:  # an optional Literal's None is its default, not a flag value
        parser.add_argument(flag, choices=[c for c in choices if c is not None], default=f.default, help=helptext)
        return
    if get_origin(tp) is tuple:  # a list of strings: --flag a b c
        parser.add_argument(flag, nargs="*", type=str, default=f.default, help=helptext)
        return
    base = next((a for a in get_args(tp) if a is not type(None)), tp) if is_optional(tp) else tp
    parser.add_argument(flag, type=base, default=f.default, help=helptext)


@functools.cache
def hints(tp: type) -> dict[str, Any]:
    """A section's options' types (its annotations resolved)."""
    return typing.get_type_hints(tp)


def literal_choices(tp: Any) -> tuple | None:
    """A Literal's values (an optional Literal's, and None)."""
    if is_optional(tp):
        inner = [a for a in get_args(tp) if a is not type(None)]
        return (*get_args(inner[0]), None) if len(inner) == 1 and get_origin(inner[0]) is Literal else None
    return get_args(tp) if get_origin(tp) is Literal else None


def is_optional(tp: Any) -> bool:
    return get_origin(tp) in (typing.Union, types.UnionType) and type(None) in get_args(tp)

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

The sections themselves (each option's type, default, help text) and the flags made of them are
in actors/server_options.py; this module assembles them and checks every value.

Nothing mutates a ServerArgs after construction: derived values are properties, and a variant is
made with `dataclasses.replace` (flat names or whole sections). Validation happens once, in
`__post_init__`, and names the field and the limit.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from ringserve.actors.server_options import (
    OWNER,
    SECTIONS,
    LoraOptions,
    MemoryOptions,
    ModelOptions,
    OutputOptions,
    ParallelOptions,
    SchedulingOptions,
    ServingOptions,
    SpeculativeOptions,
    StartupOptions,
    add_flag,
    hints,
    literal_choices,
    option_field,
)
from ringserve.kvmem import cdiv
from ringserve.model.compute.options import ComputeOptions, assemble, flat_fields
from ringserve.model.compute.platform import prefill_step_cost
from ringserve.model.compute.step_inputs import ProgramShapes


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
        section = OWNER.get(name)
        if section is None:
            raise AttributeError(f"ServerArgs has no option {name!r}")
        return getattr(object.__getattribute__(self, section), name)

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        for section, (tp, _) in SECTIONS.items():
            types_ = hints(tp)
            for f in dataclasses.fields(tp):
                v = getattr(getattr(self, section), f.name)
                choices = f.metadata.get("choices") or literal_choices(types_[f.name])
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
        need(self.swa_window >= 0, f"swa_window={self.swa_window}: must be >= 0")
        need(self.max_swa_tokens is None or self.max_swa_tokens >= 0,
             f"max_swa_tokens={self.max_swa_tokens}: must be >= 0 (0: no pool of the sliding layers' own)")  # fmt: skip
        if self.max_swa_tokens and self.swa_window:  # the window is the model's, known once resolved
            need(self.max_swa_tokens >= self.swa_need_tokens,
                 f"max_swa_tokens={self.max_swa_tokens}: must hold every running request's window, a prefill chunk "
                 f"and two pages ({self.swa_need_tokens} tokens for max_running_requests={self.max_running_requests}, "
                 f"swa_window={self.swa_window}, chunked_prefill_size={self.chunked_prefill_size})")  # fmt: skip
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
    def swa_slack(self) -> int:
        """Positions a step may commit as an upper bound and take back (a verify round's drafts,
        twice: one round in flight), which the local pool keeps beyond the window."""
        verify = self.speculative_num_draft_tokens + 1 if self.speculative else 1
        return 2 * max(verify, self.decode_steps)

    @property
    def swa_need_tokens(self) -> int:
        """The local pool that never refuses a reserve (kvmem/local.py): once swept, a slot holds
        the pages of its last window - 1 + slack positions before the step, of what it reserved
        ahead (< slack) and of its share of the step's tokens (all slots together: the largest
        program's), with three pages of rounding; and the sink page."""
        step = max(self.max_extend_tokens, self.max_running_requests * self.swa_slack)
        slot = cdiv(self.swa_window - 1 + 2 * self.swa_slack, self.page_size) + 3
        return (self.max_running_requests * slot + cdiv(step, self.page_size) + 1) * self.page_size

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
            local_pages=(self.max_swa_tokens or 0) // self.page_size,
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
        return {k: "<secret>" if option_field(k).metadata.get("secret") and v else v for k, v in flat_fields(self).items()}

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        """One flag per option (but those in `skip`), in one --help group per section: --model-path,
        --page-size, ..., each with its help text and default."""
        for tp, title in SECTIONS.values():
            group = parser.add_argument_group(title)
            types_ = hints(tp)
            for f in dataclasses.fields(tp):
                if f.name not in skip:
                    add_flag(group, f, types_[f.name])

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        return cls(**{k: getattr(args, k) for k in OWNER if hasattr(args, k)})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        """Build from keyword options, naming any unknown one (with close matches)."""
        return cls(**kwargs)

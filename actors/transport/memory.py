"""How many tokens the KV pool holds: decided once, where the frontend resolves its ServerArgs,
before any actor starts, and handed down as a concrete `max_total_tokens` so the scheduler's books
(kvmem) and the runner's KV arrays (model/runtime/executor.py) agree, and a restart reuses it.

    need    = (max_running_requests x cdiv(context_length, page_size) + 1 sink page) x page_size
              every running request at full context at once: more is never used
    budget  = (mem_fraction_static x memory of one group - weight bytes) // KV bytes per token
              (in the attention backend's layout: model/compute/attention/layout.py)
              memory of one group: CPU, the host's available RAM / dp_size (groups share it);
              GPU/TPU, JAX's bytes_limit x tp_size (weights and KV are sharded over tp)
    pool    = min(need, budget), rounded down to pages       (an explicit max_total_tokens wins)

A model that mixes sliding-window and global layers (Gemma 2 and 3) gives its sliding layers a
pool of their own (kvmem/local.py), `swa_need` = every running request's window plus a prefill
chunk (ServerArgs.swa_need_tokens: such a pool never refuses a reserve), where that is less than
the global pool; the budget then pays the global layers' bytes for the global pool and the
sliding layers' for theirs:

    global x global_bytes + min(swa_need, global) x sliding_bytes <= budget bytes

(an explicit max_swa_tokens wins; 0 turns the local pool off).

SGLang sizes its pool by the fraction alone and derives the running requests from it; ringserve's
running requests and context are flags of their own, so the fraction is a cap and a pool never
outgrows what they can use (`ringserve serve --context-length 512 --max-running-requests 16`
holds 16 x 512 tokens + a page, as llama.cpp's `-c 8192 -np 16` does). On many hosts the pool is
`need` (every host must hold the same pool and only the flags are the same everywhere); each host
checks that it fits its own memory.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ringserve.actors.server_args import ServerArgs
from ringserve.actors.transport.devices import (
    default_fraction,
    device_memory_bytes,
    group_memory_bytes,
    memory_name,
    platform,
)
from ringserve.kvmem import cdiv
from ringserve.model.checkpoints.footprint import Footprint, read_footprint

log = logging.getLogger("ringserve.memory")



@dataclasses.dataclass(frozen=True, slots=True)
class PoolSize:
    """How the KV pool was sized (get_server_info()["kv_pool"], the serve banner)."""

    max_total_tokens: int  # what every actor gets, page-aligned, the sink page included
    sized_by: str  # "max_total_tokens" (given), "need" or "mem_fraction_static"
    need_tokens: int
    budget_tokens: int | None  # None: the memory could not be told (or was not asked)
    kv_bytes_per_token: int
    weight_bytes: int
    group_memory_bytes: int | None  # the memory one group's weights + KV may take a share of
    mem_fraction_static: float
    swa_tokens: int = 0  # the sliding layers' own pool (kvmem/local.py); 0: none, they share the global one
    swa_bytes_per_token: int = 0  # the sliding layers' share of kv_bytes_per_token (with swa_tokens)

    @property
    def kv_bytes(self) -> int:
        if not self.swa_tokens:
            return self.max_total_tokens * self.kv_bytes_per_token
        glob = self.kv_bytes_per_token - self.swa_bytes_per_token
        return self.max_total_tokens * glob + self.swa_tokens * self.swa_bytes_per_token

    def summary(self) -> str:
        gib = 1 << 30
        swa = (f" (the sliding layers' {self.swa_bytes_per_token:,} B in their own pool of {self.swa_tokens:,} tokens)"
               if self.swa_tokens else "")  # fmt: skip
        return (f"{self.max_total_tokens:,} tokens = {self.kv_bytes / gib:.2f} GiB at {self.kv_bytes_per_token:,} B a "
                f"token{swa} (sized by {self.sized_by}: need {self.need_tokens:,}, mem_fraction_static "
                f"{self.mem_fraction_static:g} allows {'?' if self.budget_tokens is None else f'{self.budget_tokens:,}'})")  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, "kv_bytes": self.kv_bytes}


def need_tokens(args: ServerArgs) -> int:
    """Every running request at full context at once, plus the sink page."""
    return (args.max_running_requests * cdiv(args.context_length, args.page_size) + 1) * args.page_size


def size_pool(args: ServerArgs, fp: Footprint, plat: str, group_memory_bytes: int | None) -> PoolSize:
    """The pool for `args` (pure: the memory is given). ValueError naming the fields and the
    numbers when not even one request of context_length plus a page fits."""
    fraction = args.mem_fraction_static or default_fraction(plat)
    kv_token = fp.kv_bytes_per_token(args.dtype, args.attention_backend, plat, args.tp_size)  # the backend's layout
    weights = fp.weight_bytes(args.dtype, args.quantization)
    need = need_tokens(args)
    if args.max_swa_tokens and not fp.sliding_layers:
        raise ValueError(f"max_swa_tokens={args.max_swa_tokens}: the model does not mix sliding-window and global "
                         "layers; leave it unset")  # fmt: skip
    swa_token = fp.kv_bytes_per_token(args.dtype, args.attention_backend, plat, args.tp_size, layers=fp.sliding_layers)
    swa_need = 0
    if fp.sliding_layers and args.max_swa_tokens is None:
        swa_need = args.replace(swa_window=fp.sliding_window).swa_need_tokens
    budget = None
    if group_memory_bytes is not None:
        room = max(0, int(fraction * group_memory_bytes) - weights)
        budget = room // kv_token // args.page_size * args.page_size
        if swa_need:  # the global pool when the sliding layers keep swa_need tokens of their own
            split = (room - swa_need * swa_token) // (kv_token - swa_token) // args.page_size * args.page_size
            budget = split if split > swa_need else budget
    if args.max_total_tokens is not None:
        tokens, by = args.max_total_tokens, "max_total_tokens"
    elif args.multihost or budget is None:
        tokens, by = need, "need"
    else:
        tokens, by = (need, "need") if need <= budget else (budget, "mem_fraction_static")
    swa = args.max_swa_tokens or 0
    if swa_need:  # the sliding layers' own pool where it is smaller than the global one
        swa = swa_need if swa_need < tokens else 0
    least = args.min_pages * args.page_size
    where = (f"mem_fraction_static={fraction:g} x {group_memory_bytes:,} B of "
             f"{memory_name(plat)} - {weights:,} B of weights "
             f"= {budget:,} tokens at {kv_token:,} B a token ({fp.num_layers} layers x {fp.num_kv_heads} KV heads x "
             f"head_dim {fp.head_dim} x K and V, {args.dtype}, in {args.attention_backend} attention's layout)"
             ) if budget is not None else ""  # fmt: skip
    if by == "mem_fraction_static" and tokens < least:
        raise ValueError(f"the KV pool does not fit: {where}, fewer than the {least:,} tokens one request of "
                         f"context_length={args.context_length} plus a page needs; raise mem_fraction_static, "
                         f"lower context_length or set max_total_tokens")  # fmt: skip
    if by == "need" and args.multihost and budget is not None and need > budget:
        raise ValueError(f"max_total_tokens: on many hosts the KV pool is sized by need, max_running_requests="
                         f"{args.max_running_requests} x context_length={args.context_length} = {need:,} tokens, "
                         f"but this host holds {where}; lower them or set max_total_tokens")  # fmt: skip
    return PoolSize(tokens, by, need, budget, kv_token, weights, group_memory_bytes, fraction, swa,
                    swa_token if swa else 0)  # fmt: skip


def group_memory(args: ServerArgs, plat: str, env: Mapping[str, str] | None = None) -> int | None:
    """The memory one data-parallel group's weights and KV share (see the module's map)."""
    one = device_memory_bytes(plat, env)
    return None if one is None else group_memory_bytes(plat, one, args.dp_size, args.tp_size)


def resolve_memory(args: ServerArgs, model_path: str | Path,
                   env: Mapping[str, str] | None = None) -> tuple[ServerArgs, PoolSize]:  # fmt: skip
    """`args` with a concrete max_total_tokens and mem_fraction_static (and the platform's other
    defaults, `ServerArgs.for_platform`), and how the pool was sized. An explicit
    max_total_tokens is kept as it is (the memory is not asked)."""
    fp = read_footprint(model_path)
    plat = platform(os.environ if env is None else env)
    mem = None if args.max_total_tokens is not None else group_memory(args, plat, env)
    pool = size_pool(args, fp, plat, mem)
    if pool.budget_tokens is None and pool.sized_by == "need":
        log.warning("the %s memory could not be told: the KV pool is sized by need alone (%s tokens)",
                    plat, f"{pool.need_tokens:,}")  # fmt: skip
    return args.for_platform(plat).replace(max_total_tokens=pool.max_total_tokens,
                               mem_fraction_static=pool.mem_fraction_static, max_swa_tokens=pool.swa_tokens,
                               swa_window=fp.sliding_window if pool.swa_tokens else args.swa_window), pool  # fmt: skip

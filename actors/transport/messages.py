"""Every message that crosses a process boundary, as msgspec Structs; one tagged union per ring.

    frontend ──ToScheduler──► scheduler ──ToRunner (broadcast)──► runner(s)
                                  ▲ ◄──────── ToSchedulerFromRunner ─┘ (rank 0 only)
                                  └──ToDetokenizer──► detokenizer ──ToFrontend──► frontend

Structs are array_like (no field names on the wire), omit_defaults and gc=False. Token ids,
page ids and per-row numbers travel as little-endian int32 / float32 `bytes` (read back with
`np.frombuffer`, no copy). Nothing is pickled: every ring has a typed decoder below, which
rejects anything that is not one of its union's tags.

A step is columnar (`StepMsg`): one encoding for every row (an extend span, a decode token, a
verify round), per row its slot, the committed length the scheduler expects the runner's mirror
to have, its tokens and the pages appended to its table. A decode row is 21 bytes whatever the
context, so bytes per decode step grow with batch size, never with context length.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from ringserve.actors.server_args import ServerArgs
from ringserve.actors.transport.sampling import SamplingParams
from ringserve.model.compute.step_inputs import DeviceSampling

_S = {"array_like": True, "omit_defaults": True, "gc": False}


def i32(a: Any) -> bytes:
    """int32 little-endian bytes of a sequence or array."""
    return np.ascontiguousarray(a, dtype="<i4").tobytes()


def f32(a: Any) -> bytes:
    return np.ascontiguousarray(a, dtype="<f4").tobytes()


def as_i32(b: bytes) -> np.ndarray:
    return np.frombuffer(b, dtype="<i4")


def as_f32(b: bytes) -> np.ndarray:
    return np.frombuffer(b, dtype="<f4")


def u8(a: Any) -> bytes:
    return np.ascontiguousarray(a, dtype=np.uint8).tobytes()


def as_u8(b: bytes) -> np.ndarray:
    return np.frombuffer(b, dtype=np.uint8)


class TensorRef(msgspec.Struct, **_S):
    """Rows [start, start + nbytes / row bytes) along dim 0 of one HF-named tensor of `shape`
    (all of it, by default), in a shared-memory segment the runner maps (never in the ring).
    `sparse`: the pusher sends only some rows of the tensor (`ringserve.Rows`), the others keep
    their served values; `shape[0]` is then the end of the rows it sent, not the tensor's."""

    name: str
    dtype: str  # numpy dtype name: float32, float16, bfloat16
    shape: list[int]  # the whole tensor's
    segment: str  # posix shared-memory name, mode 0600, unlinked by its creator afterwards
    offset: int
    nbytes: int
    start: int = 0  # first row
    sparse: bool = False


# ---- actor configs (the opaque `config` bytes each actor is spawned with) ---------------------
class StartWeights(msgspec.Struct, **_S):
    """The weights an engine (re)starts serving (actors/frontend/supervisor.py): the runner loads
    `ActorConfig.model_dir`, then these tensors over it (all or nothing: a refusal fails its
    start); the scheduler stamps `version` and counts `updates` from there."""

    version: str = "0"
    updates: int = 0  # weight updates so far (a default version is this count + 1)
    tensors: list[TensorRef] = []


class ActorConfig(msgspec.Struct, **_S):
    args: ServerArgs
    model_dir: str  # resolved local HF-format directory (or .gguf file for the runner)
    tokenizer_dir: str
    eos_ids: list[int] = []
    vocab_size: int = 0
    weights: StartWeights = msgspec.field(default_factory=StartWeights)
    dp_rank: int = 0  # the data-parallel group these actors serve (its row of the load board)


class Resume(msgspec.Struct, **_S):
    """What the caller of a resubmitted request already has (the actors were started again
    under it: actors/frontend/supervisor.py). The scheduler takes `output_ids` as the request's
    output so far, as a retracted request's (max_new_tokens counts them, a stop string may span
    the seam, a grammar's matcher replays them); the detokenizer decodes them again and goes on
    after the `text_len` characters already delivered."""

    output_ids: bytes  # int32
    text_len: int
    cached_tokens: int = 0  # the first run's, reported as it was
    weight_spans: list[tuple[str, int]] = []  # (version, first output index) of the tokens delivered
    spec_verify_ct: int = 0  # speculative verify rounds so far and the drafts they accepted
    spec_accepted: int = 0


# ---- frontend -> scheduler -------------------------------------------------------------------
class GenerateReq(msgspec.Struct, tag="gen", **_S):
    rid: str
    input_ids: bytes  # int32 prompt
    sampling: SamplingParams  # validated by the frontend; sampling_seed always set
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # prompt logprobs from this prompt position (-1: none; needs return_logprob)
    token_ids_logprob: bytes = b""  # int32 token ids whose logprobs every position reports
    stream: bool = False  # outputs every stream_interval tokens; else only the finished one
    session_id: str | None = None  # a streaming session's turn (its input holds the earlier turns)
    resume: Resume | None = None  # resubmitted after a restart: the output its caller already has
    lora_path: str | None = None  # the LoRA adapter's name (SGLang's lora_path); None: the base model
    return_hidden_states: bool = False  # the tokens' last hidden states (needs enable_return_hidden_states)
    return_routed_experts: bool = False  # the tokens' routed experts (needs enable_return_routed_experts)
    routed_experts_start_len: int = 0  # the first prompt position whose routed experts are returned
    cache_salt: str | None = None  # the prefix cache is shared only among requests of equal salts


class AbortReq(msgspec.Struct, tag="abort", **_S):
    rid: str | None = None  # None: every request


class PauseReq(msgspec.Struct, tag="pause", **_S):
    mode: str = "abort"  # abort | retract | in_place


class ContinueReq(msgspec.Struct, tag="continue", **_S):
    pass


class FlushCacheReq(msgspec.Struct, tag="flush", **_S):
    pass


class InfoReq(msgspec.Struct, tag="info", **_S):
    pass


class LoadReq(msgspec.Struct, tag="load", **_S):
    pass


class CloseSessionReq(msgspec.Struct, tag="close_session", **_S):
    session_id: str


class WeightGroup(msgspec.Struct, **_S):
    """SGLang's weight-update group (torch.distributed, the trainer's rank 0 broadcasting): where
    to join it ("group_init": each runner joins as rank `rank_offset` + its index among the
    engine's runners), or the tensors one update broadcasts in order ("group")."""

    group_name: str
    master_address: str = ""
    master_port: int = 0
    rank_offset: int = 0
    world_size: int = 0
    backend: str = "gloo"  # "gloo" (CPU) | "nccl" (GPU)
    names: list[str] = []
    dtypes: list[str] = []  # torch's names without "torch.": float32, bfloat16, float16
    shapes: list[list[int]] = []


class UpdateWeightsReq(msgspec.Struct, tag="update_weights", **_S):
    """Load new weights into the runner(s): from a checkpoint on disk, HF-named tensors in
    shared memory sent in bounded parts under one `update` id (the runner swaps after the last;
    all or nothing), arrays handed over inside this process ("local": a runner in the engine's
    process, by `update` id), or broadcast over an update group ("group"; "group_init" and
    "group_destroy" join and leave one, changing no weight); "abandon" drops update `update`'s
    staged parts (a push that failed half way). Allowed while paused or idle (abandon, group_init
    and group_destroy: always)."""

    # "disk" | "tensor" | "local" | "group" | "group_init" | "group_destroy" | "abandon"
    # | "check" (would one be taken now? nothing changes)
    source: str
    model_path: str = ""
    weight_version: str | None = None
    part: int = 0
    parts: int = 1  # 0 while unknown (a push: its last part is the empty one that says parts)
    tensors: list[TensorRef] = []
    update: str = ""
    group: WeightGroup | None = None
    mode: str = "replace"  # "add": each tensor is its difference from the served one (a delta)
    base_weight_version: str | None = None  # refused unless the engine serves this version


class GetWeightsReq(msgspec.Struct, tag="get_weights", **_S):
    name: str
    truncate_size: int = 100


class MemoryReq(msgspec.Struct, tag="memory", **_S):
    """release_memory_occupation / resume_memory_occupation of the device's KV cache, weights."""

    action: str  # "release" | "resume"
    tags: list[str] = []  # "kv_cache", "weights"


class LoraReq(msgspec.Struct, tag="lora", **_S):
    """load_lora_adapter / unload_lora_adapter. The scheduler gives a loaded adapter a free
    pool slot (refused when none is free, or the name is taken); the runner reads and checks
    the PEFT directory at `path` (the same host) and writes the slot; unloading is refused
    while a request uses the adapter. Allowed while requests run (no pause)."""

    action: str  # "load" | "unload"
    name: str
    path: str = ""


ToScheduler = (
    GenerateReq | AbortReq | PauseReq | ContinueReq | FlushCacheReq | InfoReq | LoadReq | UpdateWeightsReq
    | GetWeightsReq | MemoryReq | CloseSessionReq | LoraReq
)  # fmt: skip


# ---- scheduler -> runners (broadcast) --------------------------------------------------------
class SlotStart(msgspec.Struct, **_S):
    """Sent once when a request slot (re)starts: its cached prefix pages and how it samples."""

    slot: int
    prefix_pages: bytes  # int32
    sampling: DeviceSampling
    logprob_ids: bytes = b""  # int32 the request's token_ids_logprob (logprobs at every position)
    lora_slot: int = 0  # its LoRA adapter's slot in the runner's pool (0: none)
    # a penalized request: its prompt (the first `counts_origin`) and output so far, which the
    # slot's token counts start from (model/runtime/sampler.py); empty otherwise
    counts_ids: bytes = b""  # int32
    counts_origin: int = 0
    prefix_local: bytes = b""  # int32 its local page table (sliding layers' own pages, kvmem/local.py); 0: dropped


class PromptPositions(msgspec.Struct, **_S):
    """The prompt positions a step's extend rows want logprobs at (L rows want some): the
    logprob of the token after each of row `rows[l]`'s tokens [starts[l], starts[l] + counts[l])
    (offsets into the row's tokens), those next tokens given (prompt tokens, known on the host):

        row rows[l]:  tokens [starts[l], starts[l] + counts[l]), targets[cs[l] : cs[l + 1]]
                      (cs: running sums of counts)"""

    rows: bytes  # int32 [L] ascending
    starts: bytes  # int32 [L]
    counts: bytes  # int32 [L]
    targets: bytes  # int32 [sum of counts]


class StepMsg(msgspec.Struct, tag="step", **_S):
    """One batch of R rows, columnar; applied in order: released slots, started slots, rows.

        row r:  slots[r], committed[r], tokens[ts[r]:ts[r+1]], pages[ps[r]:ps[r+1]], keep[r]
                (ts / ps: running sums of token_counts / page_counts)
                local_pages[ps[r]:ps[r+1]]: the local pages appended with them, where the
                sliding layers have their own (kvmem/local.py); empty otherwise

    A token id `-(slot + 1)` (FUTURE) is the token the slot sampled last: the runner reads it from
    the FutureMap on device. Extend rows carry ids, a decode row is [FUTURE], a verify round
    (`drafts` = k > 0: every row of the step is one) is [FUTURE, k drafts] with NO_DRAFT (-1)
    pads; its committed length is the scheduler's bound (its rounds in flight counted as all
    accepted), and every one of its positions is sampled. A multi-step decode (`multistep`) is
    laid out as verify rounds of NO_DRAFT places, each row 1 + drafts decode steps the device
    runs one after another: its committed length is exact. `keep[r]` = 0: a middle prefill chunk,
    whose sample is discarded. Result rows come back in this order.

    Grammar masks travel only for constrained rows (M of them; k1 = 1 + drafts masks each, one
    per sampled position; W = ceil(V / 32) int32 words, bit t % 32 of word t // 32 allows token t):

        masked row m:  row mask_rows[m], masks[m * k1 * W : (m + 1) * k1 * W] as [k1, W]

    Prompt logprobs travel only in a step with extend rows that want them (`prompt`, else None:
    one byte; see PromptPositions)."""

    step_id: int
    released: bytes = b""  # int32 slots freed since the previous step (applied first)
    starts: list[SlotStart] = []  # slots (re)starting this step (applied before the rows)
    slots: bytes = b""  # int32 [R]
    committed: bytes = b""  # int32 [R] KV tokens written before the row (a verify round: a bound)
    token_counts: bytes = b""  # int32 [R]
    tokens: bytes = b""  # int32 [sum of token_counts]
    page_counts: bytes = b""  # int32 [R] pages appended to each row's table
    pages: bytes = b""  # int32 [sum of page_counts]
    keep: bytes = b""  # uint8 [R]: 1 = the row's sample is kept (0: a middle prefill chunk)
    drafts: int = 0  # k: the rows are verify rounds of 1 + k tokens; 0: plain rows
    mask_rows: bytes = b""  # int32 [M] rows whose samples a grammar constrains (ascending)
    masks: bytes = b""  # int32 [M, 1 + drafts, W] their allowed tokens, packed bits
    prompt: PromptPositions | None = None  # the prompt positions whose logprobs rows want
    multistep: bool = False  # the rows are 1 + drafts decode steps run one after another (exact lengths)
    local_pages: bytes = b""  # int32 [sum of page_counts] the sliding layers' pages appended (or empty)


class RunnerShutdown(msgspec.Struct, tag="shutdown", **_S):
    pass


class RunnerWeights(msgspec.Struct, tag="weights", **_S):
    """Forwarded UpdateWeightsReq (after every earlier step; the runner answers RunnerReply)."""

    update: UpdateWeightsReq


class RunnerGetWeights(msgspec.Struct, tag="get_weights", **_S):
    request: GetWeightsReq


class RunnerMemory(msgspec.Struct, tag="memory", **_S):
    request: MemoryReq


class RunnerStatus(msgspec.Struct, tag="status", **_S):
    """Asks for the step programs' compile status (RunnerReply payload: JSON)."""


class RunnerLora(msgspec.Struct, tag="lora", **_S):
    """Load the PEFT adapter at `path` into pool slot `slot` (read and checked whole first: a
    refusal leaves the slot as it was), or unload: clear `slot`."""

    action: str  # "load" | "unload"
    name: str
    slot: int
    path: str = ""


ToRunner = StepMsg | RunnerShutdown | RunnerWeights | RunnerGetWeights | RunnerMemory | RunnerStatus | RunnerLora


# ---- runner -> scheduler ---------------------------------------------------------------------
class MoreLogprobs(msgspec.Struct, **_S):
    """Logprobs beyond the sampled tokens' own and their top-n, present only where a request asked
    (a StepResultMsg: the step's; a TokenOut: one request's):

        ids_logprobs        f32 [tokens, ids_n]  token_ids_logprob at each sampled (output) token
        input_logprobs      f32 [P]              prompt positions: the logprob of the next token
        input_top_ids       int32 [P, top_n]     (top_n: the enclosing message's)
        input_top_logprobs  f32 [P, top_n]
        input_ids_logprobs  f32 [P, ids_n]       token_ids_logprob at each prompt position

    In a result the P positions are the step's PromptPositions, row after row; in a TokenOut
    they are the request's positions from logprob_start_len on, sent once."""

    ids_n: int = 0  # token_ids_logprob columns (the program's K in a result; the request's in a TokenOut)
    ids_logprobs: bytes = b""
    input_logprobs: bytes = b""
    input_top_ids: bytes = b""
    input_top_logprobs: bytes = b""
    input_ids_logprobs: bytes = b""


class StepResultMsg(msgspec.Struct, tag="result", **_S):
    step_id: int
    tokens: bytes  # int32 [rows * k1], row after row (k1 = 1 + the step's drafts)
    logprobs: bytes = b""  # f32, one per token
    top_ids: bytes = b""  # int32 [tokens, top_n]
    top_logprobs: bytes = b""  # f32 [tokens, top_n]
    top_n: int = 0
    accepted: bytes = b""  # a verify step: int32 [R] drafts accepted per round (tokens: [R * (k + 1)] targets)
    more: MoreLogprobs | None = None  # token_ids_logprob / prompt positions, when some row wanted them
    forward_s: float = 0.0  # device time of this step as the runner saw it
    trace_count: int = 0  # step programs traced so far (constant while serving: nothing recompiles)
    programs_compiled: int = 0  # step programs compiled so far (others may compile in the background)
    programs_pending: int = 0  # step programs still compiling in the background
    compile_error: str = ""  # why the background compile stopped, if it failed
    times: bytes = b""  # f64 runner stamps when ServerArgs.step_trace is on (actors/transport/trace.py)
    # the set each sample was drawn from, for the rows that asked (return_top_p_token_ids):
    # sample s's ids are kept_ids[ks[s] : ks[s + 1]] (ks: running sums of kept_counts, 0 elsewhere)
    kept_counts: bytes = b""  # int32 [tokens]
    kept_ids: bytes = b""  # int32
    # the last hidden states of every token of the rows that asked (return_hidden_states), row
    # after row: hidden_rows[r] of them for row r (its tokens in order; 0 for the others)
    hidden_rows: bytes = b""  # int32 [R]
    hidden: bytes = b""  # f32 [sum of hidden_rows, hidden_dim]
    hidden_dim: int = 0
    # likewise their routed expert ids (return_routed_experts, actors/transport/routed.py):
    # routed_rows[r] tokens' [M, k] ids for row r, as uint8 (itemsize 1) or int16 (2)
    routed_rows: bytes = b""  # int32 [R]
    routed: bytes = b""  # [sum of routed_rows, M, k]
    routed_shape: tuple[int, int] = (0, 0)  # (M, k): MoE layers, experts per token
    routed_itemsize: int = 0


class RunnerReply(msgspec.Struct, tag="reply", **_S):
    """The runner's answer to a control message (weights, memory)."""

    ok: bool
    message: str = ""
    payload: bytes = b""  # JSON, or raw little-endian f32 values (get_weights)
    shape: list[int] = []


ToSchedulerFromRunner = StepResultMsg | RunnerReply


# ---- scheduler -> detokenizer -> frontend ----------------------------------------------------
class TokenOut(msgspec.Struct, **_S):
    rid: str
    new_ids: bytes  # int32 output ids since the last TokenOut of this request
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    finished: bool = False
    finish_reason: dict[str, Any] | None = None
    logprobs: bytes = b""  # f32 per new id
    top_ids: bytes = b""  # int32 [new, top_n]
    top_logprobs: bytes = b""  # f32 [new, top_n]
    top_n: int = 0
    more: MoreLogprobs | None = None  # the request's token_ids_logprob / prompt logprobs, if asked
    open: SamplingParams | None = None  # on the request's first output: how to detokenize it
    resume: Resume | None = None  # with `open`, for a resubmitted request: the text to go on from
    first_token_at: float = 0.0  # on the output carrying the first token: the scheduler's
    # time.perf_counter() when it arrived (CLOCK_MONOTONIC: comparable across processes)
    weight_version: str = ""  # the weights that produced these tokens
    weight_versions: list[tuple[str, int]] = []  # once there are several: (version, first output index), all so far
    spec_verify_ct: int = 0  # on the finish, with speculative decoding: verify rounds
    spec_accepted: int = 0  # and the drafts they accepted
    # on the finish, what the request asked to read back: the set each output token was drawn
    # from (token i's: kept_ids[offsets[i] : offsets[i + 1]]; a token from before a restart: an
    # empty set), and the last hidden states of its prompt's and output's positions but the last
    kept_ids: bytes = b""  # int32
    kept_offsets: bytes = b""  # int32 [completion_tokens + 1]
    hidden: bytes = b""  # f32 [positions, hidden_dim]
    hidden_dim: int = 0
    hidden_prompt: int = 0  # the first this many are the prompt's positions
    # and the expert ids its positions [routed_experts_start_len, fill_len - 1) were routed to
    routed: bytes = b""  # [positions, M, k] as uint8 (itemsize 1) or int16 (2)
    routed_shape: tuple[int, int] = (0, 0)  # (M, k)
    routed_itemsize: int = 0


class BatchTokenOut(msgspec.Struct, tag="tokens", **_S):
    outs: list[TokenOut]


class ControlReply(msgspec.Struct, tag="reply", **_S):
    """Answer to a control request (pause, continue, flush, info, abort), passed through the
    detokenizer so it arrives after every output the scheduler sent before it."""

    kind: str
    ok: bool = True
    message: str = ""
    payload: bytes = b""  # JSON (server info, load), or raw f32 values (get_weights)
    shape: list[int] = []


ToDetokenizer = BatchTokenOut | ControlReply


class BatchStrOut(msgspec.Struct, tag="strs", **_S):
    """The scheduler's TokenOuts as they came, each with its new text (same order)."""

    outs: list[TokenOut]
    texts: list[str]  # new text of outs[i] since its previous output


ToFrontend = BatchStrOut | ControlReply


# ---- codecs: one encoder, one typed decoder per ring -----------------------------------------
encode = msgspec.msgpack.Encoder().encode

to_scheduler = msgspec.msgpack.Decoder(ToScheduler)
to_runner = msgspec.msgpack.Decoder(ToRunner)
from_runner = msgspec.msgpack.Decoder(ToSchedulerFromRunner)
to_detokenizer = msgspec.msgpack.Decoder(ToDetokenizer)
to_frontend = msgspec.msgpack.Decoder(ToFrontend)
actor_config = msgspec.msgpack.Decoder(ActorConfig)

"""Host side of a step: turn per-request rows into padded, bucketed device inputs (no JAX here).

One row model (vLLM v1's "no prefill or decode phase"): a `DeviceRow` is one request's work in
one step, as the device sees it: its new tokens (`extend_len` of them), the position of the first
one (`committed_len`: tokens whose KV is already written), its page table covering
`committed_len + extend_len` tokens, and its `DeviceSampling`. The three kinds are shapes of it:

    extend row    a span of known ids (a prompt, or one chunk of it)
    decode row    one token, FUTURE(slot) = -(slot + 1): the token the slot sampled last,
                  read from the FutureMap on device (so the host never waits for it)
    verify round  FUTURE(slot) then k drafts (NO_DRAFT = -1 pads): k + 1 tokens, all sampled
    multi-step    laid out as a verify round of k + 1 NO_DRAFT places: k + 1 decode steps run
                  one after another on the device, each step's sample the next one's input

Flat token layout: the rows' new tokens packed densely in row order, then padding up to the
program's T (two rows of 6 and 1 tokens, T = 8):

    token:     a0 a1 a2 a3 a4 a5 b0 --
    row_start: 0                 6  7   (7 repeated for the padding rows up to R)
    sample:                   a5 b0     sample_idx = [5, 6, 0, ...]: each row's last k1 tokens

Every row samples its last `k1` tokens, row after row (sample_idx [R * k1]); k1 is static per
program: 1, or k + 1 in a verify program (speculative decoding), whose rows are rounds of
exactly k + 1 tokens. Results are the first `num_rows * k1` samples, in row order.

With a local page space (ProgramShapes.local_pages > 0: Gemma's sliding layers keep only the
pages near their window, model/compute/attention/base.py) a row also carries `local_pages`,
its sliding layers' page table in that space, indexed as `pages` (page i covers positions
[i * page_size, (i + 1) * page_size)); the batch gets it and its tokens' `local_out_loc`.
Entries of pages wholly before every query's window may be stale: the backends never write
there and mask what they read there.

Padding tokens write KV to token location 0 (the sink page) and padding rows are ignored.
Decode programs have one token per row (T = R, query block 1); extend programs take up to
max_batch rows over T packed tokens (query block = extend_block, the attention tile).

A verify round's `committed_len` is the scheduler's bound on the slot's length (its rounds in
flight counted as all accepted); the device moves positions, token locations and kv_len down to
the FutureMap's true position before the layers run (model/runtime/step.py).

A row a grammar constrains carries `mask` ([k1, W] int32 packed bits, W = ceil(V / 32), one
mask per sampled position); the step's `RowSampling.mask` is [R * k1, W], every other sample's
mask all ones, or None when no row is constrained (the executor then passes its all-ones array
already on device; `any_mask` False makes the sampler skip the masking).

Prompt logprobs are computed by the extend steps that already run, from the same hidden states
(no second pass): a row may want the logprob of the token that follows some of its tokens
(`logprob_start`, `logprob_targets`: row tokens [start, start + n) and the token after each;
for a middle chunk's last token that is the next chunk's first). The step packs those
positions row after row into `LogprobBatch` (flat token index, target, row), P entries; the
device computes the first `count` of them in a loop whose trip count is the real positions,
under a conditional, so an extend step that wants none pays one test. P is the program's T for extend programs and
0 for decode and verify programs (`Buckets.positions`): their rows never carry prompt
positions (a step of one-token rows that wants some is given an extend program), so their
LogprobBatch has no position fields at all. A row's `logprob_ids` (token_ids_logprob, at most
K) get their logprobs at every sampled token and every wanted prompt position.

    row a (extend, tokens a0..a5, logprob_start 2, targets [a3 a4 a5 x]), row b (no logprobs):
    token:     a0 a1 a2 a3 a4 a5 b0 --
    index:     2  3  4  5  0  0  0  0     target: a3 a4 a5 x 0 ...   row: 0 0 0 0 0 ...   count: 4
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec
import numpy as np

from ringserve.kvmem.allocator import cdiv

Arr = Any  # jax.Array on device; np.ndarray while the host builds it


@dataclasses.dataclass(frozen=True, slots=True)
class ProgramShapes:
    """What the compiled step programs hold, derived once from the server's options
    (ServerArgs.program_shapes, actors/server_args.py): the scheduler plans within them and the
    executor compiles them."""

    page_size: int = 16
    num_pages: int = 2048  # including the sink page 0
    local_pages: int = 0  # pages of each sliding layer's own space, sink included (mixed models); 0: none
    max_context_len: int = 4096
    max_batch: int = 64  # largest decode bucket (= max running requests)
    max_extend_tokens: int = 1024  # largest extend bucket, in packed tokens
    top_logprobs_num: int = 0  # N of the top-N logprobs every step returns (0 = off)
    token_ids_logprob_num: int = 0  # K: token_ids_logprob a row may ask for (every step takes K per row)
    verify_tokens: int = 0  # speculative decoding: tokens per verify round (k + 1); 0 = off
    decode_steps: int = 1  # multi-step decode: decode steps a program runs one after another (1 = off)
    decode_steps_rows: int = 4  # multi-step decode programs for decode batches of up to this many rows
    processed_logprobs: bool = False  # logprobs of the distribution sampled from (else the model's: raw)
    hidden_states: bool = False  # every program returns its tokens' last hidden states (return_hidden_states)
    routed_experts: bool = False  # every program returns its tokens' routed expert ids (return_routed_experts)

    @property
    def max_pages(self) -> int:
        """Page-table width: pages of the longest context."""
        return cdiv(self.max_context_len, self.page_size)


class StepShape(NamedTuple):
    """The static shape of one compiled step program."""

    block: int  # query tile: 1 for decode programs (one token per row), extend_block otherwise
    tokens: int  # T: padded new tokens
    rows: int  # R: padded rows (requests); every row samples its last max(1, verify) tokens
    context: int = 0  # context bucket (longest kv_len) for backends with static loops; 0 = any
    verify: int = 0  # a verify program (speculative decoding): tokens per round (k + 1); 0 = not
    multistep: bool = False  # a multi-step decode program: `verify` decode steps one after another


BAN_IDS = 32  # stop ids a row may have banned until its min_new_tokens (EOS ids + stop_token_ids)
BIAS_IDS = 64  # logit_bias entries a row may have


class DeviceSampling(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    """What the device samples a request with; sent once per request slot (the runner's slot
    mirror keeps it). Made from a request's SamplingParams by `SamplingParams.device()`."""

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    logprobs: bool = True  # the sampled tokens' logprobs (and token_ids_logprob's) are read
    top_logprobs: bool = True  # their top-n logprobs are read (n: the programs' top_n)
    repetition_penalty: float = 1.0  # over the prompt's and output's tokens (1: off)
    frequency_penalty: float = 0.0  # per occurrence in the output (0: off)
    presence_penalty: float = 0.0  # once per token the output holds (0: off)
    min_until: int = 0  # a token sampled at a position below this is never one of `ban` (min_new_tokens)
    ban: tuple[int, ...] = ()  # the stop ids min_new_tokens holds back (EOS ids unless ignored, stop_token_ids)
    bias_ids: tuple[int, ...] = ()  # logit_bias: token ids
    bias: tuple[float, ...] = ()  # and what is added to their logits
    kept: bool = False  # the set each token was drawn from is read back (return_top_p_token_ids)
    hidden: bool = False  # the tokens' last hidden states are read back (return_hidden_states)
    routed: bool = False  # the tokens' routed expert ids are read back (return_routed_experts)

    @property
    def penalized(self) -> bool:
        """Whether a penalty reads the slot's token counts (model/runtime/sampler.py)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


@dataclasses.dataclass(slots=True)
class DeviceRow:
    token_ids: np.ndarray  # [extend_len] int32 (negative: future slot -(id) - 1)
    committed_len: int  # KV tokens already written before this step = position of token_ids[0]
    pages: np.ndarray  # int32 page table covering committed_len + extend_len tokens
    sampling: DeviceSampling = DeviceSampling()
    future_slot: int = -1  # request slot whose future entry receives the sampled token; -1: sink
    mask: np.ndarray | None = None  # [k1, W] int32 allowed tokens of each sampled position (a grammar)
    logprob_start: int = 0  # first of the row's tokens whose next token's logprob is wanted (prompt logprobs)
    logprob_targets: np.ndarray | None = None  # int32 [n]: the token after each of tokens [start, start + n)
    logprob_ids: np.ndarray | None = None  # int32 [<= K] token_ids_logprob of the request
    lora_slot: int = 0  # the request's LoRA adapter slot in the pool (model/weights/lora.py); 0 = none
    # int32 page table of the sliding layers' own space (ProgramShapes.local_pages > 0), indexed as
    # `pages`; entries of pages wholly before every query's window may be stale (another's page)
    local_pages: np.ndarray | None = None

    @property
    def extend_len(self) -> int:
        return len(self.token_ids)


class ForwardBatch(NamedTuple):
    """Device inputs of one step: T packed tokens (padding included), R rows."""

    input_ids: Arr  # [T] int32; a negative id -i reads future slot i-1 (overlap scheduling)
    positions: Arr  # [T] int32
    out_loc: Arr  # [T] int32 token location to write (0 = sink for padding)
    row_start: Arr  # [R + 1] int32 row r owns tokens row_start[r]:row_start[r+1] (cu_q_lens)
    kv_len: Arr  # [R] int32 committed_len + extend_len (KV valid after this step); 0 = padding
    pages: Arr  # [R, max_pages] int32 page table of each row
    num_rows: Arr  # [1] int32 real rows
    sample_idx: Arr  # [R * k1] int32 flat index of each row's last k1 tokens (k1 = max(1, verify))
    sample_slot: Arr  # [R] int32 future slot that receives the row's sampled token (sink = last)
    attn: dict[str, Arr]  # the attention backend's own per-step inputs (its `plan`)
    # with a local page space (ProgramShapes.local_pages > 0; else None): the sliding layers'
    local_pages: Arr = None  # [R, max_pages] int32 page table of each row (stale before the window)
    local_out_loc: Arr = None  # [T] int32 token location to write (0 = sink for padding)


class RowSampling(NamedTuple):
    """How each row samples (a step program's input; the step expands it per sampled token)."""

    temperature: Arr  # [R] f32, 0 = greedy
    top_k: Arr  # [R] i32, <= 0 = off
    top_p: Arr  # [R] f32 in (0, 1], 1 = off
    min_p: Arr  # [R] f32 in [0, 1], 0 = off
    seed: Arr  # [R] u32
    any_random: Arr  # [] bool: some row has temperature > 0
    any_filter: Arr  # [] bool: some row uses top-k / top-p / min-p
    mask: Arr = None  # [R * k1, W] int32 allowed tokens per sample (packed bits); None: no row constrained
    any_mask: Arr = False  # [] bool: some row is constrained
    any_logprobs: Arr = True  # [] bool: some row's sampled logprobs are read (else not computed)
    any_top: Arr = True  # [] bool: some row's top-n logprobs are read (else not computed)
    repetition: Arr = None  # [R] f32 repetition penalty (1 = off)
    frequency: Arr = None  # [R] f32 frequency penalty (0 = off)
    presence: Arr = None  # [R] f32 presence penalty (0 = off)
    any_penalty: Arr = False  # [] bool: some row is penalized (else the token counts are not read)
    min_until: Arr = None  # [R] i32 a sample at a position below it is none of the row's `ban`
    ban: Arr = None  # [R, BAN_IDS] i32 stop ids held back (-1 pads); None: no row holds any back
    bias_ids: Arr = None  # [R, BIAS_IDS] i32 logit_bias ids (-1 pads); None: no row biases
    bias: Arr = None  # [R, BIAS_IDS] f32 what is added to them
    any_adjust: Arr = False  # [] bool: some row holds stop ids back or biases (else `ban`, `bias` unread)
    any_kept: Arr = False  # [] bool: some row reads back the set each sample was drawn from


class LogprobBatch(NamedTuple):
    """What the step computes logprobs of beyond the samples (see the module docstring). The
    position fields are None in a program that takes no prompt positions (P = 0)."""

    ids: Arr  # [R, K] int32 each row's token_ids_logprob (padding: 0; K compiled, may be 0)
    index: Arr = None  # [P] int32 flat token index of each wanted prompt position (padding: 0)
    target: Arr = None  # [P] int32 the token whose logprob is wanted there
    row: Arr = None  # [P] int32 the position's row (its token_ids_logprob)
    count: Arr = None  # [] int32 real positions (the first `count` entries)


class SamplingBatch(NamedTuple):
    """The sampler's input: one entry per sampled token (model/runtime/sampler.py)."""

    temperature: Arr  # [S] f32, 0 = greedy
    top_k: Arr  # [S] i32, <= 0 = off
    top_p: Arr  # [S] f32 in (0, 1], 1 = off
    min_p: Arr  # [S] f32 in [0, 1], 0 = off
    seed: Arr  # [S] u32
    position: Arr  # [S] i32 position of the token being sampled (its seed's counter)
    any_random: Arr  # [] bool: some row has temperature > 0
    any_filter: Arr  # [] bool: some row uses top-k / top-p / min-p
    mask: Arr = None  # [S, W] int32 allowed tokens (packed bits, all ones: any); None: none compiled in
    any_mask: Arr = False  # [] bool: some sample is constrained (else the mask is not applied)
    logprob_ids: Arr = None  # [S, K] int32 token ids whose logprobs each sample reports; None: K = 0
    any_logprobs: Arr = True  # [] bool: some sample's logprobs are read (else they are zeros)
    any_top: Arr = True  # [] bool: some sample's top-n logprobs are read (else zeros)
    # penalties, min_new_tokens and logit_bias (RowSampling's, per sample); `slot` is the row
    # whose token counts the penalties read, `prior` a verify round's drafts before the sample
    # (counted as output: the sample is kept only if they are accepted), -1 pads
    repetition: Arr = None  # [S] f32
    frequency: Arr = None  # [S] f32
    presence: Arr = None  # [S] f32
    any_penalty: Arr = False
    slot: Arr = None  # [S] i32
    prior: Arr = None  # [S, k1 - 1] i32; None outside verify programs
    min_until: Arr = None  # [S] i32
    ban: Arr = None  # [S, BAN_IDS] i32
    bias_ids: Arr = None  # [S, BIAS_IDS] i32
    bias: Arr = None  # [S, BIAS_IDS] f32
    any_adjust: Arr = False
    any_kept: Arr = False


def _pow2_up_to(lo: int, hi: int) -> tuple[int, ...]:
    out, x = [], lo
    while x < hi:
        out.append(x)
        x *= 2
    out.append(hi)
    return tuple(sorted(set(out)))


class NoProgramYet(RuntimeError):
    """No compiled program holds the step yet (`Buckets.pick` given the compiled ones, while
    the rest compile in the background); `smallest` is the shape that would hold it best."""

    def __init__(self, message: str, smallest: StepShape):
        super().__init__(message)
        self.smallest = smallest


@dataclasses.dataclass(frozen=True, slots=True)
class Buckets:
    """The padded shapes compiled up front (context buckets are the attention backend's)."""

    decode_batches: tuple[int, ...]  # T = R for block 1
    extend_tokens: tuple[int, ...]  # T values for block = extend_block, R = max_rows
    extend_block: int
    max_rows: int  # rows of an extend program (= the largest decode batch)

    @staticmethod
    def make(max_batch: int, max_extend_tokens: int, extend_block: int, decode_step: int = 0) -> Buckets:
        """Decode batches: powers of two from 2 up to 2 x `decode_step`, then every `decode_step`
        up to `max_batch` (SGLang's CUDA graph sizes; 0: powers of two all the way). A step of
        `n` rows runs in the smallest that holds it; padding rows cost as much as real ones in
        the matmuls, so powers of two alone waste a quarter of a large batch on average (SmolLM2's
        64-request burst on CPU, bf16: decode 25.8 -> 23.5 s with steps of 8)."""
        if max_extend_tokens % extend_block:
            raise ValueError(
                f"max_extend_tokens={max_extend_tokens} must be a multiple of extend_block={extend_block}"
            )
        # No 1-token program: with T == 1, XLA CPU rewrites the KV scatter into a form that
        # copies every layer's whole cache each step (measured: 89 ms vs 2.6 ms at T == 2).
        dec = _pow2_up_to(min(2, max_batch), max_batch)
        if decode_step > 0:
            dec = tuple(sorted({b for b in dec if b <= 2 * decode_step} | set(range(2 * decode_step, max_batch, decode_step))
                               | {max_batch}))  # fmt: skip
        return Buckets(
            dec,
            _pow2_up_to(extend_block, max_extend_tokens),
            extend_block,
            max_batch,
        )

    def shapes(self, verify: int = 0, steps: int = 0, steps_rows: int = 0) -> list[StepShape]:
        """Every program shape (once); with `verify` (k + 1 > 0) also the verify programs, up
        to max_rows rounds; with `steps` (> 1) the multi-step decode programs that hold up to
        `steps_rows` rows."""
        return list(dict.fromkeys(s for family in self.families(verify, steps, steps_rows) for s in family))

    def families(self, verify: int = 0, steps: int = 0, steps_rows: int = 0) -> list[list[StepShape]]:
        """The shapes by kind (decode, extend, verify, multi-step decode), each ascending: a
        kind's last shape holds any step of that kind. (With extend_block 1 a decode shape may
        also be an extend one.)"""
        dec = [StepShape(1, nb, nb) for nb in self.decode_batches]
        ext = [StepShape(self.extend_block, t, self.max_rows) for t in self.extend_tokens]
        ver = []
        if verify:
            for t in self.extend_tokens:
                ver.append(StepShape(self.extend_block, t, self.max_rows, verify=verify))
                if t >= self.max_rows * verify:
                    break
        multi = []
        if steps > 1:  # the decode batches up to the first that holds steps_rows rows
            last = next((nb for nb in self.decode_batches if nb >= steps_rows), self.decode_batches[-1])
            multi = [self.multistep_shape(nb, steps) for nb in self.decode_batches if nb <= last]
        return [f for f in (dec, ext, ver, multi) if f]

    @staticmethod
    def multistep_shape(rows: int, steps: int) -> StepShape:
        """A multi-step decode program: `rows` rows of `steps` tokens (FUTURE, then NO_DRAFT
        places), laid out as verify rounds are, each sampled in turn."""
        return StepShape(1, rows * steps, rows, verify=steps, multistep=True)

    def positions(self, shape: StepShape) -> int:
        """P: the prompt positions a program of `shape` can compute logprobs at: T for an extend
        program, 0 for decode and verify programs (with extend_block 1 a decode shape may be an
        extend one: then every program takes them)."""
        if shape.verify or (shape.block == 1 and self.extend_block != 1):
            return 0
        return shape.tokens

    def fits(self, is_decode: bool, n_rows: int, n_tokens: int, verify: int = 0,
             multistep: bool = False) -> list[StepShape]:  # fmt: skip
        """The shapes holding the step, smallest first; ValueError past the largest."""
        if verify and not multistep:
            return [s._replace(verify=verify) for s in self._extend_fits(n_rows, n_tokens)]
        if not is_decode and not multistep:
            return self._extend_fits(n_rows, n_tokens)
        batches = [nb for nb in self.decode_batches if nb >= n_rows]
        if not batches:
            raise ValueError(f"decode batch of {n_rows} requests exceeds the largest bucket {self.decode_batches[-1]}")
        return [self.multistep_shape(nb, verify) if multistep else StepShape(1, nb, nb) for nb in batches]

    def pick(
        self, is_decode: bool, n_rows: int, n_tokens: int, verify: int = 0, ok: Callable[[StepShape], bool] | None = None
    ) -> StepShape:
        """Smallest shape holding the step (and, given `ok`, accepted by it: the compiled ones,
        while the rest compile in the background); ValueError past the largest."""
        return _first_ok(self.fits(is_decode, n_rows, n_tokens, verify), ok)

    def _extend_fits(self, n_rows: int, n_tokens: int) -> list[StepShape]:
        if n_rows > self.max_rows:
            raise ValueError(f"extend step of {n_rows} rows exceeds max_batch={self.max_rows}")
        fits = [StepShape(self.extend_block, t, self.max_rows) for t in self.extend_tokens if t >= n_tokens]
        if not fits:
            raise ValueError(
                f"extend step of {n_tokens} tokens exceeds the largest bucket {self.extend_tokens[-1]} "
                "(chunk the prefill)"
            )
        return fits


def _first_ok(fits: list[StepShape], ok: Callable[[StepShape], bool] | None) -> StepShape:
    """The first of `fits` that `ok` accepts (any, without `ok`); NoProgramYet naming the smallest."""
    for s in fits:
        if ok is None or ok(s):
            return s
    raise NoProgramYet(f"no compiled program holds a step of shape {fits[0]} or larger", fits[0])


@dataclasses.dataclass(slots=True)
class HostBatch:
    shape: StepShape
    smallest: StepShape  # the smallest shape holding the step (`shape` unless `ok` refused it)
    forward: ForwardBatch  # NumPy arrays (attn filled in by the executor's backend)
    sampling: RowSampling  # NumPy arrays
    num_samples: int  # real samples: rows * k1, row after row (the first entries of the step's samples)
    logprob: LogprobBatch  # NumPy arrays; None fields where the executor passes its zeros on device
    num_positions: int = 0  # real prompt-logprob positions (row after row, each row's in order)
    lora_slot: np.ndarray | None = None  # [R] int32 each row's LoRA adapter slot (0: none; padding rows 0)

    @property
    def max_kv_len(self) -> int:
        return int(self.forward.kv_len.max())


def build_batch(
    rows: list[DeviceRow],
    buckets: Buckets,
    page_size: int,
    max_pages: int,
    sink_slot: int,
    verify: int = 0,
    ok: Callable[[StepShape], bool] | None = None,
    logprob_ids: int = 0,
    multistep: bool = False,
    local: bool = False,
) -> HostBatch:
    """`verify` = k + 1: the rows are verify rounds of that many tokens (sampled at each), or
    with `multistep` that many decode steps run one after another on the device; `ok`: which
    shapes may be picked (default: any); `logprob_ids`: K, the token_ids_logprob columns
    compiled in; `local`: the programs have a local page space (every row carries its
    `local_pages`, the batch its local table and token locations)."""
    if multistep and not verify:
        raise ValueError("a multi-step decode names its steps (verify = steps)")
    if not rows:
        raise ValueError("empty batch")
    ext = np.fromiter((r.extend_len for r in rows), np.int64, len(rows))
    if (ext < 1).any():
        raise ValueError("every row needs at least one new token")
    if verify and (ext != verify).any():
        raise ValueError(f"a verify step's rows are rounds of {verify} tokens, got {sorted(set(ext.tolist()))}")
    wants_positions = any(r.logprob_targets is not None and len(r.logprob_targets) for r in rows)
    if wants_positions and verify:
        raise ValueError("a verify step's rows carry no prompt positions")
    is_decode = bool((ext == 1).all()) and not verify and not wants_positions
    fits = buckets.fits(is_decode, len(rows), int(ext.sum()), verify, multistep)
    shape = _first_ok(fits, ok)
    t, nr, k1 = shape.tokens, shape.rows, max(1, verify)
    n = len(rows)
    committed = np.fromiter((r.committed_len for r in rows), np.int64, n)
    kv_len = committed + ext
    need_pages = cdiv(kv_len, page_size)
    if (need_pages > max_pages).any():
        i = int(np.argmax(need_pages > max_pages))
        raise ValueError(f"row of {kv_len[i]} tokens exceeds the context limit of {max_pages * page_size}")
    start = np.zeros(nr + 1, np.int32)
    start[1 : n + 1] = np.cumsum(ext)
    start[n + 1 :] = start[n]
    total = int(start[n])
    pages = np.zeros((nr, max_pages), np.int32)
    ids = np.zeros(t, np.int32)
    for i, r in enumerate(rows):
        if len(r.pages) < need_pages[i]:
            raise ValueError(f"row needs {need_pages[i]} pages for {kv_len[i]} tokens, got {len(r.pages)}")
        pages[i, : need_pages[i]] = r.pages[: need_pages[i]]
        ids[start[i] : start[i + 1]] = r.token_ids
    tok_row = np.repeat(np.arange(n), ext)
    pos = np.zeros(t, np.int32)
    pos[:total] = committed[tok_row] + (np.arange(total) - start[tok_row])
    loc = np.zeros(t, np.int32)
    p = pos[:total].astype(np.int64)
    loc[:total] = pages[tok_row, p // page_size].astype(np.int64) * page_size + p % page_size
    local_pages = local_loc = None
    if local:
        local_pages = np.zeros((nr, max_pages), np.int32)
        for i, r in enumerate(rows):
            if r.local_pages is None or len(r.local_pages) < need_pages[i]:
                got = "none" if r.local_pages is None else len(r.local_pages)
                raise ValueError(f"row needs {need_pages[i]} local pages for {kv_len[i]} tokens, got {got}")
            local_pages[i, : need_pages[i]] = r.local_pages[: need_pages[i]]
        local_loc = np.zeros(t, np.int32)
        local_loc[:total] = local_pages[tok_row, p // page_size].astype(np.int64) * page_size + p % page_size
    kv = np.zeros(nr, np.int32)
    kv[:n] = kv_len
    sample_idx = np.zeros((nr, k1), np.int32)
    sample_idx[:n] = start[1 : n + 1, None] - k1 + np.arange(k1)[None, :]
    sample_slot = np.full(nr, sink_slot, np.int32)
    sample_slot[:n] = [r.future_slot if r.future_slot >= 0 else sink_slot for r in rows]
    fwd = ForwardBatch(ids, pos, loc, start, kv, pages, np.array([n], np.int32), sample_idx.ravel(), sample_slot, {},
                       local_pages, local_loc)  # fmt: skip
    smp = _row_sampling(rows, nr, k1)
    lb, n_pos = _logprob_batch(rows, start, buckets.positions(shape), nr, logprob_ids)
    lora_slot = np.zeros(nr, np.int32)
    lora_slot[:n] = [r.lora_slot for r in rows]
    return HostBatch(shape, fits[0], fwd, smp, n * k1, lb, n_pos, lora_slot)


def _row_sampling(rows: list[DeviceRow], nr: int, k1: int) -> RowSampling:
    """The rows' sampling columns, padded to `nr` rows (padding rows: greedy, nothing on);
    `ban` and `bias` are None when no row holds stop ids back or biases (the executor passes
    zeros kept on device)."""
    temp = np.zeros(nr, np.float32)
    top_k = np.full(nr, -1, np.int32)
    top_p = np.ones(nr, np.float32)
    min_p = np.zeros(nr, np.float32)
    seed = np.zeros(nr, np.uint32)
    rep, freq, pres = np.ones(nr, np.float32), np.zeros(nr, np.float32), np.zeros(nr, np.float32)
    min_until = np.zeros(nr, np.int32)
    ban = bias_ids = bias = None
    want_lp = want_top = want_kept = False
    for i, r in enumerate(rows):
        sp = r.sampling
        temp[i], top_k[i], top_p[i], min_p[i] = sp.temperature, sp.top_k, sp.top_p, sp.min_p
        seed[i] = (sp.seed ^ (sp.seed >> 32)) & 0xFFFFFFFF  # 63-bit seed folded to 32
        want_lp |= sp.logprobs or (r.logprob_ids is not None and len(r.logprob_ids) > 0)
        want_top |= sp.top_logprobs
        want_kept |= sp.kept
        rep[i], freq[i], pres[i] = sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty
        if sp.min_until and sp.ban:
            if ban is None:
                ban = np.full((nr, BAN_IDS), -1, np.int32)
            if len(sp.ban) > BAN_IDS:
                raise ValueError(f"row {i}: {len(sp.ban)} stop ids held back, the programs take {BAN_IDS}")
            min_until[i] = sp.min_until
            ban[i, : len(sp.ban)] = sp.ban
        if sp.bias_ids:
            if len(sp.bias_ids) > BIAS_IDS or len(sp.bias) != len(sp.bias_ids):
                raise ValueError(f"row {i}: {len(sp.bias_ids)} logit_bias ids ({len(sp.bias)} values), the programs "
                                 f"take {BIAS_IDS}")  # fmt: skip
            if bias_ids is None or bias is None:
                bias_ids, bias = np.full((nr, BIAS_IDS), -1, np.int32), np.zeros((nr, BIAS_IDS), np.float32)
            bias_ids[i, : len(sp.bias_ids)], bias[i, : len(sp.bias)] = sp.bias_ids, sp.bias
    random = temp > 0
    filt = random & ((top_k > 0) | (top_p < 1.0) | (min_p > 0))
    penalized = (rep != 1) | (freq != 0) | (pres != 0)
    mask = _masks(rows, nr, k1)
    return RowSampling(temp, top_k, top_p, min_p, seed, np.bool_(random.any()), np.bool_(filt.any()), mask,
                       np.bool_(mask is not None), np.bool_(want_lp), np.bool_(want_top), rep, freq, pres,
                       np.bool_(penalized.any()), min_until, ban, bias_ids, bias,
                       np.bool_(ban is not None or bias_ids is not None), np.bool_(want_kept))  # fmt: skip


def _logprob_batch(rows: list[DeviceRow], start: np.ndarray, p: int, nr: int, k: int) -> tuple[LogprobBatch, int]:
    """The rows' token_ids_logprob ([nr, k]; None when no row has any: the executor passes zeros
    kept on device) and their wanted prompt positions packed row after row into [p] (p = the
    program's T, which holds every row's tokens; None when no row wants any, likewise)."""
    ids = None
    if any(r.logprob_ids is not None and len(r.logprob_ids) for r in rows):
        ids = np.zeros((nr, k), np.int32)
        for i, r in enumerate(rows):
            if r.logprob_ids is not None and len(r.logprob_ids):
                if len(r.logprob_ids) > k:
                    raise ValueError(f"row {i}: {len(r.logprob_ids)} token_ids_logprob, the programs take {k}")
                ids[i, : len(r.logprob_ids)] = r.logprob_ids
    wanting = [(i, r, r.logprob_targets) for i, r in enumerate(rows) if r.logprob_targets is not None]
    wanting = [(i, r, t) for i, r, t in wanting if len(t)]
    if not wanting:
        return LogprobBatch(ids), 0
    index, target, row = np.zeros(p, np.int32), np.zeros(p, np.int32), np.zeros(p, np.int32)
    n = 0
    for i, r, t in wanting:
        m = len(t)
        if not 0 <= r.logprob_start <= r.extend_len - m:
            raise ValueError(f"row {i}: logprobs of tokens [{r.logprob_start}, {r.logprob_start + m}) outside its "
                             f"{r.extend_len}")  # fmt: skip
        index[n : n + m] = start[i] + r.logprob_start + np.arange(m)
        target[n : n + m] = t
        row[n : n + m] = i
        n += m
    return LogprobBatch(ids, index, target, row, np.int32(n)), n


def _masks(rows: list[DeviceRow], nr: int, k1: int) -> np.ndarray | None:
    """[nr * k1, W] int32: each constrained row's k1 masks at its samples, all ones elsewhere;
    None when no row is constrained."""
    masked = [(i, r.mask) for i, r in enumerate(rows) if r.mask is not None]
    if not masked:
        return None
    w = masked[0][1].shape[-1]
    out = np.full((nr * k1, w), -1, np.int32)
    for i, m in masked:
        if m.shape != (k1, w):
            raise ValueError(f"row {i}: mask of shape {m.shape}, expected {(k1, w)} (one per sampled token)")
        out[i * k1 : (i + 1) * k1] = m
    return out

"""Host side of a step: turn per-request rows into padded, bucketed device inputs (no JAX here).

A `DeviceRow` is one request's work in one step, as the device sees it: its new tokens
(`extend_len` of them; an id may be a negative future index), the position of the first one
(`committed_len`: tokens whose KV is already written), its page table covering
`committed_len + extend_len` tokens, and its `DeviceSampling`.

Flat token layout of an extend step (block = 4 here, two rows of 6 and 1 tokens):

    block:    0            1            2            3 (padding to the bucket)
    token:  a0 a1 a2 a3 | a4 a5 -- -- | b0 -- -- -- | -- -- -- --
    sample:            (a5, row 1)    (b0, row 2)

Every row starts a fresh block, so a block never mixes requests. Decode steps use
block = 1 (T = NB = padded batch). Padding tokens write KV to token location 0 (the sink page)
and their rows are ignored.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import msgspec
import numpy as np

Arr = Any  # jax.Array on device; np.ndarray while the host builds it


class DeviceSampling(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """What the device samples a request with; sent once per request slot (the runner's slot
    mirror keeps it). Made from a request's SamplingParams by `SamplingParams.device()`."""

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0


@dataclasses.dataclass(slots=True)
class DeviceRow:
    token_ids: np.ndarray  # [extend_len] int32 (negative: future slot -(id) - 1)
    committed_len: int  # KV tokens already written before this step = position of token_ids[0]
    pages: np.ndarray  # int32 page table covering committed_len + extend_len tokens
    sampling: DeviceSampling = DeviceSampling()
    future_slot: int = -1  # request slot whose future entry receives the sampled token; -1: sink

    @property
    def extend_len(self) -> int:
        return len(self.token_ids)


class ForwardBatch(NamedTuple):
    """Device inputs of one step. T = NB * block tokens (padding included)."""

    input_ids: Arr  # [T] int32; a negative id -i reads future slot i-1 (overlap scheduling)
    positions: Arr  # [T] int32
    out_loc: Arr  # [T] int32 token location to write (0 = sink for padding)
    block_pages: Arr  # [NB, max_pages] int32 page table of each block's request
    committed_len: Arr  # [NB] int32 KV tokens of the block's request once this step's are written
    sample_idx: Arr  # [NB] int32 flat index of the token whose logits are sampled per row
    sample_slot: Arr  # [NB] int32 future slot that receives the sampled token (sink = last)


class SamplingBatch(NamedTuple):
    temperature: Arr  # [S] f32, 0 = greedy
    top_k: Arr  # [S] i32, <= 0 = off
    top_p: Arr  # [S] f32 in (0, 1], 1 = off
    min_p: Arr  # [S] f32 in [0, 1], 0 = off
    seed: Arr  # [S] u32
    position: Arr  # [S] i32 position of the token being sampled
    any_random: Arr  # [] bool: some row has temperature > 0
    any_filter: Arr  # [] bool: some row uses top-k / top-p / min-p


@dataclasses.dataclass(frozen=True, slots=True)
class Buckets:
    """The padded shapes compiled up front: (block, NB) program keys."""

    decode_batches: tuple[int, ...]  # NB values for block = 1
    extend_tokens: tuple[int, ...]  # T values for block = extend_block (NB = T / block)
    extend_block: int

    @staticmethod
    def make(max_batch: int, max_extend_tokens: int, extend_block: int) -> Buckets:
        def pow2_up_to(lo: int, hi: int) -> tuple[int, ...]:
            out, x = [], lo
            while x < hi:
                out.append(x)
                x *= 2
            out.append(hi)
            return tuple(sorted(set(out)))

        if max_extend_tokens % extend_block:
            raise ValueError(
                f"max_extend_tokens={max_extend_tokens} must be a multiple of extend_block={extend_block}"
            )
        # No 1-token program: with T == 1, XLA CPU rewrites the KV scatter into a form that
        # copies every layer's whole cache each step (measured: 89 ms vs 2.6 ms at T == 2).
        return Buckets(
            pow2_up_to(min(2, max_batch), max_batch),
            pow2_up_to(extend_block, max_extend_tokens),
            extend_block,
        )

    def keys(self) -> list[tuple[int, int]]:
        dec = [(1, nb) for nb in self.decode_batches]
        ext = [(self.extend_block, t // self.extend_block) for t in self.extend_tokens]
        return dec + [k for k in ext if k not in dec]

    def pick(self, is_decode: bool, n: int) -> tuple[int, int]:
        """Smallest key holding n decode rows or n extend blocks; ValueError past the largest."""
        if is_decode:
            for nb in self.decode_batches:
                if nb >= n:
                    return (1, nb)
            raise ValueError(
                f"decode batch of {n} requests exceeds the largest bucket {self.decode_batches[-1]}"
            )
        for t in self.extend_tokens:
            if t >= n * self.extend_block:
                return (self.extend_block, t // self.extend_block)
        raise ValueError(
            f"extend step needs {n * self.extend_block} padded tokens, more than the largest bucket "
            f"{self.extend_tokens[-1]} (chunk the prefill)"
        )


@dataclasses.dataclass(slots=True)
class HostBatch:
    key: tuple[int, int]
    forward: ForwardBatch  # NumPy arrays
    sampling: SamplingBatch  # NumPy arrays
    rows: list[int]  # sample row of each DeviceRow, in order


def build_batch(
    rows: list[DeviceRow], buckets: Buckets, page_size: int, max_pages: int, sink_slot: int
) -> HostBatch:
    if not rows:
        raise ValueError("empty batch")
    is_decode = all(r.extend_len == 1 for r in rows)
    blk = 1 if is_decode else buckets.extend_block
    n_blocks = sum(-(-r.extend_len // blk) for r in rows)
    key = buckets.pick(is_decode, n_blocks)
    nb = key[1]
    t = nb * blk
    ids = np.zeros(t, np.int32)
    pos = np.zeros(t, np.int32)
    loc = np.zeros(t, np.int32)
    pages = np.zeros((nb, max_pages), np.int32)
    committed = np.zeros(nb, np.int32)
    sample_idx = np.zeros(nb, np.int32)
    sample_slot = np.full(nb, sink_slot, np.int32)
    temp = np.zeros(nb, np.float32)
    top_k = np.full(nb, -1, np.int32)
    top_p = np.ones(nb, np.float32)
    min_p = np.zeros(nb, np.float32)
    seed = np.zeros(nb, np.uint32)
    spos = np.zeros(nb, np.int32)
    sample_rows = []
    b = 0
    for r in rows:
        n, c = r.extend_len, r.committed_len
        need_pages = -(-(c + n) // page_size)
        if len(r.pages) < need_pages:
            raise ValueError(f"row needs {need_pages} pages for {c + n} tokens, got {len(r.pages)}")
        if need_pages > max_pages:
            raise ValueError(
                f"row of {c + n} tokens exceeds the context limit of {max_pages * page_size}"
            )
        p = np.arange(c, c + n, dtype=np.int64)
        tok_loc = r.pages[p // page_size].astype(np.int64) * page_size + p % page_size
        nblk = -(-n // blk)
        start = b * blk
        ids[start : start + n] = r.token_ids
        pos[start : start + n] = p
        loc[start : start + n] = tok_loc
        for j in range(nblk):
            pages[b + j, :need_pages] = r.pages[:need_pages]
            committed[b + j] = c + n
            sample_idx[b + j] = start + min((j + 1) * blk, n) - 1
        last = b + nblk - 1
        sample_slot[last] = r.future_slot if r.future_slot >= 0 else sink_slot
        sp = r.sampling
        temp[last], top_k[last], top_p[last], min_p[last] = sp.temperature, sp.top_k, sp.top_p, sp.min_p
        seed[last], spos[last] = (
            np.uint32((sp.seed ^ (sp.seed >> 32)) & 0xFFFFFFFF),
            c + n,
        )  # 63-bit seed folded to 32
        sample_rows.append(last)
        b += nblk
    random = temp > 0
    filt = random & ((top_k > 0) | (top_p < 1.0) | (min_p > 0))
    fwd = ForwardBatch(ids, pos, loc, pages, committed, sample_idx, sample_slot)
    smp = SamplingBatch(temp, top_k, top_p, min_p, seed, spos, np.bool_(random.any()), np.bool_(filt.any()))
    return HostBatch(key, fwd, smp, sample_rows)

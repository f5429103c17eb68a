"""What a TPU attention kernel may hold in VMEM, per chip: the scoped VMEM limit it asks for and
the block sizes it runs with, checked against that limit before anything compiles.

Mosaic gives a kernel 16 MiB of scoped VMEM unless the kernel asks for more, whatever the chip
holds (v5e and v6e: 128 MiB a core; v5p: 64 MiB; v4: 16 MiB). jax's ragged paged attention
asks for nothing and, off its tuned table, takes the whole page table as one KV block, double
buffered: at page 64 and context 4096 that is 64 pages x 64 tokens x 8 combined heads x 128
lanes x 2 bytes x 2 buffers = 16 MiB, and every program of the launcher's configuration
failed to compile on v5e (`CompileTimeScopedVmemOom`, 16.19M against 16.00M). So:

    limit   = half the chip's VMEM, at least the compiler's 16 MiB default (sglang-jax sets
              half on v5e/v6e: the whole of it made a mixed head_dim-128 batch 68% slower on
              v6e, the rest of the step's fusions losing theirs)
    blocks  = the tuned table's entry for (chip, page size, context) where one was measured,
              else KV_KEYS keys a block (whole pages) and QUERIES queries, halved (keys first,
              then queries) until `vmem_bytes` fits FIT of the limit
    check   = a ValueError naming the chip, the limit and the estimate when even one page and
              MIN_QUERIES queries do not fit (raised while tracing, before Mosaic compiles)

The chip is a device's `device_kind` and is passed in: the program's own devices (its mesh's),
not `jax.devices()[0]`, which is the host's CPU when compiling ahead of time for a topology.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

MiB = 1 << 20
DEFAULT_SCOPED = 16 * MiB  # Mosaic's scoped VMEM limit when a kernel asks for none
KV_KEYS = 1024  # keys a KV block holds by default (whole pages): jax's tuned blocks run 256-2048
QUERIES = 32  # queries a block holds by default (most of jax's tuned entries)
MIN_QUERIES = 8  # a query block's sublanes: the smallest the heuristic tries
FIT = 0.75  # the share of the limit the estimate may take: the rest is Mosaic's own scratch


@dataclasses.dataclass(frozen=True, slots=True)
class Chip:
    """One TPU generation's facts that size a kernel."""

    name: str  # "v5e", ...
    vmem: int  # bytes of VMEM a TensorCore has

    @property
    def vmem_limit(self) -> int:
        """The scoped VMEM limit kernels ask for on this chip (the module docstring)."""
        return min(self.vmem, max(DEFAULT_SCOPED, self.vmem // 2))


# device_kind -> chip (the names the TPU runtime and libtpu's topologies give; VMEM per core as
# jax's pallas/mosaic/tpu_info.py lists it)
CHIPS = {
    "TPU v4": Chip("v4", 16 * MiB),
    "TPU v5 lite": Chip("v5e", 128 * MiB),
    "TPU v5e": Chip("v5e", 128 * MiB),
    "TPU v5": Chip("v5p", 64 * MiB),
    "TPU v5p": Chip("v5p", 64 * MiB),
    "TPU v6 lite": Chip("v6e", 128 * MiB),
    "TPU v6e": Chip("v6e", 128 * MiB),
    "TPU7x": Chip("v7x", 64 * MiB),
}


def chip_of(device_kind: str) -> Chip:
    """The chip of a device kind; ValueError for one that is no TPU this table knows."""
    chip = CHIPS.get(device_kind)
    if chip is None:
        raise ValueError(
            f"TPU attention: unknown chip {device_kind!r} (a device's device_kind); known: {sorted(CHIPS)} "
            "(model/compute/attention/tpu_fit.py CHIPS)"
        )
    return chip


@dataclasses.dataclass(frozen=True, slots=True)
class Blocks:
    """A kernel's block sizes and the scoped VMEM limit it compiles with."""

    kv_pages: int  # KV pages a block reads
    queries: int  # query tokens a block holds
    vmem_limit: int  # bytes


@dataclasses.dataclass(frozen=True, slots=True)
class KernelShape:
    """What one call of the ragged paged attention kernel holds per heads block (jax's
    `get_min_heads_per_blk` grouping), as `vmem_bytes` counts it."""

    q_heads: int  # query heads a block holds
    kv_heads: int  # KV heads a block holds (K and V: 2 x this many combined heads)
    head_dim: int  # lanes a head takes in the cache (padded)
    page_size: int
    pages_per_seq: int  # page-table width
    tokens: int  # T: query tokens of the program
    q_bytes: int = 2  # itemsize of queries / outputs
    kv_bytes: int = 2  # itemsize of the cache


def vmem_bytes(s: KernelShape, b: Blocks) -> int:
    """Scoped VMEM the kernel's buffers take at blocks `b`, an upper estimate: with jax's fallback
    block (64 pages of 64) Mosaic reported 16.19M for the tiny model's decode-2 program (this:
    16.16 MiB) and 16.66M for SmolLM2's extend-512 one (this: 19.94 MiB, the scores being
    Mosaic's own scratch, not its scoped allocation: counted as headroom).

        KV       2 buffers x keys x 2 * kv_heads x head_dim        cache dtype (the DMA'd pages)
        l, m     2 x kv_heads x queries * G x 128                  f32 (a lane row per query head)
        acc      queries x q_heads x head_dim                      f32
        q, out   2 x 2 x queries x q_heads x head_dim              query dtype (pipelined blocks)
        scores   queries * G x keys, twice                         f32 (s and p of one head)
    """
    keys = b.kv_pages * s.page_size
    g = s.q_heads // s.kv_heads
    kv = 2 * keys * 2 * s.kv_heads * s.head_dim * s.kv_bytes
    lm = 2 * s.kv_heads * b.queries * g * 128 * 4
    acc = b.queries * s.q_heads * s.head_dim * 4
    qo = 4 * b.queries * s.q_heads * s.head_dim * s.q_bytes
    scores = 2 * b.queries * g * keys * 4
    return kv + lm + acc + qo + scores


# (chip, page size, page-table width) -> (kv_pages, queries), measured by compiling (issue 65:
# with these every SmolLM2 program of the launcher's configuration compiled on v5e)
TUNED: dict[tuple[str, int, int], tuple[int, int]] = {
    ("v5e", 64, 64): (16, 32),
}


def choose(chip: Chip, s: KernelShape, estimate: Callable[[KernelShape, Blocks], int] = vmem_bytes,
           tuned: dict[tuple[str, int, int], tuple[int, int]] | None = None) -> Blocks:  # fmt: skip
    """The blocks of a kernel of shape `s` on `chip` (the module docstring); ValueError naming
    the budget when even the smallest do not fit. `estimate`: the kernel's VMEM at given blocks
    (jax's kernel: `vmem_bytes`); `tuned`: its measured table (jax's kernel: TUNED)."""
    limit = chip.vmem_limit
    budget = int(FIT * limit)
    hit = (TUNED if tuned is None else tuned).get((chip.name, s.page_size, s.pages_per_seq))
    if hit is not None:
        b = Blocks(min(hit[0], s.pages_per_seq), min(hit[1], s.tokens), limit)
        if estimate(s, b) <= budget:
            return b
    pages = min(s.pages_per_seq, max(1, KV_KEYS // s.page_size))
    queries = min(s.tokens, QUERIES)
    while True:
        b = Blocks(pages, queries, limit)
        if estimate(s, b) <= budget:
            return b
        if pages > 1:
            pages //= 2
        elif queries > min(s.tokens, MIN_QUERIES):
            queries = max(min(s.tokens, MIN_QUERIES), queries // 2)
        else:
            raise ValueError(
                f"TPU attention does not fit {chip.name}'s VMEM: the smallest blocks ({b.kv_pages} page of "
                f"{s.page_size} tokens x {b.queries} queries, {s.q_heads} query / {s.kv_heads} KV heads of "
                f"{s.head_dim} lanes) need ~{estimate(s, b) / MiB:.1f} MiB, over {FIT:.0%} of the "
                f"{limit / MiB:.0f} MiB scoped limit ({budget / MiB:.1f} MiB); lower page_size"
            )


def describe(chip: Chip, s: KernelShape, b: Blocks) -> dict[str, Any]:
    """The choice as a report reads it (`ringserve compile`)."""
    return {"chip": chip.name, "kv_pages_per_block": b.kv_pages, "queries_per_block": b.queries,
            "vmem_limit_mib": b.vmem_limit / MiB, "vmem_estimate_mib": round(vmem_bytes(s, b) / MiB, 2)}  # fmt: skip

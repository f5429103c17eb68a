"""`ringserve launch-plan`: how one TPU host serves a model, chosen from its config.json and the
host's chips (tools/launch_tpu.sh asks it, then runs `ringserve serve` with what it prints).

    dp x tp = chips   tp: the fewest chips that split the model's heads evenly (query heads
                      divisible by tp; KV heads too, or tp a multiple of them: each replicated,
                      as SGLang does) and hold its weights within WEIGHT_SHARE of their HBM
                      (a mixture of experts: its experts split over the same chips, ep = tp); dp: the rest of the chips, each group a replica of its own
                      (actors/transport/devices.py gives each its chips). A small model runs
                      data parallel; SmolLM2's 9 query / 3 KV heads split over no 2, 4 or 8
                      chips, so it runs data parallel whatever its size.
    page size         one page of one KV head is PAGE_BYTES (head_dim 128 in bf16: 64 tokens;
                      head_dim 64: 128): the kernel reads a page per DMA
    running requests  the KV a replica holds (its chips' HBM at the server's fraction, less
                      the weights) over TYPICAL_TOKENS a request, a power of two <= MAX_RUNNING
    buckets           decode batches in powers of two (`--decode-bucket-step 0`): with the ragged
                      kernel's one context per shape, <= 20 programs at these settings

A flag the user gives (after `--`: the serve flags the launcher passes on) wins over the
choice, and the others are chosen around it (`--tp-size 4` on 8 chips: dp 2). Prints the serve
flags on one line (stdout) and why, with the program count, on stderr; `--json` prints the plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from ringserve.actors.server_args import ServerArgs
from ringserve.model.compute.step_inputs import Buckets
from ringserve.model.compute.tpu_topology import CHIPS
from ringserve.model.config import ModelConfig

GB = 10**9
# HBM per chip, by generation (the published figures, model/compute/tpu_topology.py)
HBM_BYTES = {name: chip.hbm_bytes for name, chip in CHIPS.items()}
WEIGHT_SHARE = 0.4  # at most this share of a group's HBM for weights: the rest is KV and activations
SERVER_FRACTION = 0.85  # mem_fraction_static's accelerator default (actors/transport/devices.py)
PAGE_BYTES = 16 * 1024  # one KV head's K (or V) of one page
TYPICAL_TOKENS = 2048  # a request's KV the running-request count is sized for
MAX_RUNNING = 256
SERVE_DEFAULTS = dict(max_prefill_tokens=8192, chunked_prefill_size=4096, extend_block=64, context_length=4096)


def chip_of(device_kind: str) -> str:
    """The generation of a JAX TPU device kind ("TPU v5 lite" -> v5e, "TPU v6 lite" -> v6e)."""
    kind = device_kind.lower()
    for marker, gen in (("v5 lite", "v5e"), ("v5e", "v5e"), ("v6", "v6e"), ("v5", "v5p"), ("v4", "v4")):
        if marker in kind:
            return gen
    raise ValueError(f"device kind {device_kind!r}: not a TPU generation this knows ({', '.join(HBM_BYTES)})")


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchPlan:
    dp: int
    tp: int
    page_size: int
    max_running_requests: int
    decode_bucket_step: int
    programs: int  # step programs the server compiles (one context each: the ragged kernel)
    why: tuple[str, ...]
    serve: tuple[tuple[str, int], ...] = ()  # the prefill budget, chunk and extend block (SERVE_DEFAULTS or given)
    attention: str = "pallas"  # the TPU attention backend (`attention_backend`, below)
    ep: int = 1  # expert parallelism (a mixture of experts over tp > 1 chips: its experts split over them)

    def flags(self) -> list[str]:
        chosen = [("dp_size", self.dp), ("tp_size", self.tp), *([("ep_size", self.ep)] if self.ep > 1 else []),
                  ("page_size", self.page_size),
                  ("max_running_requests", self.max_running_requests), ("decode_bucket_step", self.decode_bucket_step),
                  *self.serve]  # fmt: skip
        return [x for k, v in chosen for x in ("--" + k.replace("_", "-"), str(v))] + ["--attention-backend",
                                                                                       self.attention]  # fmt: skip


def weight_bytes(cfg: ModelConfig, itemsize: int = 2) -> int:
    """The served weights' bytes from the config alone: every tensor of the family's HF layout
    (model/families/: experts, sandwich norms and biases included)."""
    from ringserve.model.families import family

    return itemsize * sum(math.prod(p.hf_shape) for p in family(cfg.family).layout(cfg).values())


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int = 2) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def choose(cfg: ModelConfig, chips: int, hbm_bytes: int, given: dict[str, int] | None = None,
           weights: int | None = None) -> LaunchPlan:  # fmt: skip
    """The plan for `cfg` on `chips` chips of `hbm_bytes` each (the module docstring); `given`:
    the serve options the user set (tp_size, dp_size, page_size, max_running_requests,
    decode_bucket_step), which win; `weights`: the weights' bytes (else from the config).
    ValueError when no split of the chips holds the model."""
    given = given or {}
    if chips < 1:
        raise ValueError(f"chips={chips}: the host must offer at least one chip")
    weights = weight_bytes(cfg) if weights is None else weights
    why = []
    splits = [t for t in range(1, chips + 1) if chips % t == 0]
    # query heads split evenly; KV heads too, or each held by tp / KV heads chips (replicated, as SGLang does)
    even = [t for t in splits if cfg.num_heads % t == 0 and (cfg.num_kv_heads % t == 0 or t % cfg.num_kv_heads == 0)]
    if "tp_size" in given:
        tp = given["tp_size"]
        why.append(f"tp {tp}: given")
    else:
        fits = [t for t in even if weights / t <= WEIGHT_SHARE * hbm_bytes]
        if not fits:
            most = max(even)
            raise ValueError(f"{weights / GB:.1f} GB of weights over at most {most} chip(s) (the largest split of "
                             f"{cfg.num_heads} query / {cfg.num_kv_heads} KV heads over {chips} chips) leave too "
                             f"little of {hbm_bytes / GB:.0f} GB a chip for the KV cache")  # fmt: skip
        tp = fits[0]
        uneven = [t for t in splits if t > 1 and t not in even]
        why.append(f"tp {tp}: the fewest chips holding {weights / GB:.2f} GB of weights within {WEIGHT_SHARE:.0%} "
                   f"of their HBM" + (f" that split {cfg.num_heads} query / {cfg.num_kv_heads} KV heads (not "
                                      f"{', '.join(map(str, uneven))})" if uneven else ""))  # fmt: skip
    dp = given.get("dp_size", chips // tp)
    if dp * tp > chips:
        raise ValueError(f"dp_size={dp} x tp_size={tp} needs {dp * tp} chips; this host has {chips}")
    why.append(f"dp {dp}: {'given' if 'dp_size' in given else f'the other chips, {dp} replica(s) of {tp} chip(s)'}")
    page = given.get("page_size") or max(16, min(128, PAGE_BYTES // (cfg.head_dim * 2)))
    why.append(f"page size {page}: {'given' if 'page_size' in given else f'{PAGE_BYTES // 1024} KiB of one KV head a page (head_dim {cfg.head_dim})'}")
    kv_tokens = max(0, int(SERVER_FRACTION * hbm_bytes * tp) - weights) // kv_bytes_per_token(cfg)
    running = given.get("max_running_requests") or max(8, min(MAX_RUNNING, _pow2_floor(kv_tokens // TYPICAL_TOKENS)))
    why.append(f"{running} running requests: {'given' if 'max_running_requests' in given else f'{kv_tokens:,} KV tokens a replica, {TYPICAL_TOKENS} a request'}")
    step = given.get("decode_bucket_step", 0)
    serve = {k: given.get(k, v) for k, v in SERVE_DEFAULTS.items()}
    args = ServerArgs(max_running_requests=running, decode_bucket_step=step, **serve)
    programs = len(Buckets.make(running, args.max_extend_tokens, args.extend_block, step).shapes())
    why.append(f"{programs} step programs: decode and extend buckets, one context each (the ragged kernel)")
    attention, reason = attention_backend(cfg, tp)
    why.append(f"{attention} attention: {reason}")
    ep = given.get("ep_size", tp if cfg.num_experts else 1)
    if cfg.num_experts and tp > 1:
        why.append(f"ep {ep}: {'given' if 'ep_size' in given else f'{cfg.num_experts} experts split over the {tp} chips'}")
    return LaunchPlan(dp, tp, page, running, step, programs, tuple(why), tuple(serve.items()), attention, ep)


def attention_backend(cfg: ModelConfig, tp: int) -> tuple[str, str]:
    """jax's ragged paged attention kernel (`pallas`) where its layout stores the KV as it is,
    else ringserve's (`pallas_ragged`, model/compute/attention/pallas_ragged.py: K|V unpadded on
    the lanes), with why. jax's pads head_dim to 128 lanes and a device's KV heads to what it tiles
    (SmolLM2, 3 heads of 64: 2.67x the KV bytes), cannot split KV heads fewer than tp, and
    does not compile for head_dim 256 (Gemma 2) on libtpu 0.0.42."""
    from ringserve.model.compute.attention.layout import padded_kv_heads

    local = cfg.num_kv_heads // tp if cfg.num_kv_heads % tp == 0 else 0
    lanes = -(-cfg.head_dim // 128) * 128
    if local and local == padded_kv_heads(local, 2) and cfg.head_dim == 128:
        return "pallas", "jax's kernel stores this model's KV unpadded"
    if cfg.head_dim > 128:  # Mosaic: "The last dim size is not 128 in original base memref" (Gemma-2-2B, v5e)
        return "pallas_ragged", f"head_dim {cfg.head_dim}: jax's kernel does not compile past 128 lanes"
    if cfg.head_dim < 64:  # ringserve's lays such heads in 64 lanes and copies the cache each step
        return "pallas", f"head_dim {cfg.head_dim}: ringserve's kernel is exact from 64 lanes up"
    if not local:
        return "pallas_ragged", f"{cfg.num_kv_heads} KV heads over tp {tp}: replicated, as jax's kernel cannot"
    padded = padded_kv_heads(local, 2) * lanes
    return "pallas_ragged", (f"jax's kernel would store {padded / (local * cfg.head_dim):.2f}x the KV bytes "
                             f"(head_dim {cfg.head_dim}, {local} KV head(s) a chip)")  # fmt: skip


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


GIVEN = ("tp_size", "dp_size", "ep_size", "page_size", "max_running_requests", "decode_bucket_step", "max_prefill_tokens",
         "chunked_prefill_size", "extend_block", "context_length")  # fmt: skip


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="ringserve launch-plan", description=__doc__.split("\n")[0])
    ap.add_argument("--chips", type=int, required=True, help="TPU chips on this host")
    ap.add_argument("--chip", default=None, help=f"the chips' generation ({', '.join(HBM_BYTES)})")
    ap.add_argument("--device-kind", default=None, help="JAX's device_kind of the chips (instead of --chip)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument("serve", nargs=argparse.REMAINDER, help="-- then the serve flags the launcher passes on")
    a = ap.parse_args(argv)
    serve = argparse.ArgumentParser(add_help=False)
    serve.add_argument("--model-path", "--model", dest="model_path", default=None)
    for name in GIVEN:
        serve.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=None)
    s, _ = serve.parse_known_args([x for x in a.serve if x != "--"])
    chip = a.chip or (chip_of(a.device_kind) if a.device_kind else None)
    if chip not in HBM_BYTES:
        raise ValueError(f"chip={chip!r}: give --chip one of {', '.join(HBM_BYTES)} (or --device-kind)")
    cfg = _config(s.model_path)
    given = {k: v for k in GIVEN if (v := getattr(s, k)) is not None}
    plan = choose(cfg, a.chips, HBM_BYTES[chip], given)
    if a.json:
        print(json.dumps(dataclasses.asdict(plan)))
        return 0
    print(f"# launch plan for {a.chips} x {chip}: " + "; ".join(plan.why), file=sys.stderr)
    print(" ".join(plan.flags()))
    return 0


def _config(model: str | None) -> ModelConfig:
    """The ModelConfig of a model directory, or of a named shape (model/checkpoints/config_shapes.py:
    nothing fetched, so a dry run works on any host; None: smollm2, serve's default), else of a
    model serve knows by name, as serve resolves it."""
    from ringserve.model.checkpoints.config_shapes import NAMES, model_config

    name = model or "smollm2"
    if Path(name).expanduser().is_dir() or name in NAMES:
        return model_config(name)[0]
    from ringserve.model.checkpoints.resolve import resolve_model
    from ringserve.model.families import read_config

    return read_config(resolve_model(name)[1])

"""How this platform computes a step, decided once: `ComputePlan.resolve` turns the compute
options (model/compute/options.py) and the platform into every choice the model and the runtime
make, and nothing else in the model compares a platform or a dot path (tests/test_structure.py
counts them):

    attention            the backend (model/compute/attention/: the registry, auto by platform,
                         the deterministic mode's override)
    dot                  how the projections and the LM head multiply, with its row thresholds
                         (model/compute/dots.py: XLA's, ringserve's CPU kernel, oneDNN's, or the
                         deterministic mode's batch-invariant one)
    norm, block_norm     how RMSNorm computes (model/compute/norm.py): the blocks' residual norms
                         through cpu_norm's kernel where bf16 runs on the kernel dots
    layer_loop           one scan over stacked weights, or unrolled
    grouped, ep          mixture-of-experts layers' grouped matmul (model/compute/grouped.py:
                         ragged_dot, megablox on TPU) and the devices the experts are split over
    moe_a2a_rows         expert parallelism's form per program (model/layers/expert_parallel.py):
                         psum below this many rows, all_to_all from it on
    kernels              the CPU custom calls its programs may call (built side by side at
                         start-up, registered before a program is read back from disk)
    the rest             logits' product order, RoPE tables, the sampler's and prompt logprobs'
                         groups, the compile order's leads, host-aliased weights, the program cache

`ModelExecutor` (model/runtime/executor.py) resolves one and hands it to the family's module
tree (model/families/) and to the runtime.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from ringserve.model.compute.attention import DETERMINISTIC, REGISTRY
from ringserve.model.compute.dots import INVARIANT_ROWS, Dot, kernel_rows
from ringserve.model.compute.grouped import GroupedDot, resolve_grouped
from ringserve.model.compute.norm import Norm
from ringserve.model.compute.options import ComputeOptions
from ringserve.model.compute.platform import platform_of

log = logging.getLogger(__name__)

# expert parallelism (ep > 1): the fewest step rows (tokens) that route by all_to_all rather than
# psum, by platform (model/layers/expert_parallel.py; absent: psum only). None yet: while the
# attention is tensor-parallel every device already holds every token, so the a2a form's dispatch
# sends rows the receiver has, in slots padded to the no-drop bound; compiled for Qwen3-30B-A3B on
# v6e:2x4 (ep 8) it moves 17 MB a layer at 256 rows against psum's 2 MB, at every row count the
# same ratio (bench/RESULTS.md "TPU ahead-of-time compiles"). It pays where tokens are split
# (data-parallel attention); a platform's entry here turns it on from that many rows.
MOE_A2A_ROWS: dict[str, int] = {}

@dataclasses.dataclass(frozen=True, slots=True)
class ComputePlan:
    """Every compute choice of one executor (the module docstring). The defaults are XLA's plain
    path in float32 with scanned layers: what a module tree is built with to read its shape."""

    options: ComputeOptions = ComputeOptions()
    platform: str = "cpu"
    tp: int = 1
    ep: int = 1  # devices the experts are split over (1 or tp; model/compute/mesh.py ep_split)
    attention: str = "native"
    dot: Dot = Dot()
    norm: Norm = Norm()  # every RMSNorm but the blocks' residual ones (final, q/k)
    block_norm: Norm = Norm()  # a block's input and post-attention norms
    layer_loop: str = "scan"
    grouped: GroupedDot = GroupedDot()  # the experts' grouped matmul (model/compute/grouped.py)
    moe_a2a_rows: int | None = None  # ep > 1: steps of at least this many rows route by all_to_all (None: psum only)
    vocab_major_logits: bool = False  # logits as [V, H] x [H, S] (XLA:CPU's faster form for a few rows)
    rope_table_positions: int | None = None  # RoPE's cos and sin gathered from host-made tables of this span
    sample_group: int | None = None  # extend programs sample their producing rows this many at a time (None: all)
    position_group: int = 128  # prompt positions' logprobs this many at a time
    kernels: tuple[str, ...] = ()  # CPU custom calls the programs may call (model/compute/kernels/)
    host_buffers: bool = False  # one CPU device: device buffers alias the host arrays (huge pages, packed copies)
    lead_small_programs: bool = False  # serve first from the smallest programs (padding costs what rows do)

    # ---- what the options fix -------------------------------------------------------------
    @property
    def dtype(self) -> str:
        return self.options.dtype

    @property
    def jnp_dtype(self) -> Any:
        import jax.numpy as jnp

        return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[self.options.dtype]

    @property
    def quant(self) -> str | None:
        return self.options.quantization

    @property
    def deterministic(self) -> bool:
        return self.options.deterministic

    @property
    def layer_unroll(self) -> int:
        return self.options.layer_unroll

    @property
    def lora_gather(self) -> bool:
        return self.options.lora_gather

    @property
    def fixed_rows(self) -> int | None:
        """The sampler's one tile shape in the deterministic mode (None: any)."""
        return INVARIANT_ROWS if self.deterministic else None

    @property
    def cpu(self) -> bool:
        return self.platform == "cpu"

    @property
    def update_group_backend(self) -> str:
        """The torch.distributed backend a trainer's weight-update group uses here when the
        trainer names none (actors/runner/weight_group.py): NCCL between GPUs, gloo otherwise."""
        return "nccl" if self.platform == "gpu" else "gloo"

    @property
    def packs_weights(self) -> bool:
        """The kernel dots keep packed copies of the weights (reserved at start-up)."""
        return self.host_buffers and self.dot.kernel

    @property
    def summary(self) -> dict[str, Any]:
        """What `ringserve serve` prints and get_server_info reports."""
        return {"platform": self.platform, "attention_backend": self.attention, "matmul": self.dot.name,
                "layer_loop": self.layer_loop, "norm_kernel": self.block_norm.kernel, "kernels": list(self.kernels)}  # fmt: skip

    # ---- resolution -------------------------------------------------------------------------
    @classmethod
    def resolve(cls, opts: ComputeOptions, platform: str, tp: int = 1, devices: int = 1,
                rope_positions: int | None = None, ep: int = 1) -> ComputePlan:  # fmt: skip
        """The plan for `opts` on `platform` (a JAX platform name) over `tp` devices of `devices`
        in this process; `rope_positions`: the KV pages' whole span. Raises ValueError naming an
        option this platform cannot honour."""
        platform = platform_of(platform)
        cpu = platform == "cpu"
        if ep not in (1, tp):
            raise ValueError(f"ep_size={ep}: must be 1 or tp_size={tp} (the experts split over the tp devices)")
        if cpu:
            prebuild_kernels(opts, tp)
        attention = resolve_backend(opts.attention_backend, platform, opts.attention_interpret, tp)
        if opts.deterministic and not REGISTRY[attention].deterministic:
            # the kernels' tiling is theirs; the pure-JAX tiles sum in an order no shape changes
            log.warning("enable_deterministic_inference: attention backend %s -> %s", attention, DETERMINISTIC)
            attention = DETERMINISTIC
        name = resolve_dot(opts, platform, tp)
        x = opts.dtype
        w = "int8" if opts.quantization else opts.dtype
        dot = Dot(name, ((w, x, kernel_rows(w, "onednn" in name, x)),) if name.startswith("kernel") else ())
        norm = Norm(invariant=opts.deterministic)
        block_norm = dataclasses.replace(norm, kernel=norm_kernel(opts, tp, dot))
        return cls(
            options=opts, platform=platform, tp=tp, ep=ep, attention=attention, dot=dot, norm=norm, block_norm=block_norm,
            layer_loop=resolve_layer_loop(opts.layer_loop, platform, name),
            grouped=resolve_grouped(platform),
            moe_a2a_rows=MOE_A2A_ROWS.get(platform),
            vocab_major_logits=cpu and name in ("xla", "kernel") and opts.quantization is None,
            rope_table_positions=rope_positions if cpu else None,
            # extend programs sample their producing rows in groups (model/runtime/step.py
            # producing_first): a device loop of ceil(rows / group) trips, not max_batch rows
            # (TPU: a while loop on the device; not measured on an accelerator yet)
            sample_group=16 if cpu else 32,
            # prompt positions' logprobs in groups: 64 on CPU (SmolLM2, 255 positions: +0.23 s over
            # a 0.74 s step; groups of 16: +0.37 s, of 256: +2.8 s), 128 on accelerators, where each
            # iteration of a runtime-count loop costs a host round trip (not measured there yet)
            position_group=64 if cpu else 128,
            kernels=kernel_names(opts, tp) if cpu else (),
            host_buffers=cpu and devices == 1,
            lead_small_programs=cpu,
        )  # fmt: skip

    def make_backend(self, geo: Any, mesh: Any = None) -> Any:
        """The attention backend object (model/compute/attention/base.py) for `geo` on `mesh`."""
        return REGISTRY[self.attention].load().make(geo, self, mesh)

    def load_kernels(self) -> None:
        """Register now every CPU custom call this plan's programs may call. A program read back
        from disk (model/runtime/program_cache.py) is not traced, and tracing is where a kernel is
        otherwise first loaded: without this, a bf16 warm start could not read back its first
        program (no handler yet for the norm's target, whose first use is in a trace) and
        traced it again."""
        for name in self.kernels:
            _loader(name, self.options)()

    def program_cache(self, devices: int) -> bool:
        """Whether the traced programs may be kept on disk (model/runtime/program_cache.py, which
        says whether it is on at all): on CPU over one device (the platform whose start-up it is
        measured on; a multi-device program's shardings and an accelerator's custom calls stay on
        the traced path)."""
        return self.cpu and devices == 1


def resolve_backend(requested: str, platform: str, interpret: bool = False, tp: int = 1) -> str:
    """The attention backend that runs: `requested`, or for "auto" the first registered one
    whose `auto` names this platform and that can run here. Pallas kernels need their platform,
    or `interpret` (Pallas's interpreter, for tests on CPU)."""
    platform = platform_of(platform)
    if requested != "auto" and requested not in REGISTRY:
        raise ValueError(f"attention_backend={requested!r}: choose one of {['auto', *REGISTRY]}")
    if requested == "auto":
        for b in REGISTRY.values():
            if platform in b.auto:
                if (why := _why_not(b.name, platform, interpret, tp)) is None:
                    return b.name
                log.info("attention_backend=auto: not %s (%s)", b.name, why)
        return "native"
    if (why := _why_not(requested, platform, interpret, tp)) is not None:
        raise ValueError(f"attention_backend={requested!r} {why}")
    return requested


def _why_not(name: str, platform: str, interpret: bool, tp: int) -> str | None:
    b = REGISTRY[name]
    if platform not in b.platforms and not (b.interpretable and interpret):
        where = " or ".join(p.upper() for p in b.platforms)
        if b.interpretable:
            return f"needs a {where}; this platform is {platform!r} (attention_interpret=True runs the kernel in Pallas's interpreter)"
        return f"runs on {where} only; this platform is {platform!r}"
    if not b.sharded and tp != 1:
        return f"needs tp_size=1 (got {tp}): the kernel is not sharded"
    if b.kernel is not None and (why := _loader(b.kernel)()) is not None:
        return f"is not available here: {why}"
    return None


def resolve_layer_loop(layer_loop: str, platform: str, dot: str = "xla") -> str:
    """How the forward runs the decoder layers. "scan" stacks each weight over the layers and runs
    one `lax.scan` (XLA compiles one layer body); "unrolled" keeps each layer's weights in buffers
    of their own and traces every layer. Accelerators read a slice in place: scan. On CPU XLA's
    dot pays for a scan's stacked weights: the dynamic slice of layer l's weights is a copy
    (XLA:CPU's dot reads whole buffers; SmolLM2-135M: 425 MB a step, 66 of 647 ms of a batch-64
    decode step), so with XLA's dot alone CPU runs unrolled. ringserve's kernel and oneDNN's
    custom call read layer l's weights in place from the stack (model/compute/dots.py `Dot`), so
    with either CPU scans too: one layer body to compile instead of L (SmolLM2 on 2 Zen 3 cores:
    a program 2.5-3.4 s cold against ~6, 0.25-0.8 s from the cache against ~1-2; all 19 of a
    server's 56 s against 110), decode steps as fast (XLA's dots of larger steps, "kernel" only,
    multiply a slice of the stack: a 1024-token prefill ~5% slower)."""
    if layer_loop == "auto":
        return "unrolled" if platform_of(platform) == "cpu" and not Dot(dot).reads_stack else "scan"
    if layer_loop not in ("scan", "unrolled"):
        raise ValueError(f"layer_loop={layer_loop!r}: must be 'auto', 'scan' or 'unrolled'")
    return layer_loop


def matmul_weights(opts: ComputeOptions) -> str:
    """The dtype of the weights the projections and the LM head multiply: int8 where the
    configuration quantizes, else its dtype (cpu_matmul builds one library per weight dtype)."""
    return "int8" if opts.quantization else opts.dtype


def resolve_dot(opts: ComputeOptions, platform: str, tp: int = 1) -> str:
    """How the projections and the LM head multiply (model/compute/dots.py):

        invariant      the deterministic mode (its batch-invariant dot)
        kernel         CPU, f32/bf16: decode's few rows through ringserve's own kernel, which
                       streams the weights on every core (model/compute/kernels/cpu_matmul.py:
                       XLA:CPU's one-row dot runs on one core), larger steps on XLA's dot; bf16
                       where the kernel reads packed pairs (AVX512-BF16): every step
        kernel+onednn  the same, larger steps through oneDNN: bf16 and int8 weights, where XLA:CPU
                       has no fast dot (its bf16 dots: 45-140 GF/s on 2 Zen 4 cores, oneDNN 290-400)
        onednn         oneDNN for every step (asked for; or auto for f16, which the kernel lacks)
        xla            every accelerator, and CPU where neither custom call builds

    `cpu_matmul` asks for one ("auto": the best that runs here; "kernel" or "onednn": that one or
    a ValueError naming why it cannot run). The custom calls are not sharded: tp_size 1 only."""
    platform = platform_of(platform)
    want = opts.cpu_matmul
    if opts.deterministic:
        if want in ("onednn", "kernel"):
            raise ValueError(f"cpu_matmul={want!r} with enable_deterministic_inference: the deterministic mode "
                             "keeps its batch-invariant dot (use cpu_matmul='auto' or 'xla')")  # fmt: skip
        return "invariant"
    if want == "xla":
        return "xla"
    from ringserve.model.compute.kernels import cpu_matmul, onednn

    def why_not(name: str) -> str | None:
        if platform != "cpu":
            return f"it runs on CPU only; this platform is {platform!r}"
        if tp != 1:
            return f"it needs tp_size=1 (got {tp}): the custom call is not sharded"
        if name == "kernel" and opts.dtype not in ("float32", "bfloat16"):
            return f"it computes in float32 or bfloat16, not {opts.dtype}"
        if name == "kernel":
            return cpu_matmul.reason(matmul_weights(opts))
        return onednn.supports(opts.dtype, "int8" if opts.quantization else opts.dtype)

    slow_on_xla = opts.dtype in ("bfloat16", "float16") or opts.quantization is not None
    if opts.dtype == "bfloat16" and platform == "cpu" and why_not("kernel") is None:
        # the kernel reads bf16 weights (int8: of many rows) from packed pairs (AVX512-BF16) at
        # every step size, faster than oneDNN's (model/compute/dots.py PAIR_ROWS): no oneDNN,
        # and no second packed copy
        slow_on_xla = not cpu_matmul.packs_pairs(matmul_weights(opts))
    if want != "auto":
        if (why := why_not(want)) is not None:
            raise ValueError(f"cpu_matmul={want!r} is not available here: {why}")
        if want == "onednn":
            return "onednn"
        return "kernel+onednn" if slow_on_xla and why_not("onednn") is None else "kernel"
    if platform != "cpu":
        return "xla"
    kernel_why = why_not("kernel")
    onednn_why = why_not("onednn") if slow_on_xla else "not needed"
    if kernel_why is None:
        return "kernel+onednn" if onednn_why is None else "kernel"
    if onednn_why is None:
        return "onednn"
    log.info("cpu_matmul=auto: XLA's dot (kernel: %s; oneDNN: %s)", kernel_why, onednn_why)
    return "xla"


def norm_kernel(opts: ComputeOptions, tp: int, dot: Dot) -> bool:
    """cpu_norm's kernel for the blocks' residual norms: bf16 under the kernel dots, where it
    builds (never in the deterministic mode, which keeps XLA's expression)."""
    if not (dot.kernel and opts.dtype == "bfloat16" and tp == 1 and not opts.deterministic):
        return False
    from ringserve.model.compute.kernels import cpu_norm

    return cpu_norm.reason() is None


def kernel_names(opts: ComputeOptions, tp: int) -> tuple[str, ...]:
    """The CPU custom calls this configuration's programs may call (each built once per machine,
    model/compute/kernels/build.py): the KV pool's zeros, bf16 norms under the kernel dots, the
    attention backends' kernels it may pick, the matmul library of its weight dtype."""
    if tp != 1:
        return ("cpu_memory",)
    kernel_dots = opts.cpu_matmul in ("auto", "kernel")
    names = ["cpu_memory"]
    if kernel_dots and opts.dtype == "bfloat16" and not opts.deterministic:
        names.append("cpu_norm")
    names += [b.kernel for b in REGISTRY.values()
              if b.kernel and (opts.attention_backend == b.name or opts.attention_backend == "auto" and "cpu" in b.auto)]  # fmt: skip
    if kernel_dots and _matmul_loader(opts) is not None:
        names.append("cpu_matmul")
    return tuple(names)


def _matmul_loader(opts: ComputeOptions) -> Callable[[], str | None] | None:
    from ringserve.model.compute.kernels import cpu_matmul

    return cpu_matmul.loader_of(matmul_weights(opts))  # the library of this weight dtype alone (None: none)


def _loader(name: str, opts: ComputeOptions = ComputeOptions()) -> Callable[[], str | None]:
    """The `reason()` of kernel `name` (model/compute/kernels/build.py `loader`: its first call
    builds and registers the kernel); cpu_matmul's is the library of `opts`' weight dtype."""
    from ringserve.model.compute.kernels import cpu_attention, cpu_memory, cpu_norm

    if name == "cpu_matmul":
        load = _matmul_loader(opts)
        assert load is not None, "kernel_names lists cpu_matmul only where its weight dtype has a library"
        return load
    return {"cpu_memory": cpu_memory.reason, "cpu_norm": cpu_norm.reason, "cpu_attention": cpu_attention.reason}[name]


def prebuild_kernels(opts: ComputeOptions, tp: int = 1) -> None:
    """Start building, side by side, the CPU custom calls this configuration may use (each is
    built once per machine, model/compute/kernels/build.py); the first use of each waits for its own."""
    from ringserve.model.compute.kernels import build

    build.prebuild(*(_loader(n, opts) for n in kernel_names(opts, tp)))


def custom_calls() -> tuple[str, ...]:
    """The FFI targets a step program may call (its exported module names them: model/runtime/program_cache.py)."""
    from ringserve.model.compute.kernels import cpu_attention, cpu_matmul, cpu_norm, onednn

    return cpu_attention.TARGET, cpu_norm.TARGET, *cpu_matmul.TARGETS.values(), onednn.TARGET, onednn.TARGET_Q8


__all__ = ["ComputePlan", "resolve_backend", "resolve_dot", "resolve_layer_loop"]

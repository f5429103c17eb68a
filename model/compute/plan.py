"""How this platform computes a step: the projections' dot (`resolve_dot`: XLA's, ringserve's
CPU kernel, oneDNN's custom call, or the deterministic mode's batch-invariant one), the decoder
layers' loop (`resolve_layer_loop`: one scan over stacked weights, or unrolled), and the CPU
custom calls a configuration may use (`prebuild_kernels` builds them side by side at start-up;
`custom_calls` names their FFI targets for the program cache). `ModelExecutor`
(model/runtime/executor.py) asks these once, at start-up."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from ringserve.model.compute.dots import STACK_READING_DOTS

log = logging.getLogger(__name__)


class ExecutorConfig(Protocol):
    """What these choices read of model/runtime/executor.py's ExecutorConfig (named here, not imported:
    the executor imports this module)."""

    @property
    def cpu_matmul(self) -> str: ...
    @property
    def deterministic(self) -> bool: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def quantization(self) -> str | None: ...
    @property
    def attention_backend(self) -> str: ...


def resolve_layer_loop(layer_loop: str, platform: str, dot: str = "xla") -> str:
    """How the forward runs the decoder layers. "scan" stacks each weight over the layers and runs
    one `lax.scan` (XLA compiles one layer body); "unrolled" keeps each layer's weights in buffers
    of their own and traces every layer. Accelerators read a slice in place: scan. On CPU XLA's
    dot pays for a scan's stacked weights: the dynamic slice of layer l's weights is a copy
    (XLA:CPU's dot reads whole buffers; SmolLM2-135M: 425 MB a step, 66 of 647 ms of a batch-64
    decode step), so with XLA's dot alone CPU runs unrolled. ringserve's kernel and oneDNN's
    custom call read layer l's weights in place from the stack (model/compute/dots.py `matmul`), so
    with either CPU scans too: one layer body to compile instead of L (SmolLM2 on 2 Zen 3 cores:
    a program 2.5-3.4 s cold against ~6, 0.25-0.8 s from the cache against ~1-2; all 19 of a
    server's 56 s against 110), decode steps as fast (XLA's dots of larger steps, "kernel" only,
    multiply a slice of the stack: a 1024-token prefill ~5% slower)."""
    if layer_loop == "auto":
        return "unrolled" if platform == "cpu" and dot not in STACK_READING_DOTS else "scan"
    if layer_loop not in ("scan", "unrolled"):
        raise ValueError(f"layer_loop={layer_loop!r}: must be 'auto', 'scan' or 'unrolled'")
    return layer_loop


CPU_MATMULS = ("auto", "xla", "onednn", "kernel")


def matmul_weights(cfg: ExecutorConfig) -> str:
    """The dtype of the weights the projections and the LM head multiply: int8 where the
    configuration quantizes, else its dtype (cpu_matmul builds one library per weight dtype)."""
    return "int8" if cfg.quantization else cfg.dtype


def resolve_dot(cfg: ExecutorConfig, platform: str) -> str:
    """How the projections and the LM head multiply (model/compute/dots.py `matmul`):

        invariant      the deterministic mode (its batch-invariant dot)
        kernel         CPU, f32/bf16: decode's few rows through ringserve's own kernel, which
                       streams the weights on every core (model/compute/kernels/cpu_matmul.py: XLA:CPU's
                       one-row dot runs on one core), larger steps on XLA's dot; bf16 where the
                       kernel reads packed pairs (AVX512-BF16): every step
        kernel+onednn  the same, larger steps through oneDNN: bf16 and int8 weights, where XLA:CPU
                       has no fast dot (its bf16 dots: 45-140 GF/s on 2 Zen 4 cores, oneDNN 290-400)
        onednn         oneDNN for every step (asked for; or auto for f16, which the kernel lacks)
        xla            every accelerator, and CPU where neither custom call builds

    `cpu_matmul` asks for one ("auto": the best that runs here; "kernel" or "onednn": that one or
    a ValueError naming why it cannot run). The custom calls are not sharded: tp_size 1 only."""
    want = cfg.cpu_matmul
    if want not in CPU_MATMULS:
        raise ValueError(f"cpu_matmul={want!r}: must be one of {list(CPU_MATMULS)}")
    if cfg.deterministic:
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
        if cfg.tp_size != 1:
            return f"it needs tp_size=1 (got {cfg.tp_size}): the custom call is not sharded"
        if name == "kernel" and cfg.dtype not in ("float32", "bfloat16"):
            return f"it computes in float32 or bfloat16, not {cfg.dtype}"
        if name == "kernel":
            return cpu_matmul.reason(matmul_weights(cfg))
        return onednn.supports(cfg.dtype, "int8" if cfg.quantization else cfg.dtype)

    slow_on_xla = cfg.dtype in ("bfloat16", "float16") or cfg.quantization is not None
    if cfg.dtype == "bfloat16" and platform == "cpu" and why_not("kernel") is None:
        # the kernel reads bf16 weights (int8: of many rows) from packed pairs (AVX512-BF16) at
        # every step size, faster than oneDNN's (model/compute/dots.py PAIR_ROWS): no oneDNN, and no
        # second packed copy
        slow_on_xla = not cpu_matmul.packs_pairs(matmul_weights(cfg))
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


def kernel_loaders(cfg: ExecutorConfig) -> list[Callable[[], str | None]]:
    """The `reason()` of each CPU custom call this configuration's programs may call
    (model/compute/kernels/build.py `loader`: its first call builds and registers the kernel)."""
    from ringserve.model.compute.kernels import cpu_attention, cpu_matmul, cpu_memory, cpu_norm

    wanted = [cpu_memory.reason]  # the KV pool's zeros
    if cfg.tp_size == 1 and cfg.dtype == "bfloat16" and cfg.cpu_matmul in ("auto", "kernel") and not cfg.deterministic:
        wanted.append(cpu_norm.reason)  # bf16 norms under the kernel dots (model/compute/dots.py RMSNorm)
    if cfg.tp_size == 1 and cfg.attention_backend in ("auto", "cpu_kernel"):
        wanted.append(cpu_attention.reason)
    if cfg.tp_size == 1 and cfg.cpu_matmul in ("auto", "kernel") and (load := cpu_matmul.loader_of(matmul_weights(cfg))):
        wanted.append(load)  # the library of this configuration's weight dtype alone
    return wanted


def prebuild_kernels(cfg: ExecutorConfig) -> None:
    """Start building, side by side, the CPU custom calls this configuration may use (each is
    built once per machine, model/compute/kernels/build.py); the first use of each waits for its own."""
    from ringserve.model.compute.kernels import build

    build.prebuild(*kernel_loaders(cfg))


def load_kernels(cfg: ExecutorConfig) -> None:
    """Register now every CPU custom call this configuration's programs may call. A program read
    back from disk (model/runtime/program_cache.py) is not traced, and tracing is where a kernel is
    otherwise first loaded: without this, a bf16 warm start could not read back its first program
    (no handler yet for the norm's target, whose first use is in a trace) and traced it again."""
    for reason in kernel_loaders(cfg):
        reason()


def custom_calls() -> tuple[str, ...]:
    """The FFI targets a step program may call (its exported module names them: model/runtime/program_cache.py)."""
    from ringserve.model.compute.kernels import cpu_attention, cpu_matmul, cpu_norm, onednn

    return cpu_attention.TARGET, cpu_norm.TARGET, *cpu_matmul.TARGETS.values(), onednn.TARGET, onednn.TARGET_Q8

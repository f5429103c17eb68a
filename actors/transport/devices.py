"""Which devices each data-parallel group's runner gets: an environment set in the runner's
process before it imports JAX (actors/transport/actor.py `actor_main` applies `ActorSpec.env`).
The parent never imports JAX, so it counts devices from the environment and /dev:

    platform   devices on this host                          group r of dp_size gets (tp = tp_size)
    cpu        JAX_NUM_CPU_DEVICES or XLA_FLAGS'             JAX_NUM_CPU_DEVICES=tp, the XLA flag =tp
               --xla_force_host_platform_device_count (1)    (a CPU "device" is a share of the host)
    cuda/gpu   CUDA_VISIBLE_DEVICES, else /dev/nvidia<N>     CUDA_VISIBLE_DEVICES = ids[r*tp:(r+1)*tp]
    tpu        TPU_VISIBLE_CHIPS, else /dev/accel<N>         TPU_VISIBLE_CHIPS = ids[r*tp:(r+1)*tp],
               or /dev/vfio/<N>                              TPU_CHIPS_PER_PROCESS_BOUNDS=1,tp,1,
                                                             TPU_PROCESS_BOUNDS=1,1,1, TPU_PROCESS_PORT,
                                                             TPU_PROCESS_ADDRESSES=localhost:port,
                                                             CLOUD_TPU_TASK_ID=0 (tpu-inference's
                                                             `_setup_dp_chip_isolation`; untested here)

The platform is JAX_PLATFORMS' first entry when set, else the first of tpu, cuda found in /dev,
else cpu. With dp_size 1 nothing is set (the runner sees what the server sees, as before).
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from collections.abc import Mapping

__all__ = ["default_fraction", "device_memory_bytes", "group_envs", "group_memory_bytes", "memory_name", "platform"]

_CPU_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")
TPU_PORT_BASE = 8476


def platform(env: Mapping[str, str]) -> str:
    first = env.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if first:
        return "cuda" if first in ("gpu", "cuda", "rocm") else first
    if glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"):
        return "tpu"
    if glob.glob("/dev/nvidia[0-9]*"):
        return "cuda"
    return "cpu"


def _numbered(pattern: str) -> list[str]:
    return sorted((re.sub(r"\D", "", p.rsplit("/", 1)[-1]) for p in glob.glob(pattern)), key=int)


def _devices(plat: str, env: Mapping[str, str]) -> list[str]:
    """The device ids this host offers the server (cpu: as many as its virtual devices)."""
    if plat == "cpu":
        n = env.get("JAX_NUM_CPU_DEVICES")
        if n is None:
            flag = _CPU_FLAG.search(env.get("XLA_FLAGS", ""))
            n = flag[1] if flag else "1"
        return [str(i) for i in range(int(n))]
    if plat == "cuda":
        given = env.get("CUDA_VISIBLE_DEVICES")
        return [d for d in given.split(",") if d.strip()] if given is not None else _numbered("/dev/nvidia[0-9]*")
    if plat == "tpu":
        given = env.get("TPU_VISIBLE_CHIPS")
        if given is not None:
            return [d for d in given.split(",") if d.strip()]
        return _numbered("/dev/accel[0-9]*") or _numbered("/dev/vfio/[0-9]*")
    raise ValueError(f"JAX_PLATFORMS={env.get('JAX_PLATFORMS')!r}: dp_size > 1 knows cpu, cuda (gpu) and tpu")


def group_envs(dp_size: int, tp_size: int, env: Mapping[str, str] | None = None) -> list[dict[str, str]]:
    """One environment per group's runner (empty with dp_size 1). ValueError when the host has
    fewer than dp_size * tp_size devices, naming both."""
    if dp_size == 1:
        return [{}]
    env = os.environ if env is None else env
    plat = platform(env)
    devices = _devices(plat, env)
    need = dp_size * tp_size
    if len(devices) < need:
        hint = " (on CPU set JAX_NUM_CPU_DEVICES to dp_size * tp_size)" if plat == "cpu" else ""
        raise ValueError(f"dp_size={dp_size} x tp_size={tp_size} needs {need} {plat} devices; this host offers "
                         f"{len(devices)}{hint}")  # fmt: skip
    out = []
    for r in range(dp_size):
        mine = devices[r * tp_size:(r + 1) * tp_size]
        if plat == "cpu":
            flags = _CPU_FLAG.sub("", env.get("XLA_FLAGS", "")).strip()
            out.append({"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(tp_size),
                        "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={tp_size}".strip()})  # fmt: skip
        elif plat == "cuda":
            out.append({"CUDA_VISIBLE_DEVICES": ",".join(mine)})
        else:
            port = TPU_PORT_BASE + r
            out.append({"TPU_VISIBLE_CHIPS": ",".join(mine), "TPU_CHIPS_PER_PROCESS_BOUNDS": f"1,{tp_size},1",
                        "TPU_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_PORT": str(port),
                        "TPU_PROCESS_ADDRESSES": f"localhost:{port}", "CLOUD_TPU_TASK_ID": "0"})  # fmt: skip
    return out


# Run in a child: this process never imports JAX, and the child must not keep the device.
_PROBE = ("import jax; s = jax.devices()[0].memory_stats() or {}; "
          "print(s.get('bytes_limit') or s.get('bytes_reservable_limit') or 0)")


def device_memory_bytes(plat: str, env: Mapping[str, str] | None = None) -> int | None:
    """Bytes of memory one device offers: on CPU the host's available RAM (/proc/meminfo
    MemAvailable, what it can give without swapping now; else os.sysconf's free pages), elsewhere
    `memory_stats()["bytes_limit"]` of JAX's device 0, read in a short-lived child process with
    `env` (no preallocation). None when it cannot be told."""
    env = dict(os.environ if env is None else env)
    if plat == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = out.stdout.strip().splitlines()
    return int(text[-1]) or None if out.returncode == 0 and text and text[-1].isdigit() else None


# mem_fraction_static's default: on CPU the "device" is the host's RAM, which also holds the OS,
# the other processes, XLA's compile scratch and the runner's host copy of the checkpoint (a few
# GiB, as vLLM for CPU's KV space); SGLang's accelerator defaults lie in 0.8-0.9 by GPU size
DEFAULT_FRACTION = {"cpu": 0.2}
ACCELERATOR_FRACTION = 0.85


def default_fraction(plat: str) -> float:
    return DEFAULT_FRACTION.get(plat, ACCELERATOR_FRACTION)


def group_memory_bytes(plat: str, one: int, dp_size: int, tp_size: int) -> int:
    """The memory one data-parallel group's weights and KV share, of `one` device's: on CPU the
    groups share the host's RAM; on an accelerator a group has tp_size devices of its own."""
    return one // dp_size if plat == "cpu" else one * tp_size


def memory_name(plat: str) -> str:
    """What a device's memory is called in messages."""
    return "host RAM available" if plat == "cpu" else f"{plat} memory"

"""TPU chips and topologies to compile for without a TPU: libtpu (`tools/install_libtpu.sh`) gives
the devices of a named topology (`jax.experimental.topologies`), and XLA's TPU compiler compiles
against them on a CPU-only host (`ringserve compile`, model/runtime/aot.py).

The chip figures are the published ones (bf16 peak, HBM bandwidth and size, the chip's ICI
bandwidth: Google's per-chip Gbps / 8); the analytic step estimates (model/runtime/roofline.py)
divide by them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

GB = 10**9
GIB = 1 << 30


@dataclasses.dataclass(frozen=True, slots=True)
class Chip:
    name: str  # the topology prefix: v5e, v6e, v5p, v4
    hbm_bandwidth: float  # bytes/s
    bf16_flops: float  # FLOP/s (the MXUs' dense bf16 peak)
    hbm_bytes: int
    ici_bandwidth: float  # bytes/s, the chip's every link together (published Gbps / 8)


CHIPS = {
    "v5e": Chip("v5e", 819 * GB, 197e12, 16 * GB, 200 * GB),  # ICI 1,600 Gbps
    "v6e": Chip("v6e", 1640 * GB, 918e12, 32 * GB, 448 * GB),  # 3,584 Gbps
    "v5p": Chip("v5p", 2765 * GB, 459e12, 95 * GB, 600 * GB),  # 4,800 Gbps
    "v4": Chip("v4", 1200 * GB, 275e12, 32 * GIB, 300 * GB),  # 2,400 Gbps
}

# The topologies this is tested on (others libtpu knows work alike).
TOPOLOGIES = ("v5e:1x1", "v6e:1x1", "v5e:2x2", "v6e:2x4", "v5p:2x2x1", "v4:2x2x1")

LIBTPU_DIR = Path(os.environ.get("RINGSERVE_LIBTPU_DIR", Path.home() / ".cache" / "ringserve" / "libtpu"))
INSTALL = "tools/install_libtpu.sh"


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str  # "v6e:2x4"
    chip: Chip
    devices: tuple[Any, ...]  # jax TPU devices of the topology (compile-only)

    @property
    def chips(self) -> int:
        return len(self.devices)


def chip_of(topology: str) -> Chip:
    """The chip of a topology name ("v6e:2x4" -> v6e). ValueError naming the known ones."""
    gen = topology.partition(":")[0]
    if gen not in CHIPS or ":" not in topology:
        raise ValueError(f"topology={topology!r}: must be <chip>:<shape> with chip one of {', '.join(CHIPS)} "
                         f"(e.g. {', '.join(TOPOLOGIES)})")  # fmt: skip
    return CHIPS[gen]


def ensure_libtpu() -> None:
    """Make libtpu importable: as installed, else from LIBTPU_DIR (tools/install_libtpu.sh puts it
    there, outside any venv), else a ValueError naming the install command. Compile-only: the
    caller keeps JAX on CPU (JAX_PLATFORMS=cpu), so no TPU is looked for. Several compiling
    processes may load libtpu at once (its lockfile is for processes driving real chips)."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if importlib.util.find_spec("libtpu") is not None:
        return
    if (LIBTPU_DIR / "libtpu").is_dir():
        sys.path.append(str(LIBTPU_DIR))
        importlib.invalidate_caches()
        return
    raise ValueError(f"compiling for TPU needs libtpu, which is not installed: run {INSTALL} "
                     f"(it installs into {LIBTPU_DIR})")  # fmt: skip


def tpu_topology(name: str) -> Topology:
    """The compile-only devices of topology `name` (libtpu must be importable: ensure_libtpu).
    A one-chip topology is asked for with one chip per host (libtpu's default host is 2x2)."""
    chip = chip_of(name)
    from jax.experimental import topologies

    shape = name.partition(":")[2]
    n = 1
    for d in shape.split("x"):
        n *= int(d) if d.isdigit() else 0
    if n < 1:
        raise ValueError(f"topology={name!r}: the shape must be chips per axis, e.g. 2x4 or 2x2x1")
    # what a host of that slice is told (libtpu asks the metadata server otherwise, and warns)
    cores = n * 2 if chip.name in ("v5p", "v4") else n  # (their slice names count TensorCores)
    os.environ.setdefault(
        "TPU_ACCELERATOR_TYPE", f"{'v5litepod' if chip.name == 'v5e' else chip.name}-{cores}"
    )
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    kw: dict[str, Any] = {}
    if n == 1:
        kw["chips_per_host_bounds"] = (1, 1, 1)
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=name, **kw)
    except Exception as e:  # libtpu's own words (an unknown shape, a chip it does not know)
        raise ValueError(f"topology={name!r}: libtpu refused it ({type(e).__name__}: {e})") from None
    return Topology(name, chip, tuple(desc.devices))

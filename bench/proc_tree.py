"""Memory and CPU of a server's whole process tree, read from /proc (Linux; no dependency).

A server is a tree (ringserve: the frontend plus its scheduler, runner and detokenizer; vLLM: the
API server plus its engine core; llama.cpp: one process), so every figure is a sum over the
root and its descendants at the moment of the sample:

    rss   resident pages of each process, added up (a page shared by two processes counts twice)
    pss   proportional set size: a shared page counts 1/n in each of its n users, so the sum
          counts it once (shared-memory rings, the same library mapped by every process)
    cpu   user + system seconds of the live processes (a process that exited takes its seconds
          with it, so compare figures of a tree whose processes live through the interval)

`TreeSampler` samples RSS in a thread every `interval` seconds and keeps the peaks; PSS only
when asked (`sample(pss=True)`, between a harness's timed phases). Reading smaps_rollup walks
every page table of a process: read every 0.5 s during a 44 s burst it cost 3.2 CPU-s of this
2-core machine and 7% of ringserve's throughput (212.5 against 228.7 tok/s), statm costs nothing.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")
TICKS = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (which may hold spaces): field 0 is the state."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return text[text.rfind(")") + 2 :].split()


def tree_pids(root: int) -> list[int]:
    """`root` and every descendant alive now (root first); [] once the root is gone."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            f = _stat_fields(int(entry.name))
            if f is not None:
                children.setdefault(int(f[1]), []).append(int(entry.name))  # f[1]: ppid
    if not Path(f"/proc/{root}").exists():
        return []
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def rss_bytes(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError):
        return 0


def pss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


def cpu_seconds(pid: int) -> float:
    f = _stat_fields(pid)
    return 0.0 if f is None else (int(f[11]) + int(f[12])) / TICKS  # utime, stime


def tree_usage(root: int, pss: bool = True) -> dict[str, float]:
    """{rss_mb, pss_mb, cpu_s, processes} of the tree now (pss_mb 0 with pss=False)."""
    pids = tree_pids(root)
    return {
        "rss_mb": sum(rss_bytes(p) for p in pids) / 2**20,
        "pss_mb": sum(pss_bytes(p) for p in pids) / 2**20 if pss else 0.0,
        "cpu_s": sum(cpu_seconds(p) for p in pids),
        "processes": len(pids),
    }


class TreeSampler:
    """Peak RSS of the tree of `root`, sampled every `interval` s until `stop()`; peak PSS of the
    samples taken with `sample(pss=True)`."""

    def __init__(self, root: int, interval: float = 0.5) -> None:
        self.root = root
        self.interval = interval
        self.peak_rss_mb = 0.0
        self.peak_pss_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"tree-sampler-{root}", daemon=True)

    def start(self) -> TreeSampler:
        self._thread.start()
        return self

    def sample(self, pss: bool = False) -> dict[str, float]:
        u = tree_usage(self.root, pss)
        self.peak_rss_mb = max(self.peak_rss_mb, u["rss_mb"])
        self.peak_pss_mb = max(self.peak_pss_mb, u["pss_mb"])
        return u

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

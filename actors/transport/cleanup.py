"""`ringserve cleanup`: the rs-<pid>-* shared-memory segments and semaphores in /dev/shm whose
creating process is gone (a killed server's), removed; those of live processes kept. `serve`
runs `remove_stale` at its start.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable

_NAME = re.compile(r"(?:sem\.)?rs-(\d+)-[0-9a-f]+-")


def _pid_alive(pid: int) -> bool:
    """True if `pid` is a running process (a zombie is dead: it will never touch a segment)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True


def cleanup_main(argv: list[str] | None = None) -> int:
    """`ringserve cleanup [--dry-run]`: remove rs-<pid>-* segments and semaphores in /dev/shm
    whose creating process is gone; keep those of live processes."""
    parser = argparse.ArgumentParser(prog="ringserve cleanup", description=cleanup_main.__doc__)
    parser.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    parser.add_argument("--shm-dir", default="/dev/shm", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    removed, kept = remove_stale(args.shm_dir, args.dry_run, print)
    verb = "would remove" if args.dry_run else "removed"
    print(f"{verb} {removed}, kept {kept} of live processes")
    return 0


def remove_stale(shm_dir: str = "/dev/shm", dry_run: bool = False,
                 say: Callable[[str], None] | None = None) -> tuple[int, int]:  # fmt: skip
    """Remove the rs-<pid>-* segments and semaphores whose creating process is gone (a killed
    server's); (removed, kept of live processes). `ringserve cleanup`, and `serve` at its start."""
    removed = kept = 0
    for entry in sorted(os.listdir(shm_dir)):
        m = _NAME.match(entry)
        if m is None:
            continue
        if _pid_alive(int(m[1])):
            kept += 1
            continue
        path = os.path.join(shm_dir, entry)
        if not dry_run:
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            except PermissionError as e:
                if say is not None:
                    say(f"cannot remove {path}: {e}")
                continue
        removed += 1
        if say is not None:
            say(f"{'would remove' if dry_run else 'removed'} {path}")
    return removed, kept

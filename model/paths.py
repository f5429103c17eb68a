"""Where ringserve keeps what it makes or fetches (see resolve.py for what a model name means).

    $RINGSERVE_CACHE (default ~/.cache/ringserve)/
        models/tiny-<family>-s<seed>/   the generated tiny checkpoints (`tiny`)
        smollm2-135m-instruct/          `ringserve fetch-model smollm2`
        gguf-tokenizers/<hash>/         tokenizer files rebuilt from a .gguf
        tokenizers/<hash>.json          a tokenizer's backend, for the actors that only decode
        kernels/<name>-<hash>.so        the CPU custom calls, built here (model/compute/kernels/build.py)
        xla/                            the persistent compilation cache
        programs/                       traced step programs, exported (model/runtime/program_cache.py)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """The cache root, or a path inside it (nothing is created)."""
    root = Path(os.environ.get("RINGSERVE_CACHE") or Path.home() / ".cache" / "ringserve")
    return root.joinpath(*parts)


@contextlib.contextmanager
def atomic_dir(out: Path) -> Iterator[Path]:
    """A temporary directory beside `out` to fill; it replaces `out` whole when the block ends
    without error (a half-written checkpoint is never seen at `out`), and is removed otherwise."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


@contextlib.contextmanager
def one_maker(out: Path) -> Iterator[None]:
    """Held while this process makes `out`: another maker of it, in any process or thread, waits
    here (an exclusive flock on `<out>.lock`, 0600), then finds it made. A first start's actors
    each make the same things at once (the CPU kernels, a tokenizer's cached spec): one makes,
    the others wait, instead of every process paying for it on the same cores."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{out}.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)

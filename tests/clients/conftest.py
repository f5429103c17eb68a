"""The RL frameworks' own code against ringserve: each framework lives in a venv of its own
(tools/install_clients.sh), and a test here runs a script in it with this checkout on
PYTHONPATH; a framework that is not installed is skipped, naming the install command."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def client_python(name: str) -> Path:
    """The framework's venv's python, or a skip saying how to install it."""
    base = Path(
        os.environ.get("CLIENTS_DIR")
        or Path(os.environ.get("RINGSERVE_CACHE") or Path.home() / ".cache" / "ringserve") / "clients"
    )
    py = base / name / "bin" / "python"
    if not (base / name / ".installed").is_file() or not py.exists():
        pytest.skip(f"{name} is not installed in its own venv: tools/install_clients.sh {name}")
    return py


def run_script(python: Path, script: str, *args: str, timeout: float = 1500, env: dict | None = None) -> dict:
    """Run tests/clients/<script> under `python` with the checkout first on PYTHONPATH; the JSON
    object it prints last."""
    e = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
    r = subprocess.run([str(python), str(ROOT / "tests" / "clients" / script), *args], cwd=ROOT, env=e,
                       capture_output=True, text=True, timeout=timeout)  # fmt: skip
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert r.returncode == 0 and lines, (
        f"{script} failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    )
    return json.loads(lines[-1])

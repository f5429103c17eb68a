"""The linters configured in pyproject.toml run as part of the suite (so CI runs them)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str:
    exe = Path(sys.executable).with_name(name)
    found = str(exe) if exe.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed: install the test extra (pip install -e '.[test]')")
    return found


def test_ruff_clean():
    r = subprocess.run([_tool("ruff"), "check", "ringserve", "actors", "kvmem", "model", "integrations", "tests", "bench", "tools"], cwd=ROOT,
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]


def test_mypy_clean(tmp_path):
    """mypy over the package as it installs (`ringserve`, its parts beneath it: pyproject.toml's
    package-dir), laid out with links so that every import resolves to its module."""
    pkg = tmp_path / "ringserve"
    pkg.mkdir()
    (pkg / "__init__.py").symlink_to(ROOT / "ringserve" / "__init__.py")
    for part in ("actors", "kvmem", "model", "integrations"):
        (pkg / part).symlink_to(ROOT / part)
    r = subprocess.run([_tool("mypy"), "--config-file", str(ROOT / "pyproject.toml"), "-p", "ringserve"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]
    assert "source files" in r.stdout, r.stdout


def test_the_wheel_lists_every_package():
    """pyproject.toml names each package of the wheel (package-dir maps the repository's folders
    beneath `ringserve`): a folder left out would install without its modules."""
    import tomllib

    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    want = {"ringserve"}
    for part in ("actors", "kvmem", "model", "bench", "integrations"):
        assert conf["package-dir"][f"ringserve.{part}"] == part
        want |= {"ringserve." + ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / part).rglob("__init__.py")}
    assert set(conf["packages"]) == want


def test_the_wheel_installs_one_top_level_name(tmp_path):
    """`pip install .` puts `ringserve` alone at the top of site-packages: its parts beneath it, the
    kernels' sources (compiled on first use) beside their loaders, no generic names (`model`,
    `bench`) to collide with an RL framework's own modules."""
    import zipfile

    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
                        str(ROOT)], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (wheel,) = tmp_path.glob("ringserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"ringserve", wheel.name.split("-py3")[0] + ".dist-info"}
    for want in ("ringserve/__init__.py", "ringserve/actors/frontend/engine.py", "ringserve/model/families/llama.py",
                 "ringserve/model/compute/kernels/cpu_matmul.cc", "ringserve/model/compute/kernels/simd.h",
                 "ringserve/kvmem/radix.py", "ringserve/bench/serving.py"):  # fmt: skip
        assert want in names, want
    entry = zipfile.ZipFile(wheel).read(wheel.name.split("-py3")[0] + ".dist-info/entry_points.txt").decode()
    assert "ringserve = ringserve.actors.cli.main:main" in entry

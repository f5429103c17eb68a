"""The code base's shape, as DESIGN.md fixes it: no import cycle anywhere in the packages,
dependencies pointing one way, one owner per concept (one SamplingParams class)."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("actors", "kvmem", "model")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = ("ringserve", *f.relative_to(ROOT).with_suffix("").parts)
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = f
    return mods


def _imports(path: Path, known: set[str]) -> set[str]:
    """Internal modules `path` imports anywhere (module level, functions, TYPE_CHECKING)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from a.b import c` imports a.b, and a.b.c when c is a module
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n:
                out.add(n)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: _imports(p, known) - {m} for m, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_the_packages():
    graph = import_graph()
    assert len(graph) > 50, "the walk found too few modules"
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_dependencies_point_one_way():
    """kvmem and model never import actors; kvmem imports no JAX (it is NumPy only)."""
    graph = import_graph()
    for mod, deps in graph.items():
        if mod.startswith(("ringserve.kvmem", "ringserve.model")):
            assert not [d for d in deps if d.startswith("ringserve.actors")], mod
        if mod.startswith("ringserve.kvmem"):
            assert not [d for d in deps if d.startswith("ringserve.model")], mod
    for f in (ROOT / "kvmem").rglob("*.py"):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not [n for n in names if n.split(".")[0] in ("jax", "jaxlib", "flax")], f


def test_exactly_one_sampling_params_class():
    found = []
    for f in ROOT.rglob("*.py"):
        if ".venv" in f.parts or "build" in f.parts:
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ClassDef) and node.name == "SamplingParams":
                found.append(str(f.relative_to(ROOT)))
    assert found == ["actors/transport/sampling.py"]


# ---- rooms: process folders, the floor below them, the composition root ----------------------
PROCESS_FOLDERS = ("frontend", "scheduler", "runner", "detokenizer", "relay")
JAX_NAMES = ("jax", "jaxlib", "flax")


def _room(mod: str) -> str | None:
    """The process folder of an actors module ("scheduler" for actors.scheduler.core), or None."""
    parts = mod.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["ringserve", "actors"] and parts[2] in PROCESS_FOLDERS else None


def room_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where a process folder imports another process folder, or
    the floor below them (actors.transport, actors.server_args, .server_options) imports a process folder."""
    bad = []
    for mod, deps in graph.items():
        mine = _room(mod)
        below = mod.startswith(("ringserve.actors.transport", "ringserve.actors.server_args", "ringserve.actors.server_options"))
        for d in deps:
            theirs = _room(d)
            if theirs is not None and (below or (mine is not None and theirs != mine)):
                bad.append((mod, d))
    return sorted(bad)


def test_process_folders_never_import_one_another():
    """frontend, scheduler, runner, detokenizer and relay import transport, kvmem and model (and the
    shared ServerArgs), never each other; transport imports none of them."""
    graph = import_graph()
    assert {r for r in map(_room, graph) if r} == set(PROCESS_FOLDERS)
    assert room_violations(graph) == []


def test_the_room_check_finds_a_crossing():
    graph = {"ringserve.actors.scheduler.req": {"ringserve.actors.detokenizer.core", "kvmem"}, "ringserve.actors.transport.messages": {"ringserve.actors.frontend.x"},
             "ringserve.actors.cli.main": {"ringserve.actors.frontend.engine"}, "ringserve.actors.runner.core": {"ringserve.actors.runner.slot_mirrors"}}  # fmt: skip
    assert room_violations(graph) == [("ringserve.actors.scheduler.req", "ringserve.actors.detokenizer.core"),
                                      ("ringserve.actors.transport.messages", "ringserve.actors.frontend.x")]  # fmt: skip


def _jax_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        found += [n for n in names if n.split(".")[0] in JAX_NAMES]
    return found


def test_scheduler_frontend_and_transport_never_import_jax():
    """Written nowhere in their files (not even inside a function), and not pulled in by what
    they import: importing every module of theirs in a fresh interpreter leaves JAX unloaded."""
    import subprocess
    import sys

    mods = []
    for room in ("scheduler", "frontend", "transport", "detokenizer", "relay"):
        for f in sorted((ROOT / "actors" / room).rglob("*.py")):
            assert _jax_imports(f) == [], f
            mods.append(".".join(("ringserve", *f.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__"))
    code = ("import importlib, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {JAX_NAMES!r}))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_jax_check_sees_an_import_inside_a_function(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    import jax.numpy as jnp\n    from flax import nnx\n")
    assert _jax_imports(f) == ["jax.numpy", "flax"]


def test_only_the_cli_reaches_up_into_bench():
    """bench/ sits above the engine; the one sanctioned arrow up is `ringserve bench`."""
    up = set()
    for f in ROOT.glob("*/**/*.py"):
        rel = f.relative_to(ROOT)
        if rel.parts[0] not in PACKAGES:
            continue
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.split(".")[:2] == ["ringserve", "bench"] for n in names):
                up.add(str(rel))
    assert up == {"actors/cli/bench.py"}


# ---- the model: one compute plan, one file per family ------------------------------------------
# Strings that name a compute path: platforms, the dots, the attention backends. Compared anywhere
# but where the plan is made (model/compute/: the plan, the platform facts, the backends' and
# kernels' registries and their own implementations) and where the launcher places processes on
# devices (actors/transport/devices.py), they are a compute-path decision made twice.
PATH_NAMES = frozenset({"cpu", "gpu", "tpu", "cuda", "rocm", "xla", "invariant", "onednn", "kernel", "kernel+onednn",
                        "native", "cpu_kernel", "bucketed", "pallas", "pallas_gpu"})  # fmt: skip
PLAN_HOMES = ("model/compute/", "actors/transport/devices.py")


def _path_strings(node: ast.AST) -> list[str]:
    """The compute-path names a comparison operand or a startswith() argument holds."""
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return [i.value for i in items if isinstance(i, ast.Constant) and i.value in PATH_NAMES]


def path_decisions(source: str, name: str = "<code>") -> list[str]:
    """'line: name' of each comparison against a compute-path name in `source` (==, !=, in, not
    in, is; .startswith / .endswith)."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Compare):
            names = [s for op in (node.left, *node.comparators) for s in _path_strings(op)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("startswith", "endswith"):
            names = [s for a in node.args for s in _path_strings(a)]
        else:
            continue
        found += [f"{node.lineno}: {n}" for n in names]
    return found


def test_compute_paths_are_decided_in_the_plan_alone():
    """No platform, dot or attention-backend name is compared outside model/compute/ (and the
    launcher's device placement): the model, the runtime and the actors ask the plan."""
    bad = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            rel = str(f.relative_to(ROOT))
            if rel.startswith(PLAN_HOMES):
                continue
            if found := path_decisions(f.read_text(), rel):
                bad[rel] = found
    assert bad == {}


def test_the_path_check_finds_a_decision():
    code = 'if platform == "cpu": pass\nif dot.startswith(("kernel", "x")): pass\nok = name in ("a", "b")\nif b in ["tpu"]: pass\n'
    assert path_decisions(code) == ["1: cpu", "2: kernel", "4: tpu"]


# model/'s parts, lowest first: a part imports only parts below it
MODEL_LAYERS = (("config", "paths"), ("compute",), ("layers",), ("families",), ("checkpoints",), ("weights",), ("runtime",))


def model_part_arrows(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, imported) among model/'s top-level parts (its folders and root modules)."""
    def part(mod: str) -> str | None:
        parts = mod.split(".")
        return parts[2] if len(parts) > 2 and parts[:2] == ["ringserve", "model"] else None

    return {(part(m), part(d)) for m, deps in graph.items() for d in deps  # type: ignore[misc]
            if part(m) and part(d) and part(m) != part(d)}  # fmt: skip


def test_model_parts_import_downward_only():
    """config/paths <- compute <- layers <- families <- checkpoints <- weights <- runtime."""
    rank = {name: i for i, names in enumerate(MODEL_LAYERS) for name in names}
    arrows = model_part_arrows(import_graph())
    assert {a for a, _ in arrows} | {b for _, b in arrows} <= set(rank)
    assert [(a, b) for a, b in sorted(arrows) if rank[a] <= rank[b]] == []
    assert len(arrows) >= 10  # (the walk found them)


FAMILY_FILES = sorted(p for p in (ROOT / "model" / "families").glob("*.py") if p.stem not in ("__init__", "base"))


def test_a_family_file_imports_no_other_family_and_no_jax_at_import():
    """A family is its own file: it composes model/layers/ and model/families/base.py, never another
    family's file; and it imports no JAX where it is imported (the frontend reads configs through
    the registry), only inside the function that builds its module tree."""
    graph = import_graph()
    fams = {f"ringserve.model.families.{p.stem}" for p in FAMILY_FILES}
    assert len(fams) >= 3
    for mod in fams:
        assert graph[mod] & fams == set(), mod
    for p in FAMILY_FILES:
        top = [n for n in ast.parse(p.read_text()).body if isinstance(n, ast.Import | ast.ImportFrom)]
        names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names] + [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        assert not [n for n in names if n.split(".")[0] in JAX_NAMES or n.startswith("ringserve.model.layers")], p


def test_every_family_is_registered_and_serves_its_architectures():
    from ringserve.model.families import ARCHITECTURES, FAMILIES

    registered = {f.__module__ for f in (type(f) for f in FAMILIES.values())}  # (Family instances)
    assert registered == {"ringserve.model.families.base"}
    import importlib

    from ringserve.model.families.base import Family

    listed = set(map(id, FAMILIES.values()))
    for p in FAMILY_FILES:  # every file defines a family, and every family it defines is listed
        mod = importlib.import_module(f"ringserve.model.families.{p.stem}")
        defined = [v for v in vars(mod).values() if isinstance(v, Family)]
        assert defined and all(id(f) in listed for f in defined), p
    assert all(ARCHITECTURES[a] is f for f in FAMILIES.values() for a in f.architectures)


# ---- the map matches the house --------------------------------------------------------------
PATH_RE = re.compile(r"(?<![\w./-])((?:\.?[\w-]+/)+[\w-]+\.(?:py|md|sh|toml|json))\b")
ROOTS = ("", "actors/", "kvmem/", "model/", "bench/", "tests/", "tools/")


@functools.cache
def _directories() -> frozenset[str]:
    """Names of the repository's directories (where a named path may start)."""
    out = {".ci"}
    for top in ("actors", "kvmem", "model", "bench", "tests", "tools"):
        out |= {top} | {d.name for d in (ROOT / top).rglob("*") if d.is_dir() and d.name != "__pycache__"}
    return frozenset(out)


def named_paths(text: str) -> set[str]:
    """Repository paths (`dir/file.ext` starting at one of the repository's directories) a
    text names; an example output such as `out/run.json` is not one."""
    dirs = _directories()
    return {p for p in PATH_RE.findall(text) if p.split("/")[0] in dirs}


def missing(paths: set[str]) -> list[str]:
    """Paths that exist neither from the repository root nor inside one of the packages
    (docstrings often write `runner/core.py` for actors/runner/core.py)."""
    return sorted(p for p in paths if not any((ROOT / (r + p)).exists() for r in ROOTS))


def _docstrings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]
    return [d for d in (ast.get_docstring(n) for n in nodes) if d]


def test_every_path_a_docstring_names_exists():
    bad = {}
    for f in ROOT.glob("*/**/*.py"):
        rel = f.relative_to(ROOT)
        if rel.parts[0] not in (*PACKAGES, "bench", "tests", "tools"):
            continue
        gone = missing({p for d in _docstrings(f) for p in named_paths(d)})
        if gone:
            bad[str(rel)] = gone
    assert bad == {}


def test_every_path_the_architecture_document_names_exists():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    assert len(named_paths(text)) > 30, "the map names the files of a request's walk"
    assert missing(named_paths(text)) == []


def test_the_path_check_finds_a_missing_file():
    text = "see actors/runner_state.py and runner/core.py (model/runtime/step.py)."
    assert named_paths(text) >= {"actors/runner_state.py", "runner/core.py", "model/runtime/step.py"}
    assert missing(named_paths(text)) == ["actors/runner_state.py"]


def test_tests_mirror_the_packages():
    """tests/actors/<folder>/ for every folder of actors/ that has logic, tests/<pkg>/ for each
    package; the only test files at the top are the project-wide ones."""
    for folder in (*PROCESS_FOLDERS, "transport"):
        assert sorted((ROOT / "tests" / "actors" / folder).glob("test_*.py")), folder
    for pkg in ("kvmem", "model", "engine", "bench"):
        assert sorted((ROOT / "tests" / pkg).glob("test_*.py")), pkg
    assert sorted(p.name for p in (ROOT / "tests").glob("test_*.py")) == ["test_readme.py", "test_structure.py", "test_tooling.py"]

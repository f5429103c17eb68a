"""Checkpoint reading: HF safetensors directories and `.gguf` files, into NumPy.

safetensors' own NumPy backend refuses bf16, so the (simple, documented) file format is read
here directly: an 8-byte little-endian header length, a JSON header
`{name: {dtype, shape, data_offsets: [begin, end]}}`, then the raw tensor bytes. Tensors are
memory-mapped, so loading a checkpoint costs no copy until a tensor is placed on device.
"""

from __future__ import annotations

import functools
import json
import mmap
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ringserve.model.config import ModelConfig
from ringserve.model.families import parse_config, read_config


@functools.cache
def _numpy_dtypes() -> dict[str, np.dtype]:
    """safetensors' dtype names as NumPy's (ml_dtypes for bfloat16: imported here, on the first
    read of tensors, as it takes 0.45 s of CPU that the processes reading headers alone skip)."""
    import ml_dtypes

    return {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
            "F64": np.dtype(np.float64), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
            "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_)}  # fmt: skip


def safetensors_header(path: str | Path) -> tuple[dict[str, dict], int]:
    """One .safetensors file's header, {name: {dtype, shape, data_offsets}} (its __metadata__
    left out), and the byte its tensors' data starts at. ValueError naming the file when it is
    not one."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(
                f"{path}: truncated or not a safetensors file (header length {n} > file size {size})"
            )
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: malformed safetensors header ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def read_safetensors(path: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, array) for every tensor of one .safetensors file (memory-mapped, read-only)."""
    path = Path(path)
    header, start = safetensors_header(path)
    size = path.stat().st_size
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=start) if size > start else np.zeros(0, np.uint8)
    dtypes = _numpy_dtypes()
    for name, info in header.items():
        dt = dtypes.get(str(info.get("dtype")))
        if dt is None:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
        begin, end = info["data_offsets"]
        if end > mm.size:
            raise ValueError(f"{path}: tensor {name!r} ends at byte {end} past the end of the file")
        yield name, mm[begin:end].view(dt).reshape(info["shape"])


def release_pages(tensors: dict[str, np.ndarray]) -> int:
    """Drop this process's resident pages of the memory-mapped tensors among `tensors` (they stay
    in the page cache; a later read faults them back in from it): once the served state is built
    from them, the checkpoint's pages would otherwise count in the process's RSS for as long as
    it serves (SmolLM2 f32: 525 MB). Returns the bytes of mappings advised."""
    maps = {id(m): m for t in tensors.values() if (m := getattr(t, "_mmap", None)) is not None}
    for m in maps.values():
        m.madvise(mmap.MADV_DONTNEED)  # read-only shared mapping: the file's contents come back
    return sum(len(m) for m in maps.values())


def load_checkpoint(model_path: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Config and HF-named NumPy tensors from a model directory or a `.gguf` file."""
    path = Path(model_path)
    if path.suffix == ".gguf":  # converted in memory on every load (model/checkpoints/gguf.py)
        from ringserve.model.checkpoints.gguf import read_gguf_weights

        config_dict, gguf_tensors = read_gguf_weights(path)
        return parse_config(config_dict, source=str(path)), gguf_tensors
    config = read_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors weight files in the model directory")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        tensors.update(read_safetensors(f))
    return config, tensors

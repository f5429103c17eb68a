"""Weights in buckets: HF-named tensors cut into bounded buckets, laid out in a shared-memory
segment (a push from another process on this host) or in a safetensors blob (a push over HTTP),
and the checks the server applies to a bucket's header before the runner reads a byte of it.

A piece is a run of whole rows (along dim 0) of one tensor. A tensor that fits the room left in
the bucket goes whole; one that does not starts the next bucket; one larger than a bucket is cut
into pieces of as many rows as fit, in order (a row larger than the bucket is refused, naming
the tensor and `bucket_bytes`); a bucket holds at most one piece of a tensor (a blob's names
are keys). So a bucket never holds more than `bucket_bytes` of data, and a
trainer that hands over a generator holds one bucket at a time.

One segment (`bucket_bytes` long, ftruncated: memory only where written; the writer reserves
what it writes with fallocate, so a full /dev/shm is an OSError, never a SIGBUS):

    0                                                                 used        bucket_bytes
    ┌───────────┬───┬──────────────┬───┬───────────────────────┬───┬──────────────┐
    │ piece 0   │pad│ piece 1      │pad│ piece 2 (rows a:b of t)│pad│   untouched   │
    └───────────┴───┴──────────────┴───┴───────────────────────┴───┴──────────────┘
    every piece starts at a multiple of ALIGN bytes; its header (TensorPiece) names it

A value may be `Rows(start, array)` (model/weights/delta.py): only rows [start, stop) of that
tensor, the others kept; its pieces are marked `sparse` and their `shape[0]` is `stop` (the
server checks it against the served tensor).

One safetensors blob (the standard format, readable by `safetensors.numpy.load`): an 8-byte
little-endian header length, the JSON header, then the pieces' bytes back to back. A piece that
is not a whole tensor has the shape of its rows, and `__metadata__` maps its name to
"<first row>/<rows of the whole tensor>", or for rows of a sparse tensor
"<first row>/<stop>/sparse".
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import re
import struct
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from ringserve.actors.frontend.protocol import TensorPiece
from ringserve.kvmem.allocator import cdiv
from ringserve.model.weights.delta import Rows

ALIGN = 64  # bytes; a piece's offset in a segment
BUCKET_BYTES = 512 << 20  # verl's default bucket
MAX_BUCKET_BYTES = 4 << 30  # per segment; a push has at most MAX_SLOTS of them
MAX_SLOTS = 4
MAX_NAME = 512  # characters of a tensor name
MAX_DIMS = 8
MAX_HEADER_BYTES = 16 << 20  # a safetensors blob's JSON header
# the weights' dtypes by name, and their bytes (names alone: ml_dtypes, NumPy's bfloat16, takes
# 0.45 s of CPU to import, and the frontend's process needs it only for a torch bf16 tensor)
DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}
SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_ST_NAME = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def check_bucket_bytes(bucket_bytes: Any) -> int:
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or not 1 <= bucket_bytes <= MAX_BUCKET_BYTES:
        raise ValueError(f"bucket_bytes={bucket_bytes!r} must be an integer in [1, {MAX_BUCKET_BYTES}]")
    return bucket_bytes


# ---- the writer's side (a trainer's process, or the Engine's) --------------------------------
def host_array(name: Any, a: Any) -> np.ndarray:
    """A weight as a C-contiguous host array: NumPy, JAX (copied to the host here) or a torch
    tensor (bfloat16 included); ValueError naming the tensor for anything but float32, float16,
    bfloat16."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME:
        raise ValueError(f"tensor name {name!r:.80}: a non-empty string of at most {MAX_NAME} characters")
    if type(a).__module__.split(".")[0] == "torch":
        a = _torch_to_numpy(a)
    a = np.ascontiguousarray(np.asarray(a))
    if a.dtype.name not in DTYPES:
        raise ValueError(f"tensor {name!r} has dtype {a.dtype.name}; weights must be one of {list(DTYPES)}")
    if a.ndim > MAX_DIMS:
        raise ValueError(f"tensor {name!r} has {a.ndim} dimensions; at most {MAX_DIMS}")
    return a


def _torch_to_numpy(t: Any) -> Any:
    import ml_dtypes
    import torch  # only ever reached with a torch tensor in hand

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:  # NumPy has no bfloat16: the same bits as ml_dtypes'
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _up(n: int, align: int) -> int:
    return cdiv(n, align) * align


def _rows(a: np.ndarray) -> int:
    return a.shape[0] if a.ndim else 1


@dataclasses.dataclass(slots=True)
class Piece:
    name: str
    array: np.ndarray  # the whole tensor (or the rows sent of a sparse one), C-contiguous
    start: int  # rows [start, stop) of `array` along dim 0 (a 0-d tensor is one row)
    stop: int
    offset: int  # in the segment, or in the blob's data
    first: int = 0  # the tensor's row where `array` begins (a sparse tensor's Rows.start)
    sparse: bool = False  # some rows of the tensor (Rows), the others kept

    @property
    def row_bytes(self) -> int:
        return self.array.nbytes // max(_rows(self.array), 1)

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * self.row_bytes

    def data(self) -> np.ndarray:
        """The piece's bytes (a view, no copy)."""
        return self.array.reshape(-1).view(np.uint8)[self.start * self.row_bytes : self.stop * self.row_bytes]

    @property
    def shape(self) -> list[int]:
        """The tensor's shape on the wire: a sparse one's dim 0 ends where its rows do."""
        a = self.array
        return [self.first + a.shape[0], *a.shape[1:]] if self.sparse else list(a.shape)

    def header(self) -> TensorPiece:
        return TensorPiece(self.name, self.array.dtype.name, self.shape, self.offset, self.nbytes,
                           self.first + self.start, self.sparse)  # fmt: skip


def _named(named: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """(name, array or Rows) pairs; a value that is a list of Rows is one pair each."""
    items = named.items() if isinstance(named, Mapping) else named
    for i, item in enumerate(items):
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise ValueError(f"named_tensors[{i}]: expected a (name, array) pair")
        name, value = item
        if isinstance(value, list | tuple) and value and all(isinstance(v, Rows) for v in value):
            for rows in value:
                yield name, rows
        else:
            yield name, value


def buckets(named: Mapping[str, Any] | Iterable[tuple[str, Any]], bucket_bytes: int,
            align: int = ALIGN) -> Iterator[list[Piece]]:  # fmt: skip
    """The tensors (or `Rows` of them) as buckets of pieces, each bucket's data at most
    `bucket_bytes` (offsets from 0, each a multiple of `align`). Lazy: a generator of tensors is
    read as the buckets go."""
    check_bucket_bytes(bucket_bytes)
    seen: dict[str, bool] = {}  # name: sent as Rows (a tensor's disjoint Rows may come in several values)
    bucket: list[Piece] = []
    used = 0
    for name, value in _named(named):
        sparse = isinstance(value, Rows)
        a = host_array(name, value.array if sparse else value)
        first = int(value.start) if sparse else 0
        if name in seen and not (sparse and seen[name]):
            raise ValueError(f"named_tensors: tensor {name!r} appears twice (only its Rows may: disjoint ones)")
        seen[name] = sparse
        rows = _rows(a)
        row_bytes = a.nbytes // max(rows, 1)
        if row_bytes > bucket_bytes:
            raise ValueError(f"tensor {name!r}: one row of {row_bytes} bytes does not fit bucket_bytes={bucket_bytes}")
        again = any(pc.name == name for pc in bucket)  # one piece of a tensor a bucket: a blob's names are keys
        whole = a.nbytes <= bucket_bytes and _up(used, align) + a.nbytes > bucket_bytes  # it fits one: do not cut it
        if bucket and (again or whole):
            yield bucket
            bucket, used = [], 0
        start = 0
        while True:
            at = _up(used, align)
            fit = rows - start if row_bytes == 0 else min(rows - start, max(bucket_bytes - at, 0) // row_bytes)
            if fit == 0 and start < rows:  # no room for a row of it here: the next bucket
                yield bucket
                bucket, used = [], 0
                continue
            bucket.append(Piece(name, a, start, start + fit, at, first, sparse))
            used, start = at + fit * row_bytes, start + fit
            if start >= rows:
                break
    if bucket:
        yield bucket


class Segment:
    """A shared-memory segment of a weight push: `create`d by the server (mode 0600, unlinked by
    its `close`), `open`ed by the writer in another process. Mapped on first write."""

    def __init__(self, shm: Any, owner: bool):
        self.shm = shm
        self.name: str = shm.name
        self.size: int = shm.size
        self.owner = owner
        self._mm: mmap.mmap | None = None

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        import posix_ipc

        return cls(posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size), owner=True)

    @classmethod
    def open(cls, name: str) -> Segment:
        import posix_ipc

        try:
            return cls(posix_ipc.SharedMemory(name), owner=False)
        except posix_ipc.ExistentialError:
            raise ValueError(f"weight push segment {name} is gone (the server ended the push)") from None

    def _check_open(self) -> None:
        if self.shm.fd < 0:  # (mmap of fd -1 would be fresh anonymous memory, not the segment)
            raise ValueError(f"weight push segment {self.name} is closed (the push ended)")

    def map(self) -> mmap.mmap:
        self._check_open()
        if self._mm is None:
            self._mm = mmap.mmap(self.shm.fd, self.size)
        return self._mm

    def reserve(self, nbytes: int) -> None:
        """Back the first `nbytes` with memory now: a full /dev/shm is an error here, where a
        write into an unbacked page would be a SIGBUS."""
        self._check_open()
        if nbytes:
            try:
                os.posix_fallocate(self.shm.fd, 0, nbytes)
            except OSError as e:
                raise ValueError(f"no room for a bucket of {nbytes} bytes in /dev/shm ({e.strerror}); "
                                 "lower bucket_bytes") from None  # fmt: skip

    def write(self, pieces: list[Piece]) -> None:
        """Copy the pieces in at their offsets (one copy each, straight from the tensor)."""
        end = max((pc.offset + pc.nbytes for pc in pieces), default=0)
        if end > self.size:
            raise ValueError(f"a bucket of {end} bytes does not fit segment {self.name} of {self.size}")
        self.reserve(end)
        mm = self.map()
        for pc in pieces:
            dst = np.frombuffer(mm, np.uint8, pc.nbytes, pc.offset)
            dst[:] = pc.data()
            del dst  # release the buffer export before the map may close

    def view(self, nbytes: int) -> memoryview:
        """The first `nbytes`, reserved, to read a blob's data into."""
        self.reserve(nbytes)
        return memoryview(self.map())[:nbytes]

    def close(self) -> None:
        """Unmap, close, and (the server's) unlink; safe to call again."""
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view still exported (an interrupted read): the GC unmaps it
                pass
            self._mm = None
        if self.shm.fd >= 0:
            self.shm.close_fd()
        if self.owner:
            self.owner = False
            import posix_ipc

            try:
                posix_ipc.unlink_shared_memory(self.name)
            except posix_ipc.ExistentialError:
                pass


def write_next(it: Iterator[list[Piece]], seg: Segment) -> list[Piece] | None:
    """The next bucket of `it` written into `seg`, or None after the last (a thread's work:
    converting and copying tensors)."""
    bucket = next(it, None)
    if bucket is not None:
        seg.write(bucket)
    return bucket


# ---- the server's checks of a bucket's header ------------------------------------------------
def check_pieces(pieces: list[TensorPiece], size: int, where: str) -> None:
    """Every piece names a float tensor of a sane shape, whole rows of it, inside the segment
    (`size` bytes), no two overlapping: ValueError naming the piece, the field and the limit.
    (The runner then checks each name and shape against the served model.)"""
    spans = []
    for i, pc in enumerate(pieces):
        at = f"{where}: tensors[{i}] ({pc.name!r:.80})"
        if not pc.name or len(pc.name) > MAX_NAME:
            raise ValueError(f"{at} name: a non-empty string of at most {MAX_NAME} characters")
        if pc.dtype not in DTYPES:
            raise ValueError(f"{at} dtype: {pc.dtype!r:.40} is not one of {list(DTYPES)}")
        if len(pc.shape) > MAX_DIMS or any(d < 0 or d > 1 << 40 for d in pc.shape):
            raise ValueError(f"{at} shape: {pc.shape!r:.80} (at most {MAX_DIMS} sizes, each in [0, 2**40])")
        dim0 = pc.shape[0] if pc.shape else 1
        row = DTYPES[pc.dtype] * int(np.prod(pc.shape[1:], dtype=np.int64))
        if pc.nbytes < 0 or pc.start < 0 or (row and pc.nbytes % row) or (not row and pc.nbytes):
            raise ValueError(f"{at} nbytes: {pc.nbytes} is not a whole number of rows of {row} bytes")
        if pc.start + (pc.nbytes // row if row else dim0) > dim0:
            raise ValueError(f"{at} start: rows {pc.start} + {pc.nbytes // max(row, 1)} pass the tensor's {dim0}")
        if pc.offset < 0 or pc.offset + pc.nbytes > size:
            raise ValueError(f"{at} offset: bytes [{pc.offset}, {pc.offset + pc.nbytes}) pass the bucket's {size}")
        spans.append((pc.offset, pc.offset + pc.nbytes, i))
    spans.sort()
    for (_, end, i), (start, _, j) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise ValueError(f"{where}: tensors[{j}] offset: overlaps tensors[{i}]")


# ---- safetensors blobs (HTTP) ----------------------------------------------------------------
def blob_parts(bucket: list[Piece]) -> Iterator[bytes | memoryview]:
    """One bucket as a safetensors blob, in parts (the header, then each piece's bytes as a view
    of the tensor): nothing is copied to build it. Pieces must be laid out with align=1."""
    header: dict[str, Any] = {}
    meta: dict[str, str] = {}
    for pc in bucket:
        a = pc.array
        shape = [pc.stop - pc.start, *a.shape[1:]] if a.ndim else []
        header[pc.name] = {"dtype": _ST_NAME[a.dtype.name], "shape": shape,
                           "data_offsets": [pc.offset, pc.offset + pc.nbytes]}  # fmt: skip
        if pc.sparse:
            meta[pc.name] = f"{pc.first + pc.start}/{pc.shape[0]}/sparse"
        elif (pc.start, pc.stop) != (0, _rows(a)):
            meta[pc.name] = f"{pc.start}/{_rows(a)}"
    if meta:
        header["__metadata__"] = meta
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads its header to 8 bytes
    yield struct.pack("<Q", len(text)) + text
    for pc in bucket:
        yield pc.data().data


def safetensors_stream(named: Mapping[str, Any] | Iterable[tuple[str, Any]],
                       bucket_bytes: int = BUCKET_BYTES) -> Iterator[bytes]:  # fmt: skip
    """The body of `POST /update_weights_from_tensor`: consecutive safetensors blobs, each at
    most `bucket_bytes` of data; bytes parts, lazily (e.g. `httpx.post(url, content=...)`)."""
    for bucket in buckets(named, bucket_bytes, align=1):
        for part in blob_parts(bucket):
            yield bytes(part)


_ROWS = re.compile(r"(\d{1,15})/(\d{1,15})(/sparse)?")


def parse_blob_header(raw: bytes, where: str, limit: int) -> tuple[list[TensorPiece], int]:
    """A safetensors header (the JSON after the length) as pieces, and the blob's data length:
    ValueError naming the tensor and the field (the 400 of HTTP)."""
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{where}: the safetensors header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{where}: the safetensors header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise ValueError(f"{where}: __metadata__ is not an object of strings")
    pieces, spans = [], []
    for name, entry in header.items():
        at = f"{where}: tensor {name!r:.80}"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"{at}: an entry has exactly dtype, shape and data_offsets")
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
        if dtype is None:
            raise ValueError(f"{at} dtype: {entry['dtype']!r:.40} is not one of {list(SAFETENSORS_DTYPES)}")
        shape, offs = entry["shape"], entry["data_offsets"]
        if not (isinstance(shape, list) and len(shape) <= MAX_DIMS
                and all(type(d) is int and 0 <= d <= 1 << 40 for d in shape)):  # fmt: skip
            raise ValueError(f"{at} shape: {shape!r:.80} (at most {MAX_DIMS} sizes, each in [0, 2**40])")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs) and 0 <= offs[0] <= offs[1]):
            raise ValueError(f"{at} data_offsets: {offs!r:.80} is not [begin, end]")
        nbytes = DTYPES[dtype] * int(np.prod(shape, dtype=np.int64))
        if offs[1] - offs[0] != nbytes:
            raise ValueError(f"{at} data_offsets: {offs[1] - offs[0]} bytes for shape {shape} of {dtype} ({nbytes})")
        whole, start, sparse = list(shape), 0, False
        rows = meta.get(name)
        if rows is not None:
            m = _ROWS.fullmatch(rows) if isinstance(rows, str) else None
            if m is None or not shape:
                raise ValueError(f"{at} __metadata__: {rows!r:.40} is not '<first row>/<rows>' or "
                                 "'<first row>/<stop>/sparse' of a tensor with rows")  # fmt: skip
            start, whole[0], sparse = int(m[1]), int(m[2]), m[3] is not None
        pieces.append(TensorPiece(name, dtype, whole, offs[0], nbytes, start, sparse))
        spans.append((offs[0], offs[1], name))
    spans.sort()
    end = 0
    for begin, stop, name in spans:
        if begin != end:
            raise ValueError(f"{where}: tensor {name!r:.80} data_offsets: starts at {begin}, not {end} "
                             "(the data must be covered back to back)")  # fmt: skip
        end = stop
    if end > limit:
        raise ValueError(f"{where}: {end} bytes of data pass the server's bucket limit of {limit} bytes")
    check_pieces(pieces, end, where)
    return pieces, end

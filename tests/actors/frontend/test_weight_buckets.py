"""Buckets of a weight push without an engine: every byte of every tensor lands in exactly one
piece, no bucket passes `bucket_bytes`, a tensor larger than a bucket is cut into row runs that
reassemble exactly; safetensors blobs are the standard format; bad headers are refused naming
the tensor and the field; a segment is 0600 and gone once closed; a push session (with a fake
scheduler) sends an abandon for whatever it staged unless it committed."""

from __future__ import annotations

import os
import stat

import ml_dtypes
import numpy as np
import pytest

from ringserve.actors.frontend.protocol import TensorPiece
from ringserve.actors.frontend.weight_buckets import (
    ALIGN,
    Segment,
    blob_parts,
    buckets,
    check_pieces,
    parse_blob_header,
    safetensors_stream,
)


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "embed": rng.standard_normal((300, 16), dtype=np.float32),  # 19200 bytes: cut in pieces
        "norm": np.arange(16, dtype=np.float16),
        "proj": rng.standard_normal((40, 24)).astype(ml_dtypes.bfloat16),
        "scalar": np.array(3.5, np.float32),
        "empty": np.zeros((0, 8), np.float32),
        "last": rng.standard_normal((7, 7), dtype=np.float32),
    }


def _reassemble(bs: list, align: int) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for bucket in bs:
        for pc in bucket:
            a = out.setdefault(pc.name, np.zeros_like(pc.array))
            flat = a.reshape(a.shape[0] if a.ndim else 1, int(np.prod(a.shape[1:])))
            flat[pc.start : pc.stop] = pc.data().view(a.dtype).reshape(pc.stop - pc.start, flat.shape[1])
            assert pc.offset % align == 0
    return out


@pytest.mark.parametrize("bucket_bytes", [1024, 4096, 1 << 20])
def test_buckets_are_bounded_aligned_and_cover_every_row_once(bucket_bytes):
    t = _tensors()
    bs = list(buckets(t, bucket_bytes))
    for bucket in bs:
        assert max(pc.offset + pc.nbytes for pc in bucket) <= bucket_bytes
        ends = sorted((pc.offset, pc.offset + pc.nbytes) for pc in bucket)
        assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:], strict=False))  # no overlap
    got = _reassemble(bs, ALIGN)
    assert list(got) == list(t)
    for k in t:
        np.testing.assert_array_equal(got[k], t[k])
    pieces = [pc for b in bs for pc in b]
    if bucket_bytes == 1024:  # 1024 // 64 = 16 rows of embed per bucket
        assert [(pc.start, pc.stop) for pc in pieces if pc.name == "embed"] == [(i, min(i + 16, 300)) for i in range(0, 300, 16)]
    if bucket_bytes == 1 << 20:
        assert len(bs) == 1 and all((pc.start, pc.stop) == (0, max(np.shape(t[pc.name])[:1] or (1,))) for pc in pieces)


def test_a_tensor_that_fits_a_bucket_whole_is_not_cut():
    a = np.ones((10, 16), np.float32)  # 640 bytes
    bs = list(buckets([("x", np.ones(100, np.float32)), ("y", a)], 1000))  # 400 + 640 > 1000: y goes whole to bucket 2
    assert [[(pc.name, pc.start, pc.stop, pc.offset) for pc in b] for b in bs] == [[("x", 0, 100, 0)], [("y", 0, 10, 0)]]


def test_bad_tensors_are_refused_naming_them():
    with pytest.raises(ValueError, match="'w' has dtype int32"):
        list(buckets({"w": np.zeros(4, np.int32)}, 1024))
    with pytest.raises(ValueError, match="'w': one row of 4096 bytes does not fit bucket_bytes=1024"):
        list(buckets({"w": np.zeros((2, 1024), np.float32)}, 1024))
    with pytest.raises(ValueError, match="'w' appears twice"):
        list(buckets([("w", np.zeros(4, np.float32)), ("w", np.zeros(4, np.float32))], 1024))
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        list(buckets({}, 0))
    with pytest.raises(ValueError, match=r"named_tensors\[0\]"):
        list(buckets([np.zeros(3)], 1024))


def test_torch_tensors_bfloat16_included_keep_their_bits():
    import torch

    t = torch.randn(5, 3).to(torch.bfloat16)
    [[pc]] = list(buckets({"t": t}, 1024))
    assert pc.array.dtype == ml_dtypes.bfloat16
    assert pc.array.view(np.int16).tolist() == t.view(torch.int16).tolist()


def _np(t) -> np.ndarray:
    import torch

    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()


def test_safetensors_blobs_are_the_standard_format_and_parse_back(tmp_path):
    from safetensors.torch import load  # (safetensors.numpy has no bfloat16)

    t = _tensors()
    body = b"".join(safetensors_stream(t, 2048))
    i, loaded, pieces = 0, [], []
    while i < len(body):
        n = int.from_bytes(body[i : i + 8], "little")
        ps, size = parse_blob_header(body[i + 8 : i + 8 + n], f"bucket {len(loaded)}", 2048)
        blob = body[i : i + 8 + n + size]
        loaded.append({k: _np(v) for k, v in load(blob).items()})  # the safetensors library reads every blob
        pieces += ps
        i += 8 + n + size
    assert len(loaded) > 5
    # the cut tensor: pieces of its rows, named by __metadata__, in order, reassembling exactly
    embed = [pc for pc in pieces if pc.name == "embed"]
    assert [pc.start for pc in embed] == list(range(0, 300, 32)) and all(pc.shape == [300, 16] for pc in embed)
    np.testing.assert_array_equal(np.concatenate([d["embed"] for d in loaded if "embed" in d]), t["embed"])
    whole = {k: v for d in loaded for k, v in d.items() if k != "embed"}
    for k in ("norm", "proj", "scalar", "empty", "last"):
        np.testing.assert_array_equal(whole[k], t[k])


def _header(entries: dict, meta: dict | None = None) -> bytes:
    import json

    return json.dumps({**entries, **({"__metadata__": meta} if meta else {})}).encode()


@pytest.mark.parametrize(
    ("entries", "meta", "words"),
    [
        ({"w": {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]}}, None, ["tensor 'w' dtype", "F32"]),
        ({"w": {"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 8]}}, None, ["tensor 'w' shape"]),
        ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, None, ["tensor 'w' data_offsets", "(12)"]),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, None, ["'w' data_offsets: starts at 4, not 0"]),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": 1}}, None, ["tensor 'w'", "exactly"]),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, {"w": "abc"}, ["'w' __metadata__"]),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, {"w": "5/6"}, ["'w'", "start: rows 5 + 2 pass"]),
        ({"w": {"dtype": "F32", "shape": [300], "data_offsets": [0, 1200]}}, None, ["1200 bytes of data pass", "1024"]),
    ],
)
def test_bad_blob_headers_name_the_tensor_and_field(entries, meta, words):
    with pytest.raises(ValueError) as e:
        parse_blob_header(_header(entries, meta), "bucket 3", 1024)
    assert str(e.value).startswith("bucket 3"), e.value
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    with pytest.raises(ValueError, match="bucket 0: the safetensors header is not JSON"):
        parse_blob_header(b"{nope", "bucket 0", 1024)


def test_check_pieces_names_the_field_and_limit():
    ok = TensorPiece("w", "float32", [4, 2], 0, 16, 0)
    check_pieces([ok], 64, "bucket 0")
    cases = [
        (TensorPiece("w", "int8", [4], 0, 4), "dtype: 'int8' is not one of"),
        (TensorPiece("w", "float32", [4, 2], 0, 12), "nbytes: 12 is not a whole number of rows of 8 bytes"),
        (TensorPiece("w", "float32", [4, 2], 0, 16, 3), "start: rows 3 + 2 pass the tensor's 4"),
        (TensorPiece("w", "float32", [4, 2], 56, 16), "offset: bytes [56, 72) pass the bucket's 64"),
        (TensorPiece("", "float32", [4], 0, 16), "name: a non-empty string"),
        (TensorPiece("w", "float32", [1] * 9, 0, 4), "shape: [1, 1, 1, 1, 1, 1, 1, 1, 1] (at most 8 sizes"),
    ]
    for piece, words in cases:
        with pytest.raises(ValueError) as e:
            check_pieces([piece], 64, "bucket 0")
        assert str(e.value).startswith(f"bucket 0: tensors[0] ({piece.name!r}) {words}"), str(e.value)
    with pytest.raises(ValueError, match=r"tensors\[1\] offset: overlaps tensors\[0\]"):
        check_pieces([ok, TensorPiece("v", "float32", [2], 8, 8)], 64, "bucket 0")


def test_a_segment_is_0600_written_by_another_mapping_and_unlinked_on_close():
    name = f"/rs-{os.getpid()}-abcdef01-push9"
    seg = Segment.create(name, 4096)
    path = "/dev/shm" + name
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert os.stat(path).st_blocks == 0  # no memory until written
        w = Segment.open(name)
        [bucket] = list(buckets({"a": np.arange(10, dtype=np.float32)}, 4096))
        w.write(bucket)
        w.close()
        assert os.path.exists(path)  # the writer never unlinks
        assert np.frombuffer(seg.map(), np.float32, 10).tolist() == list(range(10))
    finally:
        seg.close()
    assert not os.path.exists(path)
    seg.close()  # again: nothing
    with pytest.raises(ValueError, match="is gone"):
        Segment.open(name)


def test_blob_parts_copy_nothing():
    a = np.arange(8, dtype=np.float32)
    [bucket] = list(buckets({"a": a}, 1024, align=1))
    head, data = list(blob_parts(bucket))
    assert isinstance(data, memoryview) and np.shares_memory(np.frombuffer(data, np.float32), a)


# ---- the server's push session, with a fake scheduler ----------------------------------------
def _session(script):
    """Run `script(push, sent)` on a loop with a Push whose control records every part."""
    import asyncio

    from ringserve.actors.frontend.weight_push import Push

    sent: list = []

    async def control(req):
        sent.append(req)
        await asyncio.sleep(0.01)
        ok = not (req.tensors and req.tensors[0].name == "refused")
        return {"success": ok, "message": "ok" if ok else "refused: busy", "weight_version": "v"}

    async def main():
        push = Push(control, 4096, 2)
        names = [s.name for s in push.segments]
        try:
            await script(push, sent)
        finally:
            push.close()
        await asyncio.sleep(0.05)  # the abandon, if any, is sent from close()
        return names

    names = asyncio.run(main())
    assert not [n for n in names if os.path.exists("/dev/shm" + n)]
    return sent


def test_a_push_session_abandons_what_it_staged_unless_committed():
    import asyncio

    piece = TensorPiece("w", "float32", [4], 0, 16)

    async def committed(push, sent):
        assert await push.bucket(0, [piece]) is None and await push.bucket(1, [piece]) is None
        assert (await push.commit("v2"))["success"]

    sent = _session(committed)
    assert [(r.source, r.part, r.parts, r.weight_version) for r in sent] == [
        ("tensor", 0, 0, None), ("tensor", 1, 0, None), ("tensor", 2, 3, "v2")]  # fmt: skip
    assert len({r.update for r in sent}) == 1 and sent[0].tensors[0].segment.endswith("-push0")

    async def died(push, sent):
        assert await push.bucket(0, [piece]) is None
        task = asyncio.ensure_future(push.bucket(1, [piece]))
        await asyncio.sleep(0)
        task.cancel()  # the pusher went away with a part in flight

    sent = _session(died)
    assert [r.source for r in sent] == ["tensor", "tensor", "abandon"] and len({r.update for r in sent}) == 1

    async def refused(push, sent):
        assert await push.bucket(0, [piece]) is None
        out = await push.bucket(1, [TensorPiece("refused", "float32", [4], 0, 16)])
        assert out is not None and out["message"] == "refused: busy"

    assert [r.source for r in _session(refused)] == ["tensor", "tensor", "abandon"]

    async def bad_header(push, sent):
        with pytest.raises(ValueError, match="bucket 0: tensors\\[0\\] \\('w'\\) offset"):
            await push.bucket(0, [TensorPiece("w", "float32", [4], 4090, 16)])
        with pytest.raises(ValueError, match="slot=2 is not one of the push's 2 segments"):
            await push.bucket(2, [piece])

    assert _session(bad_header) == []  # nothing reached the scheduler, nothing to abandon

    async def empty(push, sent):
        assert await push.commit(None) == {"success": True, "message": "no tensors", "bytes": 0}

    assert _session(empty) == []

"""A weight update from tensors across the relay (actors/relay/blobs.py): the bytes a part's
references cover travel before it and land in segments of the receiving host, whose references
then point there (host 0's segment may be gone by the time runner k reads); a step passes
unchanged; a segment gone on host 0 is one that runner k finds gone; the receiver's segments
are unlinked at the next weights message or when the relay ends."""

from __future__ import annotations

import os
import secrets
import socket
import threading

import numpy as np
import posix_ipc
import pytest

from ringserve.actors.relay.blobs import Received, send_blobs, tensor_refs
from ringserve.actors.relay.core import recv_frame, send_frame
from ringserve.actors.transport import messages as m
from ringserve.model.weights.segments import WeightError, read_segments


@pytest.fixture
def host0_segment():
    """A push's segment on host 0: 4 KiB, bytes 0..255 repeated."""
    name = f"/rs-{os.getpid()}-{secrets.token_hex(4)}-push0"
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=4096)
    os.write(shm.fd, bytes(range(256)) * 16)
    shm.close_fd()
    yield name
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass


def part(segment: str, update: str = "u", n: int = 0) -> bytes:
    refs = [m.TensorRef("a", "float32", [4, 4], segment, 1000, 64),  # pieces anywhere in the segment
            m.TensorRef("b", "float16", [8], segment, 2048, 16)]  # fmt: skip
    return m.encode(m.RunnerWeights(m.UpdateWeightsReq("tensor", part=n, tensors=refs, update=update)))


def commit(update: str = "u", n: int = 1) -> bytes:
    return m.encode(m.RunnerWeights(m.UpdateWeightsReq("tensor", part=n, parts=n + 1, update=update)))


def relay(messages: list[bytes], before_receive=lambda: None) -> tuple[list[bytes], Received, dict, int]:
    """Host 0's side sends each message with its bytes; host k's receives them all (after
    `before_receive`); returns what host k would put in its ring, its Received, what it owns."""
    a, b = socket.socketpair()
    owned: dict = {}
    rec = Received(lambda name, add: owned.__setitem__(name, None) if add else owned.pop(name, None))
    sent = []

    def out() -> None:
        for raw in messages:
            sent.append(send_blobs(a, raw))
            send_frame(a, raw)

    t = threading.Thread(target=out)
    t.start()
    t.join(10)  # (socketpair buffers hold these few KiB)
    before_receive()
    got = [rec.message(recv_frame(b, rec.receive)) for _ in messages]
    a.close()
    b.close()
    return got, rec, owned, sum(sent)


def read_all(raw: bytes) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    read_segments(tensor_refs(raw), lambda r, mm: out.__setitem__(r.name, bytes(mm[r.offset : r.offset + r.nbytes])))
    return out


def test_a_parts_bytes_land_in_the_receivers_own_segments(host0_segment):
    want = read_all(part(host0_segment))
    unlink = lambda: posix_ipc.unlink_shared_memory(host0_segment)  # noqa: E731 -- host 0's is gone
    [got], rec, owned, sent = relay([part(host0_segment)], before_receive=unlink)
    assert sent == 2048 + 16 - 1000  # the span the pieces cover, not the whole segment
    refs = tensor_refs(got)
    assert {r.segment for r in refs} == set(rec.held) == set(owned) and host0_segment not in owned
    assert [r.offset for r in refs] == [0, 1048]
    assert read_all(got) == want  # the same bytes, from this host's segment
    for name in rec.held:
        assert os.stat(f"/dev/shm/{name.lstrip('/')}").st_mode & 0o777 == 0o600
    # the next weights message (the commit): the part's segments are unlinked, nothing is owned
    held = list(rec.held)
    assert rec.message(commit()) == commit()
    assert owned == {} and not any(os.path.exists(f"/dev/shm/{n.lstrip('/')}") for n in held)


def test_steps_pass_unchanged_and_a_gone_segment_stays_gone(host0_segment):
    step = m.encode(m.StepMsg(step_id=7, slots=m.i32([0]), committed=m.i32([3]), token_counts=m.i32([1]),
                              tokens=m.i32([5]), page_counts=m.i32([0]), pages=b"", keep=m.u8([1])))  # fmt: skip
    gone = f"/rs-{os.getpid()}-{secrets.token_hex(4)}-push9"
    got, rec, owned, sent = relay([step, part(gone), part(host0_segment, n=1), step])
    assert got[0] == step == got[3] and sent == 2048 + 16 - 1000
    with pytest.raises(WeightError, match="is gone"):  # runner k refuses it, as runner 0 does
        read_all(got[1])
    assert np.array_equal(np.frombuffer(read_all(got[2])["a"], np.uint8), np.arange(1000, 1064) % 256)
    # the relay ends: every segment it made is unlinked
    held = list(rec.held)
    rec.drop()
    assert owned == {} and not any(os.path.exists(f"/dev/shm/{n.lstrip('/')}") for n in held)

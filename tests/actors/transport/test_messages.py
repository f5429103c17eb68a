"""Wire structs: each ring's typed decoder round-trips its union's structs, and refuses pickles
and other rings' messages with msgspec.DecodeError."""

from __future__ import annotations

import pickle

import msgspec
import pytest

from ringserve.actors.server_args import ServerArgs
from ringserve.actors.transport import messages as m
from ringserve.actors.transport.sampling import SamplingParams
from ringserve.model.compute.step_inputs import DeviceSampling

_SAMPLING = SamplingParams(max_new_tokens=16, temperature=0.5, top_k=4, stop=("\n",), stop_token_ids=(2,), sampling_seed=7)
_OUT = m.TokenOut(rid="r1", new_ids=m.i32([5, 6]), prompt_tokens=3, completion_tokens=2, logprobs=m.f32([-0.5, -1.0]),
                  finish_reason={"type": "length", "length": 2}, finished=True, open=SamplingParams(stop=("x",)))  # fmt: skip

SAMPLES: dict[str, tuple[msgspec.msgpack.Decoder, list[msgspec.Struct]]] = {
    "to_scheduler": (m.to_scheduler, [
        m.GenerateReq(rid="a", input_ids=m.i32([1, 2, 3]), sampling=_SAMPLING, return_logprob=True, top_logprobs_num=2),
        m.AbortReq(), m.AbortReq(rid="a"), m.PauseReq(mode="retract"), m.ContinueReq(), m.FlushCacheReq(), m.InfoReq(),
    ]),
    "to_runner": (m.to_runner, [
        m.StepMsg(step_id=3, released=m.i32([4]),
                  starts=[m.SlotStart(slot=2, prefix_pages=m.i32([1]), sampling=DeviceSampling(0.0, -1, 1.0, 0.0, 1))],
                  slots=m.i32([2, 5, 0, 1]), committed=m.i32([0, 16, 9, 12]), token_counts=m.i32([2, 1, 1, 1]),
                  tokens=m.i32([1, 2, 8, -1, -2]), page_counts=m.i32([1, 0, 0, 1]), pages=m.i32([3, 7]),
                  keep=m.u8([1, 0, 1, 1])),
        m.StepMsg(step_id=5, slots=m.i32([0]), committed=m.i32([9]), token_counts=m.i32([3]), tokens=m.i32([-1, 4, -1]),
                  page_counts=m.i32([0]), keep=m.u8([1]), drafts=2),
        m.StepMsg(step_id=4), m.RunnerShutdown(),
    ]),
    "from_runner": (m.from_runner, [
        m.StepResultMsg(step_id=3, tokens=m.i32([10, 11]), logprobs=m.f32([-0.1, -0.2]), top_ids=m.i32([10, 4, 11, 5]),
                        top_logprobs=m.f32([-0.1, -3, -0.2, -4]), top_n=2, forward_s=0.01),
    ]),
    "to_detokenizer": (m.to_detokenizer, [
        m.BatchTokenOut(outs=[_OUT, m.TokenOut(rid="r2", new_ids=b"", prompt_tokens=1, completion_tokens=0)]),
        m.ControlReply(kind="flush", ok=False, message="requests are waiting"),
    ]),
    "to_frontend": (m.to_frontend, [
        m.BatchStrOut(outs=[m.TokenOut(rid="r1", new_ids=m.i32([5]), prompt_tokens=3, completion_tokens=1)], texts=["hé"]),
        m.ControlReply(kind="info", payload=b'{"a": 1}'),
    ]),
    "actor_config": (m.actor_config, [
        m.ActorConfig(args=ServerArgs(), model_dir="/m", tokenizer_dir="/t", eos_ids=[2], vocab_size=256),
    ]),
}  # fmt: skip


@pytest.mark.parametrize("ring", sorted(SAMPLES))
def test_decoder_round_trips_its_structs(ring):
    decoder, samples = SAMPLES[ring]
    for msg in samples:
        wire = m.encode(msg)
        assert decoder.decode(wire) == msg
        assert isinstance(msgspec.msgpack.decode(wire), list)  # array_like: no field names on the wire


@pytest.mark.parametrize("ring", sorted(SAMPLES))
def test_decoder_rejects_pickles(ring):
    decoder, samples = SAMPLES[ring]
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        for obj in ({"rid": "a", "input_ids": [1, 2]}, samples[0]):
            with pytest.raises(msgspec.DecodeError):
                decoder.decode(pickle.dumps(obj, protocol=proto))


@pytest.mark.parametrize("ring", sorted(SAMPLES))
def test_decoder_rejects_other_rings_messages(ring):
    decoder, _ = SAMPLES[ring]
    for other, (_, samples) in SAMPLES.items():
        for msg in samples:
            if other == ring or type(msg) in {type(s) for s in SAMPLES[ring][1]}:
                continue
            with pytest.raises(msgspec.DecodeError):
                decoder.decode(m.encode(msg))


def test_token_arrays_read_back_without_copy():
    ids = m.i32([1, -2, 3])
    arr = m.as_i32(ids)
    assert arr.tolist() == [1, -2, 3] and not arr.flags.owndata

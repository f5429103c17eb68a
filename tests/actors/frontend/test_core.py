"""The frontend's request table without processes: outputs of several requests arrive
interleaved and in any order, and each request's result is exactly its own outputs, in order."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ringserve.actors.frontend.core import FrontendCore, generate_req
from ringserve.actors.frontend.inputs import RequestSpec
from ringserve.actors.frontend.sessions import Sessions
from ringserve.actors.transport import messages as m
from ringserve.actors.transport.sampling import SamplingParams


class Tok:
    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{t}>" for t in ids)


def spec(rid: str, *, n: int = 1, logprobs: bool = False, top: int = 0, stream: bool = False) -> RequestSpec:
    return RequestSpec(rid=rid, input_ids=[1, 2, 3], sampling=SamplingParams(n=n, sampling_seed=0),
                       return_logprob=logprobs, top_logprobs_num=top, index=0, stream=stream)  # fmt: skip


def out(rid: str, ids: list[int], done: int, **kw) -> m.TokenOut:
    return m.TokenOut(rid=rid, new_ids=m.i32(ids), prompt_tokens=3, completion_tokens=done, **kw)


def sample(core: FrontendCore, name: str) -> float | None:
    return core.metrics.registry.get_sample_value(name)


def test_interleaved_outputs_give_each_request_its_own_cumulative_result():
    core = FrontendCore(Tok(), num_draft_tokens=4)
    a = core.add(spec("A", logprobs=True, top=2, stream=True), now=10.0)
    b = core.add(spec("B"), now=10.5)
    with pytest.raises(ValueError, match="rid 'A' is already in use by a live request"):
        core.add(spec("A"), now=10.6)

    # one message, B's output before A's; A's carries logprobs and top-2 rows
    core.apply(m.BatchStrOut(outs=[
        out("B", [7], 1, first_token_at=11.0, weight_version="v1"),
        out("A", [3, 4], 2, logprobs=m.f32([-0.5, -1.0]), top_ids=m.i32([3, 9, 4, 8]),
            top_logprobs=m.f32([-0.5, -2.0, -1.0, -3.0]), top_n=2, cached_tokens=1),
    ], texts=["b1", "a1a2"]), now=12.0)  # fmt: skip
    assert a.changed.is_set() and b.changed.is_set()
    a.changed.clear()
    b.changed.clear()
    assert core.result(b) == {"text": "b1", "output_ids": [7], "meta_info": {
        "id": "B", "finish_reason": None, "prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 0,
        "weight_version": "v1"}}  # fmt: skip

    # A finishes (an output for a request no longer live is ignored); B goes on
    core.apply(m.BatchStrOut(outs=[
        out("gone", [1], 1),
        out("A", [5], 3, logprobs=m.f32([-0.25]), top_ids=m.i32([5, 6]), top_logprobs=m.f32([-0.25, -4.0]), top_n=2,
            cached_tokens=1, finished=True, finish_reason={"type": "length", "length": 3},
            weight_version="v2", weight_versions=[("v1", 0), ("v2", 2)], spec_verify_ct=2, spec_accepted=1),
        out("B", [8], 2),
    ], texts=["x", "a3", "b2"]), now=13.0)  # fmt: skip
    assert a.finished and a.changed.is_set() and list(core.states) == ["B"]
    assert core.result(a) == {"text": "a1a2a3", "output_ids": [3, 4, 5], "meta_info": {
        "id": "A", "finish_reason": {"type": "length", "length": 3}, "prompt_tokens": 3, "completion_tokens": 3,
        "cached_tokens": 1, "e2e_latency": 3.0, "weight_version": "v2",
        "weight_versions": [{"version": "v1", "start": 0, "end": 2}, {"version": "v2", "start": 2, "end": 3}],
        "spec_verify_ct": 2, "spec_accept_token_num": 1, "spec_draft_token_num": 8, "spec_accept_length": 1.5,
        "output_token_logprobs": [(-0.5, 3, "<3>"), (-1.0, 4, "<4>"), (-0.25, 5, "<5>")],
        "output_top_logprobs": [[(-0.5, 3, "<3>"), (-2.0, 9, "<9>")], [(-1.0, 4, "<4>"), (-3.0, 8, "<8>")],
                                [(-0.25, 5, "<5>"), (-4.0, 6, "<6>")]]}}  # fmt: skip

    core.apply(m.BatchStrOut(outs=[out("B", [], 2, finished=True, finish_reason={"type": "abort"})],
                             texts=[""]), now=14.0)  # fmt: skip
    res = core.result(b)
    assert (res["text"], res["output_ids"], res["meta_info"]["finish_reason"]) == ("b1b2", [7, 8], {"type": "abort"})
    assert res["meta_info"]["e2e_latency"] == 3.5 and "output_token_logprobs" not in res["meta_info"]
    assert core.states == {}

    # metrics: first tokens at 11.0 (the scheduler's stamp) - 10.5 and 12.0 - 10.0; A streamed
    # one token 1 s after its first two; 5 tokens out, 1 cached, one abort, two latencies
    assert sample(core, "ringserve:time_to_first_token_seconds_sum") == 2.5
    assert sample(core, "ringserve:inter_token_latency_seconds_count") == 1.0
    assert sample(core, "ringserve:inter_token_latency_seconds_sum") == 1.0
    assert sample(core, "ringserve:generation_tokens_total") == 5.0
    assert sample(core, "ringserve:cached_tokens_total") == 1.0
    assert sample(core, "ringserve:num_aborted_requests_total") == 1.0
    assert sample(core, "ringserve:e2e_request_latency_seconds_sum") == 6.5


def test_samples_failures_and_session_turns():
    core = FrontendCore(Tok())
    core.add(spec("x-0", n=2), now=0.0)
    core.add(spec("x-1", n=2), now=0.0)
    core.add(spec("x-2"), now=0.0)  # n == 1: its own request, not a sample of x
    assert core.with_samples("x") == ["x", "x-0", "x-1"]
    live = list(core.states.values())
    err = RuntimeError("runner died")
    core.fail_all(err)
    assert core.states == {} and all(st.error is err and st.changed.is_set() for st in live)

    sessions: Sessions = core.sessions
    sid = sessions.open_session()
    s = spec("t1")
    s.session = sessions.plan({"id": sid}, s.input_ids, None)
    assert generate_req(s).session_id == sid and m.as_i32(generate_req(s).input_ids).tolist() == [1, 2, 3]
    core.add(s, now=0.0)
    assert not sessions.open[sid].turns["t1"].finished
    core.apply(m.BatchStrOut(outs=[out("t1", [4, 5], 2, finished=True, finish_reason={"type": "stop"})],
                             texts=["xy"]), now=1.0)  # fmt: skip
    assert sessions.open[sid].turns["t1"].output_ids == [4, 5]
    core.drop("t1")  # a rid no longer live: nothing happens
    assert core.states == {}


def test_the_frontend_imports_no_jax(tiny_dir):
    """The frontend process (Engine, servers, clients, and what Engine loads to start) never
    pays for JAX: only the runner does; nor for ml_dtypes (0.45 s of CPU) when it checks its
    arguments and sizes the KV pool from the checkpoint's headers."""
    import subprocess
    import sys

    mods = ["actors.frontend." + name for name in ("actor", "core", "engine", "client", "http_server", "ipc_server",
                                                   "server", "inputs", "protocol")]  # fmt: skip
    mods += ["ringserve.actors.transport.launcher", "ringserve.model.config", "ringserve.model.checkpoints.resolve",
             "ringserve.model.checkpoints.tokenizer"]  # fmt: skip
    code = (f"import sys\nfor m in {mods!r}: __import__(m)\n"
            "from ringserve.actors.server_args import ServerArgs\nfrom ringserve.model.checkpoints.footprint import read_footprint\n"
            f"ServerArgs(model_path={str(tiny_dir())!r}, enable_lora=True)\nread_footprint({str(tiny_dir())!r})\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'ml_dtypes')))")  # fmt: skip
    root = Path(__file__).resolve().parents[3]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"


# ---- streams: the latest state when the caller asks (issue 28, failure 7) ------------------------
def _stream_core(n: int) -> tuple[FrontendCore, list]:
    core = FrontendCore(Tok())
    return core, [core.add(spec(f"S{i}", stream=True), now=0.0) for i in range(n)]


def _built(core: FrontendCore) -> list[int]:
    """Counts the chunks `core` builds (each a `result`)."""
    calls: list[int] = []
    result = core.result
    core.result = lambda st: calls.append(1) or result(st)  # type: ignore[method-assign]
    return calls


def test_a_stream_that_keeps_up_gets_a_chunk_per_output():
    async def main() -> list[list[int]]:
        core, (st,) = _stream_core(1)
        stream = core.chunks([st], batched=False)
        got = []
        for k in range(1, 11):
            core.apply(m.BatchStrOut(outs=[out("S0", [k], k, finished=k == 10, finish_reason={"type": "length"})],
                                     texts=[str(k)]), now=float(k))  # fmt: skip
            got.append((await anext(stream))["output_ids"])
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        return got

    assert asyncio.run(main()) == [list(range(1, k + 1)) for k in range(1, 11)]


def test_a_stream_that_lags_costs_one_chunk_of_the_newest_state():
    async def main() -> None:
        core, (a, b) = _stream_core(2)
        built = _built(core)
        stream = core.chunks([a, b], batched=True)
        for k in range(1, 501):  # 500 outputs each, nobody reading
            core.apply(m.BatchStrOut(outs=[out("S0", [k], k), out("S1", [k], k)], texts=["a", "b"]), now=float(k))
        assert built == []  # nothing was built for a caller who did not ask
        first, second = await anext(stream), await anext(stream)
        assert [first["index"], second["index"]] == [0, 1]
        assert first["output_ids"] == second["output_ids"] == list(range(1, 501))
        assert first["text"] == "a" * 500 and len(built) == 2
        core.apply(m.BatchStrOut(outs=[out("S1", [0], 501, finished=True, finish_reason={"type": "abort"}),
                                       out("S0", [0], 501, finished=True, finish_reason={"type": "length"})],
                                 texts=["", ""]), now=600.0)  # fmt: skip
        last = [await anext(stream), await anext(stream)]
        assert [c["index"] for c in last] == [1, 0]  # in the order they changed
        assert [c["meta_info"]["finish_reason"]["type"] for c in last] == ["abort", "length"]
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        assert len(built) == 4 and a.listener is None and b.listener is None

    asyncio.run(main())


def test_a_stream_begun_after_its_outputs_and_one_whose_engine_dies():
    from ringserve.actors.frontend.errors import EngineDead

    async def main() -> None:
        core, (st,) = _stream_core(1)
        core.apply(m.BatchStrOut(outs=[out("S0", [4, 5], 2)], texts=["45"]), now=1.0)
        stream = core.chunks([st], batched=False)
        assert (await anext(stream))["output_ids"] == [4, 5]
        core.fail_all(RuntimeError("runner died"))
        with pytest.raises(EngineDead, match="request S0 lost: the engine is down: runner died"):
            await anext(stream)

    asyncio.run(main())


def test_prompt_logprobs_arrive_once_in_sglangs_shape():
    """logprob_start_len=1 of the prompt [1, 2, 3, 4]: entries for tokens 2, 3, 4, the first with
    no logprob; top-1 and token_ids_logprob per position, None first; the output's
    token_ids_logprob per output token. Before the prompt's logprobs came: the None entry only."""
    core = FrontendCore(Tok(), num_draft_tokens=4)
    sp = RequestSpec(rid="A", input_ids=[1, 2, 3, 4], sampling=SamplingParams(sampling_seed=0), return_logprob=True,
                     top_logprobs_num=1, index=0, stream=True, logprob_start_len=1, token_ids_logprob=[9, 8])  # fmt: skip
    st = core.add(sp, now=0.0)
    assert generate_req(sp).logprob_start_len == 1 and m.as_i32(generate_req(sp).token_ids_logprob).tolist() == [9, 8]
    meta = core.result(st)["meta_info"]
    assert (meta["input_token_logprobs"], meta["input_top_logprobs"], meta["input_token_ids_logprobs"]) == (
        [(None, 2, "<2>")], [None], [None])
    more = m.MoreLogprobs(ids_n=2, ids_logprobs=m.f32([-9.0, -8.0]), input_logprobs=m.f32([-3.0, -4.0]),
                          input_top_ids=m.i32([3, 5]), input_top_logprobs=m.f32([-3.0, -0.5]),
                          input_ids_logprobs=m.f32([-9.5, -8.5, -9.25, -8.25]))  # fmt: skip
    core.apply(m.BatchStrOut(outs=[out("A", [6], 1, logprobs=m.f32([-0.75]), top_ids=m.i32([6]),
                                       top_logprobs=m.f32([-0.75]), top_n=1, more=more)], texts=["a"]), now=1.0)  # fmt: skip
    core.apply(m.BatchStrOut(outs=[out("A", [7], 2, logprobs=m.f32([-0.5]), top_ids=m.i32([7]), top_logprobs=m.f32([-0.5]),
                                       top_n=1, more=m.MoreLogprobs(ids_n=2, ids_logprobs=m.f32([-7.0, -6.0])),
                                       finished=True, finish_reason={"type": "length", "length": 2})],
                             texts=["b"]), now=2.0)  # fmt: skip
    meta = core.result(st)["meta_info"]
    assert meta["input_token_logprobs"] == [(None, 2, "<2>"), (-3.0, 3, "<3>"), (-4.0, 4, "<4>")]
    assert meta["input_top_logprobs"] == [None, [(-3.0, 3, "<3>")], [(-0.5, 5, "<5>")]]
    assert meta["input_token_ids_logprobs"] == [None, [(-9.5, 9, "<9>"), (-8.5, 8, "<8>")],
                                                [(-9.25, 9, "<9>"), (-8.25, 8, "<8>")]]  # fmt: skip
    assert meta["output_token_logprobs"] == [(-0.75, 6, "<6>"), (-0.5, 7, "<7>")]
    assert meta["output_token_ids_logprobs"] == [[(-9.0, 9, "<9>"), (-8.0, 8, "<8>")], [(-7.0, 9, "<9>"), (-6.0, 8, "<8>")]]
    again = core.result(st)["meta_info"]
    assert again == meta and again["input_token_logprobs"] is not meta["input_token_logprobs"]  # a fresh dict each call

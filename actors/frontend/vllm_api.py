"""vLLM's routes that RL frameworks drive a server with (SkyRL's remote client, OpenRLHF), as
aliases of ringserve's verbs, and vLLM's token-in token-out generate:

    POST /pause?mode=abort|keep|wait     abort: every request ends with finish_reason abort (then
                                         the prefix cache is flushed unless clear_cache=false);
                                         keep: SGLang's in_place (requests and their KV stay, and go
                                         on after /resume); wait: new requests wait while those in
                                         flight finish, then the engine pauses
    POST /resume                         continue_generation
    GET  /is_paused                      {"is_paused": bool}
    POST /sleep?level=1|2&mode=...       pause (mode as /pause's; keep: the requests are retracted,
                                         their KV freed, and go on after /wake_up and /resume), then
                                         release_memory_occupation of the weights and the KV cache.
                                         Both levels free both: ringserve keeps the host copy of the
                                         weights, so /wake_up restores them either way (vLLM's level
                                         2 discards them and expects an update)
    POST /wake_up?tags=weights&tags=kv_cache   resume_memory_occupation (no tags: both)
    GET  /is_sleeping                    {"is_sleeping": bool}
    POST /reset_prefix_cache             flush_cache; with {"reset_running_requests": true} the running
                                         requests are retracted first (they compute again), as vLLM's
    POST /tokenize {prompt | messages}   {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize {tokens}            {"prompt"}
    POST /abort_requests {request_ids}   abort those (none given: every request)
    POST /inference/v1/generate          {token_ids, sampling_params (vLLM's names), cache_salt,
                                         request_id, stream} -> {"request_id", "choices": [{"index",
                                         "token_ids", "finish_reason", "logprobs"}], "prompt_logprobs"}

vLLM answers a refusal of pause, sleep or reset with 400 and {"error": ...}; so do these.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from fastapi import FastAPI, Request, Response

from ringserve.actors.frontend.actor import TokenizerManager
from ringserve.actors.frontend.inputs import GenerateArgs
from ringserve.actors.transport.sampling import refuse_unless_default

# vLLM SamplingParams fields ringserve serves only at their default (a request that leaves them
# as they are, or sends null, is served; any other value is a 400 naming the field)
AT_DEFAULT = {"detokenize": True, "truncate_prompt_tokens": None, "allowed_token_ids": None, "bad_words": None,
              "structured_outputs": None, "guided_decoding": None, "best_of": None, "logits_processors": None,
              "extra_args": None, "output_kind": None, "flat_logprobs": False, "skip_reading_prefix_cache": None}  # fmt: skip
PAUSE_MODES = {"abort": "abort", "keep": "in_place", "wait": "wait"}  # vLLM's -> SGLang's


class GenerateBody(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's GenerateRequest (/inference/v1/generate)."""

    token_ids: list[int]
    sampling_params: dict[str, Any] = {}
    model: str | None = None
    request_id: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    cache_salt: str | None = None
    priority: int = 0
    features: Any = None
    kv_transfer_params: Any = None


class TokenizeBody(msgspec.Struct, forbid_unknown_fields=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeBody(msgspec.Struct, forbid_unknown_fields=True):
    tokens: list[int]
    model: str | None = None


class ResetBody(msgspec.Struct, forbid_unknown_fields=True):
    reset_running_requests: bool = False
    reset_external: bool = False


class AbortBody(msgspec.Struct, forbid_unknown_fields=True):
    request_ids: list[str] | None = None


def vllm_sampling(sp: dict[str, Any]) -> tuple[dict[str, Any], int | None, int | None]:
    """vLLM's sampling parameters as ringserve's (its aliases take vLLM's names: max_tokens,
    seed, min_tokens, include_stop_str_in_output), and its `logprobs` and `prompt_logprobs`
    (top-n counts, None: not asked). Nulls are left out, as vLLM reads them."""
    sp = {k: v for k, v in sp.items() if v is not None}
    logprobs, prompt_logprobs = sp.pop("logprobs", None), sp.pop("prompt_logprobs", None)
    for name, default in AT_DEFAULT.items():
        if name in sp:
            refuse_unless_default(f"sampling_params.{name}", sp.pop(name), default)
    for name, n in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ValueError(f"sampling_params.{name}={n!r}: a number of top logprobs >= 0 (or null)")
    return sp, logprobs, prompt_logprobs


def generate_args(b: GenerateBody) -> tuple[GenerateArgs, int | None, int | None]:
    """The generate call of an /inference/v1/generate body, with its logprobs and prompt_logprobs."""
    refuse_unless_default("priority", b.priority, 0)
    for name in ("features", "kv_transfer_params"):
        refuse_unless_default(name, getattr(b, name), None)
    if not b.token_ids:
        raise ValueError("token_ids: cannot be empty")
    sp, logprobs, prompt_logprobs = vllm_sampling(b.sampling_params)
    want = [n for n in (logprobs, prompt_logprobs) if n is not None]
    return GenerateArgs(
        input_ids=b.token_ids, sampling_params=sp, rid=b.request_id, return_logprob=bool(want),
        top_logprobs_num=max(want, default=0), stream=b.stream, cache_salt=b.cache_salt,
        logprob_start_len=0 if prompt_logprobs is not None else -1,
    ), logprobs, prompt_logprobs  # fmt: skip


def _entry(e: list | tuple) -> dict[str, Any]:
    lp, _, text = e
    return {"token": text, "logprob": lp, "bytes": list(text.encode())}


def choice(out: dict[str, Any], index: int, logprobs: int | None) -> dict[str, Any]:
    """One vLLM GenerateResponseChoice of a (cumulative or incremental) result."""
    meta = out["meta_info"]
    reason = meta.get("finish_reason")
    c: dict[str, Any] = {"index": index, "token_ids": out["output_ids"], "finish_reason": reason and reason["type"],
                         "logprobs": None}  # fmt: skip
    if logprobs is not None:
        tops = meta.get("output_top_logprobs") or [[]] * len(meta["output_token_logprobs"])
        c["logprobs"] = {"content": [{**_entry(e), "top_logprobs": [_entry(t) for t in row[:logprobs]]}
                                     for e, row in zip(meta["output_token_logprobs"], tops, strict=True)]}  # fmt: skip
    return c


def prompt_logprobs_of(out: dict[str, Any], n: int) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: None for the first token, then per position the prompt token's
    logprob and the top-n's, keyed by token id (as JSON keys: strings)."""
    meta = out["meta_info"]
    tops = meta.get("input_top_logprobs") or [None] * len(meta["input_token_logprobs"])
    rows: list[dict[str, Any] | None] = [None]
    for (lp, tid, text), top in zip(meta["input_token_logprobs"][1:], tops[1:], strict=True):
        row = {str(tid): {"logprob": lp, "rank": None, "decoded_token": text}}
        for rank, (tlp, ttid, ttext) in enumerate((top or [])[:n], start=1):
            row.setdefault(str(ttid), {"logprob": tlp, "rank": rank, "decoded_token": ttext})
            if ttid == tid:
                row[str(tid)]["rank"] = rank
        rows.append(row)
    return rows


def add_routes(app: FastAPI, tm: TokenizerManager, body: Callable[[Request, Any], Awaitable[Any]],
               json: Callable[..., Response], sse: Callable[[AsyncIterator[Any]], Response], model_name: str) -> None:  # fmt: skip
    """vLLM's routes (the module docstring) on `app`, over `tm`; `body` reads a request's body
    into a type (400 naming the field), `json` and `sse` answer."""

    def refused(out: dict[str, Any]) -> Response | None:
        return None if out.get("success", True) else json({"error": out.get("message", "refused")}, 400)

    async def pause(mode: str, clear_cache: bool = True) -> dict[str, Any]:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode={mode!r}: choose one of {list(PAUSE_MODES)}")
        if mode == "wait":
            return await tm.pause_after_inflight()
        out = await tm.pause_generation(PAUSE_MODES[mode])
        if out["success"] and mode == "abort" and clear_cache:
            await tm.flush_cache()  # (nothing holds KV once every request is aborted)
        return out

    @app.post("/pause")
    async def pause_route(request: Request) -> Response:
        q = request.query_params
        out = await pause(q.get("mode", "abort"), q.get("clear_cache", "true").lower() != "false")
        return refused(out) or json({"status": "paused"})

    @app.post("/resume")
    async def resume() -> Response:
        return refused(await tm.continue_generation()) or json({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused() -> Response:
        return json({"is_paused": (await tm.get_server_info())["paused"]})

    @app.post("/sleep")
    async def sleep(request: Request) -> Response:
        q = request.query_params
        level = q.get("level", "1")
        if level not in ("1", "2"):
            raise ValueError(f"level={level!r}: 1 or 2")
        mode = q.get("mode", "abort")
        # keep: retracted (their KV must go too), so they compute again once woken and resumed
        out = await tm.pause_generation("retract") if mode == "keep" else await pause(mode, clear_cache=False)
        if out["success"]:
            out = await tm.weights.release_memory_occupation(None)
        return refused(out) or Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(request: Request) -> Response:
        tags = request.query_params.getlist("tags") or None
        return refused(await tm.weights.resume_memory_occupation(tags)) or Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping() -> Response:
        return json({"is_sleeping": bool((await tm.get_server_info())["memory_released"])})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        b: ResetBody = await body(request, ResetBody)
        if b.reset_running_requests and not (await tm.get_server_info())["paused"]:
            await tm.pause_generation("retract")
            try:
                out = await tm.flush_cache()
            finally:
                await tm.continue_generation()
        else:
            out = await tm.flush_cache()
        return refused(out) or Response(status_code=200)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        b: TokenizeBody = await body(request, TokenizeBody)
        _model(b.model, model_name)
        if (b.prompt is None) == (b.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if b.messages is not None:
            text = tm.tok.apply_chat_template(
                b.messages, add_generation_prompt=b.add_generation_prompt, tokenize=False
            )
            ids = tm.tok.encode(text, add_special_tokens=False)
        else:
            assert b.prompt is not None
            tm.limits.check_text("prompt", b.prompt)
            ids = tm.tok.encode(b.prompt, add_special_tokens=b.add_special_tokens)
        strs = tm.tok.convert_ids_to_tokens(ids) if b.return_token_strs else None
        return json(
            {"count": len(ids), "max_model_len": tm.args.context_length, "tokens": ids, "token_strs": strs}
        )

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        b: DetokenizeBody = await body(request, DetokenizeBody)
        _model(b.model, model_name)
        bad = [t for t in b.tokens if not 0 <= t < tm.limits.vocab_size]
        if bad:
            raise ValueError(f"tokens: {bad[:4]} outside the vocabulary [0, {tm.limits.vocab_size})")
        return json({"prompt": tm.tok.decode(b.tokens)})

    @app.post("/abort_requests")
    async def abort_requests(request: Request) -> Response:
        b: AbortBody = await body(request, AbortBody)
        if b.request_ids:
            live = [r for rid in b.request_ids for r in tm.core.with_samples(rid) if r in tm.core.states]
            if live:
                tm.abort(live)
            return json({"status": "aborted", "aborted": len(live)})
        n = len(tm.core.states)
        tm.abort_request(abort_all=True)
        return json({"status": "aborted", "aborted": n})

    @app.post("/inference/v1/generate")
    async def generate(request: Request) -> Response:
        b: GenerateBody = await body(request, GenerateBody)
        _model(b.model, model_name)
        args, logprobs, prompt_lps = generate_args(b)
        specs, _ = tm.specs(args)
        rid = specs[0].sample_of or specs[0].rid
        if b.stream:
            states = await tm.submit_all(specs)

            async def chunks() -> AsyncIterator[dict[str, Any]]:
                async for out in tm.stream_states(states, True, incremental=True):
                    yield {"request_id": rid, "choices": [choice(out, out["index"], logprobs)]}

            return sse(chunks())
        outs = await tm.generate(specs, True)
        return json({"request_id": rid, "choices": [choice(o, i, logprobs) for i, o in enumerate(outs)],
                     "prompt_logprobs": prompt_logprobs_of(outs[0], prompt_lps) if prompt_lps is not None else None,
                     "kv_transfer_params": None})  # fmt: skip


def _model(given: str | None, served: str) -> None:
    if given is not None and given != served:
        raise ValueError(f"model={given!r}: this server serves {served!r}")

"""The HTTP server: SGLang's native API and the OpenAI API (openai_api.py), on the frontend loop.

Native: POST /generate (SGLang's JSON in and out, SSE streaming with cumulative chunks),
/abort_request, /pause_generation, /continue_generation, /flush_cache (400 with the reason when
refused), GET /get_server_info, /get_model_info, /get_load, /v1/loads, /health,
/health_generate, /metrics (Prometheus). OpenAI: /v1/models, /v1/completions,
/v1/chat/completions. vLLM's control routes (/pause, /resume, /sleep, /wake_up,
/reset_prefix_cache, /tokenize, /detokenize, /abort_requests) and its token-in token-out
/inference/v1/generate: vllm_api.py.

Bodies are decoded with msgspec into typed structs (/generate's into `GenerateBody`, which
yields the one `GenerateArgs` every surface builds): malformed JSON, a wrong type, an unknown
field or nesting past `MAX_DEPTH` (actors/frontend/limits.py, checked before decoding) is a 400
naming the field; a body past `max_request_bytes` is a 413; bad generate arguments are the
Engine's ValueError text as a 400. Errors are `{"error": {"message"}}` on
native routes and OpenAI's `{"object": "error", "message", "type", "param", "code"}` on /v1.
With an API key every route but /health needs `Authorization: Bearer <key>` (401 otherwise).
A client that disconnects mid-stream has its requests aborted.

Weights from a trainer on another host: `POST /update_weights_from_tensor` with
`Content-Type: application/octet-stream`, a body of safetensors blobs back to back (each a
bucket of at most `max_push_bucket_bytes` of data; `weight_buckets.safetensors_stream` writes
one), the arguments in the query (`weight_version`, `flush_cache`, `abort_all_requests`,
`timeout`, and for deltas `mode` and `base_weight_version`; a blob's rows of a tensor sent as
`Rows`: weight_buckets.py). The server reads each blob's data straight into its one shared-memory segment, the
runner stages it, and the last blob's end applies the update, all or nothing; a bad header,
name, shape or dtype is a 400 naming the tensor and the field, a refusal a 400 with the reason,
and a client that disconnects or stalls (`timeout`) leaves the old weights serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from ringserve.actors.frontend import openai_api as oai
from ringserve.actors.frontend import vllm_api
from ringserve.actors.frontend.actor import TokenizerManager
from ringserve.actors.frontend.errors import EngineDead
from ringserve.actors.frontend.inputs import GenerateArgs
from ringserve.actors.frontend.limits import json_too_deep, too_deep
from ringserve.actors.frontend.verbs import Verb, call_verb

log = logging.getLogger("ringserve.http")

MAX_REQUEST_BYTES = 64 << 20
MAX_PUSH_BUCKET_BYTES = 1 << 30  # data of one safetensors blob of a weight push (the server's one segment)
_NOT_SUPPORTED = {  # SGLang /generate fields ringserve accepts only at their default
    "image_data": None, "video_data": None, "audio_data": None, "input_embeds": None,
    "custom_logit_processor": None,
    "background": False, "return_bytes": False, "return_entropy": False,
}  # fmt: skip


class HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class GenerateBody(GenerateArgs, forbid_unknown_fields=True):
    """/generate's body: SGLang's GenerateReqInput, the GenerateArgs fields and those ringserve
    accepts only at their default (refused otherwise); an unknown field is a 400."""

    return_text_in_logprobs: bool = False
    log_metrics: bool = True
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    input_embeds: Any = None
    custom_logit_processor: Any = None
    # what SGLang's router always serializes (sgl-router's GenerateRequest): accepted and ignored as
    # SGLang ignores them, or served only at their default
    model: str | None = None
    no_logs: bool = False
    background: bool = False
    return_bytes: bool = False
    return_entropy: bool = False

    def args(self) -> GenerateArgs:
        """The generate call, once the fields served only at their default are checked."""
        for name, default in _NOT_SUPPORTED.items():
            value = getattr(self, name)
            if value != default and not (default is None and value in ([], {})):  # (AReaL sends image_data: [])
                raise ValueError(f"{name} is not supported by ringserve")
        fields = {f.name: getattr(self, f.name) for f in msgspec.structs.fields(GenerateArgs)}
        if self.text is not None and self.input_ids is not None:
            fields["text"] = None  # as SGLang: input_ids win
        return GenerateArgs(**fields)


class AbortBody(msgspec.Struct, forbid_unknown_fields=True):
    rid: str = ""
    abort_all: bool = False


class PauseBody(msgspec.Struct, forbid_unknown_fields=True):
    mode: str = "abort"


class EmptyBody(msgspec.Struct, forbid_unknown_fields=True):
    pass


T = Any
_decoders: dict[Any, msgspec.json.Decoder] = {}


async def read_body(request: Request, typ: type[T], limit: int) -> T:
    """The body decoded into `typ`. 413 past `limit` bytes; 400 naming the field for malformed
    JSON, a wrong type, or nesting past MAX_DEPTH (checked before decoding: limits.py). A number
    too large for a float is inf (a 400 from the check that knows the field), not a range error
    naming no field."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise HTTPError(413, f"request body of {length} bytes exceeds the limit of {limit} bytes")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise HTTPError(413, f"request body exceeds the limit of {limit} bytes")
    if not body.strip():
        body = bytearray(b"{}")
    data = bytes(body)
    deep = json_too_deep(data)
    if deep is not None:
        raise HTTPError(400, deep)
    decoder = _decoders.get(typ)
    if decoder is None:
        decoder = _decoders[typ] = msgspec.json.Decoder(typ, float_hook=float)
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as e:
        raise HTTPError(400, f"invalid request: {_readable(e)}") from None
    except msgspec.DecodeError as e:
        raise HTTPError(400, f"malformed JSON: {e}") from None
    except RecursionError:  # cannot happen past json_too_deep; kept as the last line of defence
        raise HTTPError(400, too_deep("request body")) from None


def _readable(e: msgspec.ValidationError) -> str:
    text = str(e)
    msg, _, where = text.partition(" - at `$")
    field = where.rstrip("`").lstrip(".")
    return f"{field or 'request body'}: {msg}"


def _json(obj: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


def _sse(events: AsyncIterator[Any]) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        try:
            async for ev in events:
                yield b"data: " + msgspec.json.encode(ev) + b"\n\n"
        except (ValueError, EngineDead) as e:  # failed mid-stream: one error event, then [DONE]
            yield b"data: " + msgspec.json.encode({"error": {"message": str(e)}}) + b"\n\n"
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def build_app(tm: TokenizerManager, *, model_name: str, model_path: str, api_key: str | None = None,
              max_request_bytes: int = MAX_REQUEST_BYTES, verbs: dict[str, Verb] | None = None,
              max_push_bucket_bytes: int = MAX_PUSH_BUCKET_BYTES) -> FastAPI:  # fmt: skip
    """The FastAPI app over one frontend. `verbs`: extra routes `/<name>` (GET with query
    arguments or POST with a JSON object of keyword arguments) calling the named verb."""
    app = FastAPI(title="ringserve", docs_url=None, redoc_url=None)
    ctx = tm.args.context_length
    if api_key is not None:
        app.add_middleware(_APIKey, key=api_key)
    for exc, status in ((HTTPError, None), (ValueError, 400), (EngineDead, 503)):
        app.add_exception_handler(exc, _handler(status))

    async def body(request: Request, typ: Any) -> Any:
        return await read_body(request, typ, max_request_bytes)

    # ---- native -------------------------------------------------------------------------------
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        b: GenerateBody = await body(request, GenerateBody)
        specs, batched = await _specs(tm, b.args())
        shape = _native(b.return_text_in_logprobs)
        if b.stream:
            states = await tm.submit_all(specs)
            return _sse(_mapped(tm.stream_states(states, batched), shape))
        out = await tm.generate(specs, batched)
        return _json([shape(o) for o in out] if batched else shape(out))

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        b: AbortBody = await body(request, AbortBody)
        if b.abort_all:
            tm.abort_request(abort_all=True)
        elif b.rid and (b.rid in tm.core.states or any(r.startswith(b.rid + "-") for r in tm.core.states)):
            tm.abort_request(b.rid)  # as SGLang: an unknown rid is ignored
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Response:
        b: PauseBody = await body(request, PauseBody)
        r = await tm.pause_generation(b.mode)
        return _json({"message": "Generation paused successfully.", "status": "ok", "detail": r["message"]})

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> Response:
        await body(request, EmptyBody)
        await tm.continue_generation()
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        r = await tm.flush_cache()
        text = "Cache flushed.\n" if r["success"] else f"Cache not flushed.\nReason: {r['message']}\n"
        return Response(text, status_code=200 if r["success"] else 400, media_type="text/plain")

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_server_info() -> Response:
        return _json(await tm.get_server_info())

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def get_model_info() -> Response:
        return _json(tm.model_info())

    @app.get("/get_load")
    async def get_load() -> Response:
        """SGLang's shape, what its router polls: one entry per dp_rank ({dp_rank, num_reqs,
        num_waiting_reqs, num_tokens} and the scheduler's own counts). sglang-router 0.3.2 polls
        it every 30 s under `power_of_two` (and on its own GET /get_loads), summing `num_tokens`;
        each call is counted in /metrics' `ringserve:load_reports_total{route="/get_load"}`."""
        tm.core.metrics.load_report("/get_load")
        return _json(await tm.get_loads())

    @app.get("/v1/loads")
    async def v1_loads() -> Response:
        tm.core.metrics.load_report("/v1/loads")
        loads = [{**ld, "num_total_tokens": ld["max_total_num_tokens"]} for ld in await tm.get_loads()]
        return _json({"dp_rank_count": len(loads), "loads": loads,
                      "aggregate": {"total_running_reqs": sum(ld["num_running_reqs"] for ld in loads),
                                    "total_waiting_reqs": sum(ld["num_waiting_reqs"] for ld in loads),
                                    "avg_token_usage": round(sum(ld["token_usage"] for ld in loads) / len(loads), 6)}})  # fmt: skip

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if await tm.health() else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        try:
            specs, _ = tm.specs(GenerateArgs(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0}))
            out = await asyncio.wait_for(tm.generate(specs, False), 20.0)
        except (EngineDead, TimeoutError):
            return Response(status_code=503)
        return Response(status_code=200 if out["meta_info"]["finish_reason"]["type"] != "abort" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(tm.core.metrics.exposition(await tm.get_loads()), media_type="text/plain; version=0.0.4")

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> Response:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/octet-stream":
            raise HTTPError(415, f"content-type {ctype!r}: send application/octet-stream, safetensors blobs back to "
                                 "back (actors.frontend.weight_buckets.safetensors_stream); base64 JSON is not accepted")  # fmt: skip
        kwargs = _push_query(dict(request.query_params))
        try:
            out = await tm.weights.push_from_body(request.stream(), max_push_bucket_bytes, **kwargs)
        except ClientDisconnect:  # the push is dropped (weight_push.py); nobody reads this answer
            return Response(status_code=400)
        return _json(out, 200 if out["success"] else 400)

    for name in verbs or {}:
        app.add_api_route(f"/{name}", _verb_route(verbs or {}, name, body), methods=["GET", "POST"])

    # ---- vLLM's control routes and token-in token-out generate (actors/frontend/vllm_api.py) ---
    vllm_api.add_routes(app, tm, body, _json, _sse, model_name)

    # ---- OpenAI -------------------------------------------------------------------------------
    def render_chat(messages: list[dict[str, Any]]) -> list[int]:
        if not tm.tok.chat_template:
            raise ValueError("messages: this model has no chat template (use /v1/completions)")
        text = tm.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        tm.limits.check_text("messages", text)  # a conversation that cannot fit is not tokenized
        return tm.tok.encode(text, add_special_tokens=False)

    @app.get("/v1/models")
    async def models() -> Response:
        return _json(oai.models_response(model_name, ctx, tm.sampling_defaults))

    @app.get("/v1/models/{model}")
    async def model(model: str) -> Response:
        if model != model_name:
            raise HTTPError(404, f"The model '{model}' does not exist")
        return _json(oai.models_response(model_name, ctx, tm.sampling_defaults)["data"][0])

    async def openai(request: Request, typ: Any, chat: bool) -> Response:
        r = await body(request, typ)
        if r.model is not None and r.model != model_name:
            raise HTTPError(404, f"The model '{r.model}' does not exist (serving '{model_name}')")
        args = await asyncio.get_running_loop().run_in_executor(
            None, lambda: oai.chat_args(r, render_chat) if chat else oai.completion_args(r)
        )
        try:
            specs, _ = await _specs(tm, args)
        except ValueError as e:  # named as the caller named it (max_tokens, seed), not as SGLang's
            raise ValueError(oai.in_openai_names(str(e), r)) from None
        n = r.n
        echo = None if chat else oai.echo_texts(r, tm.tok.decode)
        if r.stream:
            states = await tm.submit_all(specs)
            so = r.stream_options
            usage = so is not None and so.include_usage
            return _sse(oai.stream_chunks(tm.stream_states(states, True, incremental=False), chat=chat, model=model_name, n=n,
                                          include_usage=usage, echo=echo,
                                          continuous_usage=usage and so is not None and so.continuous_usage_stats))  # fmt: skip
        results = await tm.generate(specs, True)
        if chat:
            return _json(oai.chat_response(results, n, model_name))
        return _json(oai.completion_response(results, n, model_name, echo))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await openai(request, oai.CompletionRequest, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await openai(request, oai.ChatRequest, chat=True)

    return app


class _APIKey:
    """Pure ASGI middleware: every route but /health needs `Authorization: Bearer <key>`."""

    def __init__(self, app: Any, key: str):
        self.app = app
        self.want = f"Bearer {key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.want):
                resp = _error(scope["path"], 401, "missing or wrong API key (Authorization: Bearer <key>)")
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _handler(status: int | None) -> Callable[[Request, Exception], Awaitable[Response]]:
    async def handle(request: Request, e: Exception) -> Response:
        return _error(request.url.path, e.status if isinstance(e, HTTPError) else status or 500, str(e))

    return handle


def _error(path: str, status: int, message: str) -> JSONResponse:
    if path.startswith("/v1/"):
        kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "BadRequestError",
                503: "ServiceUnavailableError"}.get(status, "InternalServerError")  # fmt: skip
        body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
        return JSONResponse({"error": body, **body}, status_code=status)
    return JSONResponse({"error": {"message": message}}, status_code=status)


async def _specs(tm: TokenizerManager, args: GenerateArgs) -> tuple[list, bool]:
    """tm.specs; tokenizing text is CPU work, done off the loop so other requests go on."""
    if args.text is None:
        return tm.specs(args)
    return await asyncio.get_running_loop().run_in_executor(None, tm.specs, args)


def _native(with_text: bool) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """SGLang's /generate output: logprob triples carry the token text only when asked."""

    def shape(out: dict[str, Any]) -> dict[str, Any]:
        meta = out["meta_info"]
        if with_text:
            return out
        for key in ("input_token_logprobs", "output_token_logprobs"):
            if key in meta:
                meta[key] = [(lp, t, None) for lp, t, _ in meta[key]]
        for key in ("input_top_logprobs", "output_top_logprobs", "input_token_ids_logprobs", "output_token_ids_logprobs"):
            if key in meta:
                meta[key] = [None if row is None else [(lp, t, None) for lp, t, _ in row] for row in meta[key]]
        return out

    return shape


async def _mapped(chunks: AsyncIterator[dict[str, Any]], f: Callable[[dict[str, Any]], dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    try:
        async for c in chunks:
            yield f(c)
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


def _push_query(q: dict[str, str]) -> dict[str, Any]:
    """/update_weights_from_tensor's query arguments (400 naming one that is unknown or bad)."""
    out: dict[str, Any] = {}
    for key, value in q.items():
        if key in ("weight_version", "base_weight_version", "mode"):  # (checked by the weights API: 400)
            out[key] = value
        elif key in ("flush_cache", "abort_all_requests"):
            if value.lower() not in ("true", "false", "1", "0"):
                raise HTTPError(400, f"{key}={value!r:.40}: true or false")
            out[key] = value.lower() in ("true", "1")
        elif key == "timeout":
            try:
                out[key] = float(value)
            except ValueError:
                raise HTTPError(400, f"timeout={value!r:.40}: a number of seconds") from None
        else:
            raise HTTPError(400, f"{key}: unknown argument (weight_version, flush_cache, abort_all_requests, timeout, "
                                 "mode, base_weight_version)")  # fmt: skip
    return out


def _verb_route(verbs: dict[str, Verb], name: str,
                body: Callable[..., Awaitable[Any]]) -> Callable[[Request], Awaitable[Response]]:  # fmt: skip
    async def route(request: Request) -> Response:
        kwargs = await body(request, dict[str, Any]) if request.method == "POST" else dict(request.query_params)
        out = await call_verb(verbs, name, kwargs)
        failed = isinstance(out, dict) and out.get("success") is False  # a refusal: 400, with the reason
        return _json(out, 400 if failed else 200)

    return route

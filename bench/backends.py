"""How the harness sends one request through each ringserve front door, streaming, and how it
drives many of them (arrivals, a concurrency cap, a progress bar).

    engine  the in-process `Engine.async_generate(input_ids=..., stream=True)`
    client  `AsyncClient` over the IPC socket (same chunks as the Engine's)
    http    OpenAI `/v1/completions` with `stream: true` (server-sent events)

Every request is greedy with EOS ignored, so it generates exactly its `output_len` tokens on
every backend (and on transformers, bench/hf_backend.py). Times are taken on the client when a
chunk arrives. Engine and client chunks carry the ids so far, so each chunk's new-token count is
exact; an OpenAI chunk carries text only, so each non-empty chunk counts as one token and the
final `usage` gives the output length (tokens the detokenizer held back arrive merged).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ringserve.bench.metrics import RequestRecord
from ringserve.bench.workload import Request

Send = Callable[[Request, RequestRecord], Awaitable[None]]
BACKENDS = ("engine", "client", "http")


def sampling(req: Request) -> dict[str, Any]:
    return {"max_new_tokens": req.output_len, "temperature": 0, "ignore_eos": True}


async def _consume_chunks(chunks: Any, rec: RequestRecord) -> None:
    """Engine / client chunks: cumulative `output_ids` and `meta_info`."""
    seen = 0
    meta: dict[str, Any] = {}
    async for chunk in chunks:
        now = time.perf_counter()
        n = len(chunk["output_ids"])
        if n > seen:
            rec.chunk_times.append(now)
            rec.chunk_tokens.append(n - seen)
            seen = n
        meta = chunk["meta_info"]
        rec.done = now
        rec.output_ids = chunk["output_ids"]
    rec.output_len = int(meta.get("completion_tokens", seen))
    rec.cached_tokens = meta.get("cached_tokens")
    reason = (meta.get("finish_reason") or {}).get("type")
    if reason == "abort":
        rec.error = f"aborted: {meta.get('finish_reason')}"


def engine_sender(engine: Any) -> Send:
    async def send(req: Request, rec: RequestRecord) -> None:
        rec.sent = time.perf_counter()
        chunks = await engine.async_generate(input_ids=req.prompt, sampling_params=sampling(req), stream=True)
        await _consume_chunks(chunks, rec)

    return send


def client_sender(client: Any) -> Send:
    """`client`: a connected `actors.AsyncClient`."""

    async def send(req: Request, rec: RequestRecord) -> None:
        rec.sent = time.perf_counter()
        chunks = await client.generate(input_ids=req.prompt, sampling_params=sampling(req), stream=True)
        await _consume_chunks(chunks, rec)

    return send


def http_sender(http: Any, model: str) -> Send:
    """`http`: an `httpx.AsyncClient` whose base_url is the server's."""

    async def send(req: Request, rec: RequestRecord) -> None:
        # continuous_usage_stats (vLLM's, ringserve's): every chunk says the tokens so far, so a
        # chunk of several tokens (multi-step decode) counts them all; a server that sends usage
        # only at the end has its chunks counted one token each
        body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0,
                "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
        rec.sent = time.perf_counter()
        seen = 0
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter()
                data = line[6:]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                usage = obj.get("usage")
                if usage:
                    rec.output_len = int(usage["completion_tokens"])
                for c in obj.get("choices", ()):
                    if c.get("text"):
                        rec.chunk_times.append(now)
                        # (0: text held back from an earlier chunk's tokens: no ITL sample)
                        rec.chunk_tokens.append(max(0, rec.output_len - seen) if usage else 1)
                        seen += rec.chunk_tokens[-1]
                    if c.get("finish_reason") == "abort":
                        rec.error = "aborted"
                rec.done = now

    return send


async def drive(send: Send, requests: list[Request], arrivals: list[float], max_concurrency: int | None = None,
                progress: bool = True, desc: str = "requests") -> list[RequestRecord]:  # fmt: skip
    """Send request i at `arrivals[i]` seconds after the start (waiting for a free place when
    `max_concurrency` requests are in flight); the record of each, in request order."""
    from tqdm import tqdm

    records = [RequestRecord(prompt_len=r.prompt_len) for r in requests]
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc=desc, unit="req", disable=not progress, leave=False)
    start = time.perf_counter()

    async def one(i: int) -> None:
        delay = start + arrivals[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            if gate is None:
                await send(requests[i], records[i])
            else:
                async with gate:
                    await send(requests[i], records[i])
        except Exception as e:  # one failed request is a figure (failed), not a crash
            records[i].error = f"{type(e).__name__}: {e}"
            records[i].done = time.perf_counter()
        bar.update(1)

    try:
        await asyncio.gather(*(one(i) for i in range(len(requests))))
    finally:
        bar.close()
    return records

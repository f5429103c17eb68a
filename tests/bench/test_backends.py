"""The HTTP client of the benchmarks (bench/backends.py `http_sender`): a streamed chunk counts the
tokens it holds, from the usage every chunk carries where the server sends it so (vLLM's and
ringserve's continuous_usage_stats), else one token a chunk."""

from __future__ import annotations

import asyncio
import json

import httpx

from ringserve.bench.backends import http_sender
from ringserve.bench.metrics import RequestRecord
from ringserve.bench.workload import Request


def record(chunks: list[dict]) -> tuple[RequestRecord, dict]:
    seen: dict = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content))
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    async def go() -> RequestRecord:
        rec = RequestRecord(prompt_len=3, output_len=0)
        async with httpx.AsyncClient(base_url="http://test", transport=httpx.MockTransport(handler)) as h:
            await http_sender(h, "m")(Request([1, 2, 3], 8), rec)
        return rec

    return asyncio.run(go()), seen


def chunk(text: str, done: int | None = None) -> dict:
    c: dict = {"choices": [{"index": 0, "text": text, "finish_reason": None}]}
    if done is not None:
        c["usage"] = {"prompt_tokens": 3, "completion_tokens": done, "total_tokens": 3 + done}
    return c


def test_chunks_of_several_tokens_count_them_from_continuous_usage():
    final = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}}
    rec, body = record([chunk("a", 1), chunk("bcde", 5), chunk("fgh", 8), final])
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert rec.chunk_tokens == [1, 4, 3] and rec.output_len == 8
    assert len(rec.itls()) == 7  # per token: the second chunk's gap spread over its 4 tokens
    rec, _ = record([chunk("a", 1), chunk("b", 2), chunk("c", 2), chunk("d", 3), final])  # "c": held-back text
    assert rec.chunk_tokens == [1, 1, 0, 1] and len(rec.itls()) == 2


def test_a_server_with_usage_only_at_the_end_counts_a_token_a_chunk():
    final = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}
    rec, _ = record([chunk("a"), chunk("b"), chunk("c"), final])
    assert rec.chunk_tokens == [1, 1, 1] and rec.output_len == 3

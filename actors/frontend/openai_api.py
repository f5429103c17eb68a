"""OpenAI-compatible completions and chat completions over the frontend's generate.

Requests are decoded with msgspec into the structs below (unknown fields are refused, naming
the field; OpenAI options ringserve does not implement are refused unless left at their
default; a chat role must be one of OpenAI's `ROLES`, and `developer` reaches the chat template
as `system`; a conversation the template refuses is a 400 naming messages), turned into one
`GenerateArgs` (actors/frontend/inputs.py), and answered in OpenAI's
shapes: `text_completion` / `chat.completion` objects, or SSE chunks (`text_completion` /
`chat.completion.chunk`; for chat a role chunk, content deltas, then a finish chunk per
choice), an optional usage chunk, and `data: [DONE]`. As in SGLang, ids are the request ids,
each choice carries `matched_stop`, and `usage` counts each distinct prompt once.

Structured outputs on both routes: OpenAI's `response_format` (`text`, `json_object`: any JSON
object, `json_schema`: its `schema`, constrained whether `strict` or not, as SGLang does; and
SGLang's `structural_tag`) and SGLang's extras `regex` and `ebnf`, each one sampling parameter
(actors/transport/constraint.py); two at once are refused there.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from ringserve.actors.frontend.inputs import GenerateArgs
from ringserve.actors.transport.sampling import refuse_unless_default

_S = {"forbid_unknown_fields": True, "omit_defaults": True}


class StreamOptions(msgspec.Struct, **_S):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(msgspec.Struct, **_S):
    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> bias in [-100, 100]
    # SGLang's and vLLM's extras
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    include_stop_str_in_output: bool | None = None  # vLLM's name of no_stop_trim
    rid: str | None = None
    # structured outputs (OpenAI's response_format; SGLang's regex and ebnf)
    response_format: dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    return_hidden_states: bool = False  # SGLang's: in each choice's "hidden_states" (enable_return_hidden_states)
    cache_salt: str | None = None  # vLLM's: the prefix cache is shared only among equal salts


class CompletionRequest(_Common, **_S):
    prompt: str | list[Any] = ""  # text, texts, token ids, or lists of token ids
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


ROLES = ("system", "user", "assistant", "tool", "developer")  # OpenAI's chat roles
_TEMPLATE_ROLE = {"developer": "system"}  # OpenAI's newer name for system; chat templates know system


class ChatMessage(msgspec.Struct, **_S):
    role: str
    content: str | list[dict[str, Any]] | None = None  # required (OpenAI's), but an assistant's with tool_calls
    name: str | None = None
    tool_call_id: str | None = None  # a tool message's answer to a call (passed to the template)
    tool_calls: list[dict[str, Any]] | None = None  # an earlier assistant turn's calls (passed to the template)


class ChatRequest(_Common, **_S):
    messages: list[ChatMessage] = []
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # SGLang's chat extras its router always sends: no reasoning parser here, so the reasoning
    # flags change nothing (as in SGLang without one); continue_final_message only at its default
    continue_final_message: bool = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True


def _refuse_unsupported(extra: dict[str, tuple[Any, Any]]) -> None:
    for name, (value, default) in extra.items():
        refuse_unless_default(name, value, default)


def _sampling(r: _Common, max_new_tokens: int | None) -> dict[str, Any]:
    sp: dict[str, Any] = {"max_new_tokens": max_new_tokens, "n": r.n}
    for name in ("temperature", "top_p", "top_k", "min_p", "ignore_eos", "stop_token_ids", "skip_special_tokens",
                 "spaces_between_special_tokens", "no_stop_trim", "include_stop_str_in_output", "stop",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"):  # fmt: skip
        value = getattr(r, name)
        if value is not None:
            sp[name] = value
    if r.logit_bias:
        sp["logit_bias"] = r.logit_bias
    if r.seed is not None:
        sp["sampling_seed"] = r.seed
    for name in ("regex", "ebnf"):
        if getattr(r, name) is not None:
            sp[name] = getattr(r, name)
    if r.response_format is not None:
        sp.update(_response_format(r.response_format))
    return sp


def _response_format(rf: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's response_format as a constraint sampling parameter ({} for plain text)."""
    kind = rf.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": json.dumps({"type": "object"})}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict | bool):
            raise ValueError("response_format.json_schema.schema: a JSON schema is required")
        if not isinstance(spec.get("strict", False), bool):
            raise ValueError("response_format.json_schema.strict: expected a boolean")
        return {"json_schema": json.dumps(spec["schema"])}
    if kind == "structural_tag":
        return {"structural_tag": json.dumps({k: v for k, v in rf.items() if k != "type"})}
    raise ValueError(
        f"response_format.type={kind!r}: choose one of ['text', 'json_object', 'json_schema', 'structural_tag']"
    )


def in_openai_names(message: str, r: _Common) -> str:
    """An error about the generate call a request became, in the OpenAI fields it sent:
    `max_new_tokens` is its max_tokens (or max_completion_tokens), `sampling_seed` its seed."""
    max_name = "max_completion_tokens" if getattr(r, "max_completion_tokens", None) is not None else "max_tokens"
    message = message.removeprefix("sampling_params: ")
    for ours, theirs in (("max_new_tokens", max_name), ("sampling_seed", "seed"), ("min_new_tokens", "min_tokens")):
        message = re.sub(rf"\b{ours}\b", theirs, message)
    return message


def completion_args(r: CompletionRequest) -> GenerateArgs:
    """The generate call of a /v1/completions request. `echo` with `logprobs` asks for the
    prompt's logprobs too (logprob_start_len 0: computed in its prefill, no second pass)."""
    _refuse_unsupported({"suffix": (r.suffix, None)})
    if r.best_of is not None and r.best_of != r.n:
        raise ValueError(f"best_of={r.best_of} is not supported (only best_of == n)")
    if r.max_tokens is not None and r.max_tokens < 1:
        raise ValueError(f"max_tokens={r.max_tokens} must be >= 1")
    if r.logprobs is not None and r.logprobs < 0:
        raise ValueError(f"logprobs={r.logprobs} must be >= 0")
    prompt: Any = r.prompt
    if not prompt:
        raise ValueError("prompt: cannot be empty")
    is_text = isinstance(prompt, str) or isinstance(prompt[0], str)
    return GenerateArgs(
        text=prompt if is_text else None, input_ids=None if is_text else prompt,
        sampling_params=_sampling(r, r.max_tokens), rid=r.rid,
        return_logprob=r.logprobs is not None, top_logprobs_num=r.logprobs or 0, stream=r.stream,
        logprob_start_len=0 if r.echo and r.logprobs is not None else -1, return_hidden_states=r.return_hidden_states,
        cache_salt=r.cache_salt,
    )  # fmt: skip


def echo_texts(r: CompletionRequest, decode: Callable[[list[int]], str]) -> list[str] | None:
    """With `echo`: each prompt's text (token prompts decoded), in prompt order; else None."""
    if not r.echo:
        return None
    p: Any = r.prompt
    if isinstance(p, str):
        return [p]
    if isinstance(p[0], str):
        return list(p)
    return [decode(x) for x in (p if isinstance(p[0], list) else [p])]


def chat_args(r: ChatRequest, render: Callable[[list[dict[str, Any]]], list[int]]) -> GenerateArgs:
    """The generate call of a /v1/chat/completions request; `render(messages)` is the model's
    chat template, tokenized."""
    _refuse_unsupported({"tools": (r.tools, None), "continue_final_message": (r.continue_final_message, False)})
    if not r.messages:
        raise ValueError("messages: cannot be empty")
    messages = []
    for i, msg in enumerate(r.messages):
        if msg.role not in ROLES:
            raise ValueError(f"messages[{i}].role={msg.role!r}: expected one of {list(ROLES)}")
        if msg.tool_calls is not None and msg.role != "assistant":
            raise ValueError(f"messages[{i}].tool_calls: only an assistant message carries tool calls")
        if msg.content is None and not msg.tool_calls:  # OpenAI: missing or null content is a 400
            raise ValueError(f"messages[{i}].content: required (a string or a list of text parts)"
                             + (", or tool_calls" if msg.role == "assistant" else ""))  # fmt: skip
        content = msg.content
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{i}].content[{j}]: only text parts are supported")
                extra = sorted(set(part) - {"type", "text"})
                if extra:
                    raise ValueError(f"messages[{i}].content[{j}]: unknown field(s) {extra} in a text part")
                parts.append(part["text"])
            content = "".join(parts)
        m: dict[str, Any] = {"role": _TEMPLATE_ROLE.get(msg.role, msg.role), "content": content or ""}
        if msg.tool_call_id is not None:
            m["tool_call_id"] = msg.tool_call_id
        if msg.tool_calls:
            m["tool_calls"] = msg.tool_calls
        messages.append(m)
    max_new = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
    if max_new is not None and max_new < 1:
        name = "max_completion_tokens" if r.max_completion_tokens is not None else "max_tokens"
        raise ValueError(f"{name}={max_new} must be >= 1")
    if r.top_logprobs is not None and not r.logprobs:
        raise ValueError("top_logprobs needs logprobs=true")
    return GenerateArgs(
        input_ids=_render(render, messages), sampling_params=_sampling(r, max_new), rid=r.rid,
        return_logprob=r.logprobs, top_logprobs_num=(r.top_logprobs or 0) if r.logprobs else 0, stream=r.stream,
        return_hidden_states=r.return_hidden_states, cache_salt=r.cache_salt,
    )  # fmt: skip


def _render(render: Callable[[list[dict[str, Any]]], list[int]], messages: list[dict[str, Any]]) -> list[int]:
    """The chat template's tokens; a template that refuses the conversation (e.g. roles that do
    not alternate, a system message it does not take) is a ValueError naming messages."""
    from jinja2 import TemplateError

    try:
        return render(messages)
    except TemplateError as e:
        raise ValueError(f"messages: the model's chat template refused them: {e}") from None


# ---- responses ---------------------------------------------------------------------------------
def _finish(meta: dict[str, Any]) -> tuple[str | None, Any]:
    fr = meta.get("finish_reason")
    return (fr["type"], fr.get("matched")) if fr else (None, None)


def _usage(results: list[dict[str, Any]], n: int) -> dict[str, int]:
    prompt = sum(r["meta_info"]["prompt_tokens"] for r in results[::n])
    completion = sum(r["meta_info"]["completion_tokens"] for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _completion_logprobs(meta: dict[str, Any], start: int = 0, echo: bool = False) -> dict[str, Any] | None:
    """OpenAI's completion logprobs of the output tokens from `start`; with `echo`, the prompt's
    first (its first token has none: null, as OpenAI's)."""
    if "output_token_logprobs" not in meta:
        return None
    toks = meta["output_token_logprobs"][start:]
    tops: list[Any] = meta.get("output_top_logprobs", [[]] * (len(toks) + start))[start:]
    if echo:
        prompt = meta["input_token_logprobs"]
        toks = prompt + toks
        tops = meta.get("input_top_logprobs", [None] + [[]] * (len(prompt) - 1)) + tops
    return {
        "tokens": [t[2] for t in toks],
        "token_logprobs": [t[0] for t in toks],
        "top_logprobs": [None if row is None else {e[2]: e[0] for e in row} for row in tops],
        "text_offset": [-1] * len(toks),
    }


def _chat_logprobs(meta: dict[str, Any], start: int = 0) -> dict[str, Any] | None:
    if "output_token_logprobs" not in meta:
        return None

    def entry(e: Any) -> dict[str, Any]:
        return {"token": e[2], "logprob": e[0], "bytes": list(e[2].encode())}

    toks = meta["output_token_logprobs"][start:]
    tops = meta.get("output_top_logprobs", [[]] * (len(toks) + start))[start:]
    return {"content": [{**entry(t), "top_logprobs": [entry(e) for e in row]} for t, row in zip(toks, tops, strict=True)]}


def _hidden(meta: dict[str, Any]) -> dict[str, Any]:
    """A choice's "hidden_states" (SGLang's), when its request asked for them."""
    return {"hidden_states": meta["hidden_states"]} if "hidden_states" in meta else {}


def completion_response(results: list[dict[str, Any]], n: int, model: str, echo: list[str] | None = None) -> dict[str, Any]:
    """`echo`: each prompt's text, put before its choices' text (and its logprobs before theirs)."""
    choices = []
    for i, r in enumerate(results):
        reason, matched = _finish(r["meta_info"])
        text = r["text"] if echo is None else echo[i // n] + r["text"]
        choices.append({"index": i, "text": text, "logprobs": _completion_logprobs(r["meta_info"], echo=echo is not None),
                        "finish_reason": reason, "matched_stop": matched, **_hidden(r["meta_info"])})  # fmt: skip
    return {"id": results[0]["meta_info"]["id"], "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": _usage(results, n)}  # fmt: skip


def chat_response(results: list[dict[str, Any]], n: int, model: str) -> dict[str, Any]:
    choices = []
    for i, r in enumerate(results):
        reason, matched = _finish(r["meta_info"])
        choices.append({"index": i, "message": {"role": "assistant", "content": r["text"] or None},
                        "logprobs": _chat_logprobs(r["meta_info"]), "finish_reason": reason, "matched_stop": matched,
                        **_hidden(r["meta_info"])})  # fmt: skip
    return {"id": results[0]["meta_info"]["id"], "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": _usage(results, n)}  # fmt: skip


async def stream_chunks(chunks: AsyncIterator[dict[str, Any]], *, chat: bool, model: str, n: int,
                        include_usage: bool, echo: list[str] | None = None,
                        continuous_usage: bool = False) -> AsyncIterator[dict[str, Any]]:  # fmt: skip
    """OpenAI chunk objects from the frontend's cumulative chunks (each with "index"); `echo`
    (completions): each choice's first chunk starts with its prompt's text and logprobs;
    `continuous_usage` (vLLM's stream_options.continuous_usage_stats, with include_usage): every
    chunk carries the usage so far, so a client knows how many tokens each chunk holds (several
    where the server streams them so: multi-step decode, stream_interval)."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    created = int(time.time())
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    prompts: dict[int, int] = {}  # choice -> its prompt's tokens
    finals: dict[int, dict[str, Any]] = {}
    cid = None

    def wrap(choice: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"id": cid, "object": obj, "created": created, "model": model, "choices": [choice]}
        if continuous_usage:
            prompt = sum(v for j, v in prompts.items() if j % n == 0)  # (n choices share a prompt)
            completion = sum(sent_tokens.values())
            out["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        return out

    async for c in chunks:
        i = c.get("index", 0)
        meta = c["meta_info"]
        cid = cid or meta["id"]
        prompts[i] = meta["prompt_tokens"]
        if chat and i not in sent_text:
            yield wrap({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None, "matched_stop": None})  # fmt: skip
        text = c["text"][sent_text.get(i, 0) :]
        start = sent_tokens.get(i, 0)
        first = i not in sent_text
        sent_text[i], sent_tokens[i] = len(c["text"]), len(c["output_ids"])
        reason, matched = _finish(meta)
        echoing = echo is not None and first
        if echoing:
            assert echo is not None
            text = echo[i // n] + text
        logprobs = _chat_logprobs(meta, start) if chat else _completion_logprobs(meta, start, echoing)
        if text or (logprobs and len(c["output_ids"]) > start) or (reason and not chat):
            if chat:
                yield wrap({"index": i, "delta": {"content": text}, "logprobs": logprobs,
                            "finish_reason": None, "matched_stop": None})  # fmt: skip
            else:
                yield wrap({"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason,
                            "matched_stop": matched})  # fmt: skip
        if reason:
            finals[i] = c
            if chat:
                yield wrap({"index": i, "delta": {}, "logprobs": None, "finish_reason": reason, "matched_stop": matched})
    if include_usage and finals:
        results = [finals[i] for i in sorted(finals)]
        yield {"id": cid, "object": obj, "created": created, "model": model, "choices": [], "usage": _usage(results, n)}


def models_response(name: str, max_model_len: int, sampling_defaults: dict[str, Any]) -> dict[str, Any]:
    """/v1/models: the served model (vLLM's fields), with the sampling defaults a request that
    leaves them out gets (the model's generation_config.json: `--sampling-defaults model`)."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                        "owned_by": "ringserve", "root": name, "max_model_len": max_model_len,
                                        "default_sampling_params": dict(sampling_defaults)}]}  # fmt: skip

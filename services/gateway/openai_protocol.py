"""OpenAI request parsing and response formatting (docs/design.md §9.4), independent of the web framework.

Parsing validates a JSON body against its request model (openai_models.py: pydantic, one policy per
field) and turns it into the pipeline's inputs; every bad, refused or wrongly typed field raises
`Invalid` (HTTP 400) naming the field.

Supported beyond the OpenAI basics: vLLM's top_k, min_p, min_tokens, stop_token_ids, ignore_eos,
include_stop_str_in_output, skip_special_tokens, add_generation_prompt, continue_final_message,
chat_template_kwargs (e.g. {"thinking": false}), request_id, SGLang's separate_reasoning, and the
ddtree extensions `budget` (tree node budget) and `no_spec` (plain autoregressive decoding). What is
refused, and why: openai_models.REFUSED (and README "OpenAI parameters"). Structured outputs
(response_format, structured_outputs, guided_*) become GenerationOptions.grammar (structured_outputs.py);
tool_choice required / a named function, a forced tool call (pipeline.chat_job).

logprobs (chat: logprobs + top_logprobs; completions: logprobs N) set GenerationOptions.top_logprobs,
0..20; the answer's shapes are openai_logprobs.py's. `n` runs n choices (choices.py); usage counts the
prompt once and sums the completion tokens.

Responses carry the OpenAI fields plus `spec` (speculative statistics of the answer: verify_steps,
avg_accept_length, accept_histogram[k] = steps that committed k tokens, ttft_ms, decode_ms measured by
the verifier). Streams send it on the chunk that carries finish_reason. usage has
prompt_tokens_details.cached_tokens (prompt tokens the verifier's prefix cache held).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ddtree.config import GatewayConfig
from ddtree.contract.sampling_params import MAX_TOP_LOGPROBS
from ddtree.gateway.choices import check_n
from ddtree.gateway.generation import Result
from ddtree.gateway.openai_logprobs import chat_logprobs, completion_logprobs
from ddtree.gateway.openai_models import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    Request,
    content_part,
    json_type,
    validate,
)
from ddtree.gateway.pipeline import Invalid
from ddtree.gateway.structured_outputs import request_grammar
from ddtree.protocol.ddtree.v1 import common_pb2, gateway_pb2

__all__ = ["json_type"]

INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1


# -- requests ---------------------------------------------------------------------------------
@dataclasses.dataclass
class ChatParams:
    model: str | None
    messages: list[dict]
    options: gateway_pb2.GenerationOptions
    tools: list | None
    tool_choice: str
    chat_template_kwargs: dict | None
    separate_reasoning: bool
    stream: bool
    include_usage: bool
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    request_id: str | None = None
    user: str | None = None
    n: int = 1


@dataclasses.dataclass
class CompletionParams:
    model: str | None
    prompt: str | list[int]
    options: gateway_pb2.GenerationOptions
    stream: bool
    include_usage: bool
    request_id: str | None = None
    user: str | None = None
    n: int = 1


def _in(key: str, value: int | None, lo: int, hi: int) -> int | None:
    if value is not None and not lo <= value <= hi:
        raise Invalid(f"{key}: must be in [{lo}, {hi}], got {value}")
    return value


def _options(r: Request, config: GatewayConfig, max_tokens: int | None, key: str) -> gateway_pb2.GenerationOptions:
    """The sampling and stopping fields as GenerationOptions (the pipeline checks what the proto cannot
    tell apart from unset, e.g. top_p 0)."""
    o = gateway_pb2.GenerationOptions()
    if max_tokens is not None:
        o.max_tokens = _in(key, max_tokens, 1, config.max_tokens_limit)
    o.temperature = 1.0 if r.temperature is None else r.temperature
    if r.top_p is not None and not 0 < r.top_p <= 1:
        raise Invalid(f"top_p: must be in (0, 1], got {r.top_p}")
    o.top_p = 1.0 if r.top_p is None else r.top_p
    o.top_k = max(_in("top_k", r.top_k, -1, INT32_MAX) or 0, 0)  # -1 (vLLM's "off") and 0 both disable top-k
    o.min_p = r.min_p or 0.0
    if r.seed is not None:
        o.seed = _in("seed", r.seed, 0, UINT64_MAX)
    o.stop.extend([r.stop] if isinstance(r.stop, str) else r.stop or [])
    for i, t in enumerate(r.stop_token_ids or []):
        if not 0 <= t <= INT32_MAX:
            raise Invalid(f"stop_token_ids[{i}]: token id {t} is outside the vocabulary")
    o.stop_token_ids.extend(r.stop_token_ids or [])
    o.ignore_eos = bool(r.ignore_eos)
    o.min_tokens = _in("min_tokens", r.min_tokens, 0, INT32_MAX) or 0
    o.include_stop_str_in_output = bool(r.include_stop_str_in_output)
    if r.skip_special_tokens is not None:
        o.skip_special_tokens = r.skip_special_tokens
    o.budget = _in("budget", r.budget, 0, INT32_MAX) or 0
    o.no_spec = bool(r.no_spec)
    o.grammar = request_grammar(r)  # response_format, structured_outputs, guided_*: "" when none
    return o


def _content(value: Any, where: str) -> str | None:
    """A message's content: a string, null, or an array of text parts (joined with newlines)."""
    if not isinstance(value, list):
        return value
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict):
            raise Invalid(f"{where}[{j}]: must be object, got {json_type(part)}")
        p = content_part(part, f"{where}[{j}]")
        if p.type != "text":
            raise Invalid(f"{where}[{j}].type: {p.type!r} is not supported (text parts only)")
        texts.append(p.text or "")
    return "\n".join(texts)


def _message(m: ChatMessage, i: int) -> dict:
    d: dict = {
        "role": "system" if m.role == "developer" else m.role,
        "content": _content(m.content, f"messages[{i}].content"),
    }
    for key in ("name", "tool_call_id"):
        if getattr(m, key) is not None:
            d[key] = getattr(m, key)
    reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    if reasoning is not None:
        d["reasoning_content"] = reasoning
    if m.tool_calls is not None:
        d["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
    return d


def _tool_choice(value: Any) -> str:
    """auto | none | required, or a named function as "function:NAME" (pipeline.chat_job)."""
    if value is None:
        return "auto"
    if isinstance(value, dict):
        fn = value.get("function")
        if value.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise Invalid('tool_choice: a named tool is {"type": "function", "function": {"name": NAME}}')
        return f"function:{fn['name']}"
    if value not in ("auto", "none", "required"):
        raise Invalid(f"tool_choice: must be auto, none, required or a named function, got {value!r}")
    return value


def _stream(r: Request) -> tuple[bool, bool]:
    return bool(r.stream), bool(r.stream_options and r.stream_options.include_usage)


def _chat_logprobs(r: ChatCompletionRequest, o: gateway_pb2.GenerationOptions) -> None:
    top = _in("top_logprobs", r.top_logprobs, 0, MAX_TOP_LOGPROBS)
    if top and not r.logprobs:
        raise Invalid("top_logprobs: needs logprobs: true")
    if r.logprobs:
        o.top_logprobs = top or 0


def parse_chat(body: dict, config: GatewayConfig) -> ChatParams:
    r = validate(ChatCompletionRequest, body)
    max_tokens, key = r.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens, key = r.max_tokens, "max_tokens"
    stream, include_usage = _stream(r)
    options = _options(r, config, max_tokens, key)
    _chat_logprobs(r, options)
    return ChatParams(
        model=r.model,
        messages=[_message(m, i) for i, m in enumerate(r.messages)],
        options=options,
        tools=r.tools,
        tool_choice=_tool_choice(r.tool_choice),
        chat_template_kwargs=r.chat_template_kwargs,
        separate_reasoning=r.separate_reasoning is not False,
        stream=stream,
        include_usage=include_usage,
        add_generation_prompt=r.add_generation_prompt is not False,
        continue_final_message=bool(r.continue_final_message),
        request_id=r.request_id,
        user=r.user,
        n=check_n(r.n),
    )


def _prompt(prompt: Any) -> str | list[int]:
    if prompt is None:
        raise Invalid("prompt: is required")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise Invalid(f"prompt: one prompt per request is supported, got {len(prompt)}")
        prompt = prompt[0]
    if isinstance(prompt, list):
        for i, t in enumerate(prompt):
            if not isinstance(t, int) or isinstance(t, bool):
                raise Invalid(f"prompt[{i}]: must be integer (a token id), got {json_type(t)}")
            if not 0 <= t <= INT32_MAX:
                raise Invalid(f"prompt[{i}]: token id {t} is outside the vocabulary")
    elif not isinstance(prompt, str):
        raise Invalid(f"prompt: must be string or array of token ids, got {json_type(prompt)}")
    return prompt


def parse_completion(body: dict, config: GatewayConfig) -> CompletionParams:
    r = validate(CompletionRequest, body)
    stream, include_usage = _stream(r)
    options = _options(r, config, r.max_tokens, "max_tokens")
    if r.logprobs is not None:
        options.top_logprobs = _in("logprobs", r.logprobs, 0, MAX_TOP_LOGPROBS)
    return CompletionParams(
        model=r.model,
        prompt=_prompt(r.prompt),
        options=options,
        stream=stream,
        include_usage=include_usage,
        request_id=r.request_id,
        user=r.user,
        n=check_n(r.n),
    )


# -- responses -------------------------------------------------------------------------------------------
def usage_json(u: common_pb2.Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def sum_usage(usages: list[common_pb2.Usage]) -> common_pb2.Usage:
    """The usage of n choices of one prompt, as OpenAI counts it: the prompt once, the completions summed.
    cached_tokens: what every choice took from the cache (the least); the spec statistics over all
    steps of all choices (ttft / decode: the slowest choice's)."""
    if len(usages) == 1:
        return usages[0]
    hist = [0] * max(len(u.accept_histogram) for u in usages)
    for u in usages:
        for k, v in enumerate(u.accept_histogram):
            hist[k] += v
    steps = sum(u.verify_steps for u in usages)
    return common_pb2.Usage(
        prompt_tokens=usages[0].prompt_tokens,
        completion_tokens=sum(u.completion_tokens for u in usages),
        verify_steps=steps,
        avg_accept_length=sum(k * v for k, v in enumerate(hist)) / steps if steps else 0.0,
        accept_histogram=hist,
        ttft_ms=max(u.ttft_ms for u in usages),
        decode_ms=max(u.decode_ms for u in usages),
        cached_tokens=min(u.cached_tokens for u in usages),
    )


def spec_json(u: common_pb2.Usage) -> dict:
    return {
        "verify_steps": u.verify_steps,
        "avg_accept_length": round(u.avg_accept_length, 4),
        "accept_histogram": list(u.accept_histogram),
        "ttft_ms": round(u.ttft_ms, 3),
        "decode_ms": round(u.decode_ms, 3),
    }


def error_json(message: str, status: int, param: str | None = None) -> dict:
    kinds = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "invalid_request_error",
        422: "invalid_request_error",
        429: "rate_limit_error",
        503: "service_unavailable",
        504: "timeout",
    }
    return {"error": {"message": message, "type": kinds.get(status, "server_error"), "param": param, "code": status}}


def field_of(message: str) -> str | None:
    """The field an error message names ("messages[0].role: ..." -> "messages[0].role")."""
    head, sep, _ = message.partition(": ")
    return head if sep and " " not in head else None


class EventStream:
    """OpenAI stream chunks of one request's n choices: start(), then events((index, chunk)) per
    GenerateChunk of choice `index`. Each choice's finish chunk carries its own spec; the usage chunk
    (include_usage) comes once, after the last choice finished, summed (sum_usage). `strings` (a
    TokenStrings) when the request asked for logprobs."""

    def __init__(self, rid: str, model: str, created: int, include_usage: bool, obj: str, n: int = 1, strings=None):
        self.rid, self.model, self.created, self.include_usage, self.obj = rid, model, created, include_usage, obj
        self.n, self.strings = n, strings
        self._usages: dict[int, common_pb2.Usage] = {}

    def _chunk(self, choices: list, **extra) -> dict:
        return {
            "id": self.rid,
            "object": self.obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def _final(self, index: int, choice: dict, c: gateway_pb2.GenerateChunk) -> list[dict]:
        out = [self._chunk([choice], spec=spec_json(c.usage))]
        self._usages[index] = c.usage
        if self.include_usage and len(self._usages) == self.n:
            out.append(self._chunk([], usage=usage_json(sum_usage([self._usages[i] for i in range(self.n)]))))
        return out


class ChatStream(EventStream):
    """chat.completion.chunk events in OpenAI order, per choice: role; content / reasoning_content
    deltas (with their tokens' logprobs); tool calls (id + name first, then argument fragments);
    finish_reason (+ spec); then usage; (then [DONE])."""

    def __init__(self, rid: str, model: str, created: int, include_usage: bool, n: int = 1, strings=None):
        super().__init__(rid, model, created, include_usage, "chat.completion.chunk", n, strings)

    def _delta(self, index: int, delta: dict, finish_reason: str | None = None, logprobs=None) -> dict:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def start(self) -> list[dict]:
        return [self._chunk([self._delta(i, {"role": "assistant", "content": ""})]) for i in range(self.n)]

    def events(self, item: tuple[int, gateway_pb2.GenerateChunk]) -> list[dict]:
        index, c = item
        out = []
        delta = {}
        if c.reasoning_delta:  # both names: vLLM's current clients read `reasoning`, older ones `reasoning_content`
            delta["reasoning"] = delta["reasoning_content"] = c.reasoning_delta
        if c.text_delta:
            delta["content"] = c.text_delta
        logprobs = chat_logprobs(self.strings, c.token_ids, c.logprobs) if self.strings and c.logprobs else None
        if delta or logprobs:  # a chunk's tokens may render no text yet (a held-back stop string, a split character)
            out.append(self._chunk([self._delta(index, delta, logprobs=logprobs)]))
        for d in c.tool_calls:
            if d.id:
                call = {"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
            else:
                call = {"index": d.index, "function": {"arguments": d.arguments_delta}}
            out.append(self._chunk([self._delta(index, {"tool_calls": [call]})]))
            if d.id and d.arguments_delta:
                more = {"tool_calls": [{"index": d.index, "function": {"arguments": d.arguments_delta}}]}
                out.append(self._chunk([self._delta(index, more)]))
        if c.finish_reason:
            out += self._final(index, self._delta(index, {}, c.finish_reason), c)
        return out


class CompletionStream(EventStream):
    """text_completion events per choice: text deltas (with their tokens' logprobs); finish_reason
    (+ spec); then usage; (then [DONE])."""

    def __init__(self, rid: str, model: str, created: int, include_usage: bool, n: int = 1, strings=None):
        super().__init__(rid, model, created, include_usage, "text_completion", n, strings)
        self._offsets = [0] * n  # text_offset of each choice's next token

    def _choice(self, index: int, text: str, finish_reason: str | None = None, logprobs=None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def start(self) -> list[dict]:
        return []

    def events(self, item: tuple[int, gateway_pb2.GenerateChunk]) -> list[dict]:
        index, c = item
        out = []
        logprobs = None
        if self.strings and c.logprobs:
            logprobs = completion_logprobs(self.strings, c.token_ids, c.logprobs, self._offsets[index])
            self._offsets[index] += sum(len(t) for t in logprobs["tokens"])
        if c.text_delta or logprobs:
            out.append(self._chunk([self._choice(index, c.text_delta, logprobs=logprobs)]))
        if c.finish_reason:
            out += self._final(index, self._choice(index, "", c.finish_reason), c)
        return out


def _spec_and_usage(results: list[Result]) -> dict:
    usage = sum_usage([r.usage for r in results])
    return {"usage": usage_json(usage), "spec": spec_json(usage)}


def chat_response(rid: str, model: str, created: int, results: list[Result], strings=None) -> dict:
    choices = []
    for index, r in enumerate(results):
        message: dict = {
            "role": "assistant",
            "content": r.text or None,  # null when the answer is only reasoning or tool calls
            "reasoning": r.reasoning or None,
            "reasoning_content": r.reasoning or None,
        }
        if r.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in r.tool_calls
            ]
        logprobs = chat_logprobs(strings, r.token_ids, r.logprobs) if strings else None
        choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": r.finish_reason})
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        **_spec_and_usage(results),
    }


def completion_response(rid: str, model: str, created: int, results: list[Result], strings=None) -> dict:
    choices = [
        {
            "index": index,
            "text": r.text,
            "logprobs": completion_logprobs(strings, r.token_ids, r.logprobs) if strings else None,
            "finish_reason": r.finish_reason,
        }
        for index, r in enumerate(results)
    ]
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        **_spec_and_usage(results),
    }

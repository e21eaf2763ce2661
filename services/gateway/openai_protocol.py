"""OpenAI request parsing and response formatting (docs/design.md §9.4), independent of the web framework.

Parsing turns a JSON body into the pipeline's inputs. A field of the wrong JSON type raises
`FieldTypeError` (HTTP 422); any other bad or unsupported value raises `Invalid` (HTTP 400). Both name
the field. Unknown fields are ignored, as OpenAI clients send fields servers may not know.

Supported beyond the OpenAI basics: top_k, stop_token_ids, ignore_eos, separate_reasoning,
chat_template_kwargs (e.g. {"thinking": false}), and the ddtree extensions `budget` (tree node budget)
and `no_spec` (plain autoregressive decoding). Unsupported and refused with a clear 400: n > 1,
logprobs, penalties, tool_choice "required" or a named tool, response_format other than text, echo,
suffix, best_of > 1, non-text content parts.

Responses carry the OpenAI fields plus `spec` (speculative statistics of the answer: verify_steps,
avg_accept_length, accept_histogram[k] = steps that committed k tokens, ttft_ms, decode_ms measured by
the verifier). Streams send it on the chunk that carries finish_reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ddtree.config import GatewayConfig
from ddtree.gateway.generation import Result
from ddtree.gateway.pipeline import Invalid
from ddtree.protocol.ddtree.v1 import common_pb2, gateway_pb2

INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
_KINDS = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


class FieldTypeError(Invalid):
    """A field of the wrong JSON type (HTTP 422)."""


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object" if isinstance(value, dict) else type(value).__name__


class Fields:
    """Typed reads of one JSON object; every error names the field (`where` + key)."""

    def __init__(self, data: dict, where: str = ""):
        self.data = data
        self.where = where

    def get(self, key: str, *kinds: str, default: Any = None) -> Any:
        value = self.data.get(key)
        if value is None:
            return default
        if not any(
            isinstance(value, _KINDS[k]) and not (k in ("integer", "number") and isinstance(value, bool)) for k in kinds
        ):
            raise FieldTypeError(f"{self.where}{key}: must be {' or '.join(kinds)}, got {json_type(value)}")
        return value

    def int_in(self, key: str, lo: int, hi: int, default: Any = None) -> Any:
        value = self.get(key, "integer", default=default)
        if value is not None and not lo <= value <= hi:
            raise Invalid(f"{self.where}{key}: must be in [{lo}, {hi}], got {value}")
        return value

    def number(self, key: str, default: float) -> float:
        value = self.get(key, "number", default=default)
        try:
            return float(value)
        except OverflowError:
            raise Invalid(f"{self.where}{key}: {value} is out of range") from None


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


@dataclasses.dataclass
class CompletionParams:
    model: str | None
    prompt: str | list[int]
    options: gateway_pb2.GenerationOptions
    stream: bool
    include_usage: bool


def _refuse_unsupported(f: Fields) -> None:
    n = f.get("n", "integer", default=1)
    if n != 1:
        raise Invalid(f"n: only n = 1 is supported, got {n}; send separate requests for several answers")
    for key in ("presence_penalty", "frequency_penalty"):
        if f.number(key, 0.0) != 0:
            raise Invalid(f"{key}: not supported (only 0)")
    if f.number("repetition_penalty", 1.0) != 1:
        raise Invalid("repetition_penalty: not supported (only 1)")
    if f.get("logit_bias", "object"):
        raise Invalid("logit_bias: not supported")
    if f.get("top_logprobs", "integer"):
        raise Invalid("top_logprobs: not supported")


def _options(f: Fields, config: GatewayConfig) -> gateway_pb2.GenerationOptions:
    """The sampling and stopping fields, as the pipeline's GenerationOptions (ranges the proto can
    hold are checked here; the pipeline checks the rest)."""
    o = gateway_pb2.GenerationOptions()
    max_tokens = f.get("max_completion_tokens", "integer")
    key = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, key = f.get("max_tokens", "integer"), "max_tokens"
    if max_tokens is not None:
        if not 1 <= max_tokens <= config.max_tokens_limit:
            raise Invalid(f"{key}: must be in [1, {config.max_tokens_limit}], got {max_tokens}")
        o.max_tokens = max_tokens
    o.temperature = f.number("temperature", 1.0)
    o.top_p = f.number("top_p", 1.0)
    top_k = f.int_in("top_k", -1, INT32_MAX, default=0)
    o.top_k = max(top_k, 0)  # -1 (vLLM's "off") and 0 both disable top-k
    seed = f.int_in("seed", 0, UINT64_MAX)
    if seed is not None:
        o.seed = seed
    stop = f.get("stop", "string", "array", default=[])
    stop = [stop] if isinstance(stop, str) else stop
    for i, s in enumerate(stop):
        if not isinstance(s, str):
            raise FieldTypeError(f"stop[{i}]: must be string, got {json_type(s)}")
    o.stop.extend(stop)
    stop_ids = f.get("stop_token_ids", "array", default=[])
    for i, t in enumerate(stop_ids):
        if not isinstance(t, int) or isinstance(t, bool):
            raise FieldTypeError(f"stop_token_ids[{i}]: must be integer, got {json_type(t)}")
        if not 0 <= t <= INT32_MAX:
            raise Invalid(f"stop_token_ids[{i}]: token id {t} is outside the vocabulary")
    o.stop_token_ids.extend(stop_ids)
    o.ignore_eos = f.get("ignore_eos", "boolean", default=False)
    o.budget = f.int_in("budget", 0, INT32_MAX, default=0)
    o.no_spec = f.get("no_spec", "boolean", default=False)
    return o


def _stream_flags(f: Fields) -> tuple[bool, bool]:
    stream = f.get("stream", "boolean", default=False)
    so = Fields(f.get("stream_options", "object", default={}), "stream_options.")
    return stream, so.get("include_usage", "boolean", default=False)


def _content(value: Any, where: str) -> str | None:
    """A message's content: a string, null, or an array of text parts (joined with newlines)."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise FieldTypeError(f"{where}: must be string or array of content parts, got {json_type(value)}")
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict):
            raise FieldTypeError(f"{where}[{j}]: must be object, got {json_type(part)}")
        p = Fields(part, f"{where}[{j}].")
        kind = p.get("type", "string")
        if kind != "text":
            raise Invalid(f"{where}[{j}].type: {kind!r} is not supported (text parts only)")
        texts.append(p.get("text", "string", default=""))
    return "\n".join(texts)


def _messages(value: Any) -> list[dict]:
    if value is None:
        raise Invalid("messages: is required")
    if not isinstance(value, list):
        raise FieldTypeError(f"messages: must be array, got {json_type(value)}")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise FieldTypeError(f"{where}: must be object, got {json_type(m)}")
        f = Fields(m, where + ".")
        role = f.get("role", "string")
        d: dict = {
            "role": "system" if role == "developer" else role,
            "content": _content(m.get("content"), f"{where}.content"),
        }
        for key in ("name", "tool_call_id", "reasoning_content"):
            if f.get(key, "string") is not None:
                d[key] = m[key]
        calls = f.get("tool_calls", "array")
        if calls is not None:
            for j, call in enumerate(calls):
                if not isinstance(call, dict):
                    raise FieldTypeError(f"{where}.tool_calls[{j}]: must be object, got {json_type(call)}")
                c = Fields(call, f"{where}.tool_calls[{j}].")
                c.get("id", "string")
                fn = Fields(c.get("function", "object", default={}), f"{where}.tool_calls[{j}].function.")
                fn.get("name", "string")
                fn.get("arguments", "string", "object")
            d["tool_calls"] = calls
        out.append(d)
    return out


def parse_chat(body: dict, config: GatewayConfig) -> ChatParams:
    f = Fields(body)
    _refuse_unsupported(f)
    if f.get("logprobs", "boolean", default=False):
        raise Invalid("logprobs: not supported")
    fmt = f.get("response_format", "object")
    if fmt is not None and fmt.get("type") != "text":
        raise Invalid(f"response_format.type: {fmt.get('type')!r} is not supported (text only)")
    tool_choice = f.get("tool_choice", "string", "object", default="auto")
    if isinstance(tool_choice, dict) or tool_choice not in ("auto", "none"):
        shown = "a named tool" if isinstance(tool_choice, dict) else repr(tool_choice)
        raise Invalid(f"tool_choice: {shown} is not supported (auto | none)")
    stream, include_usage = _stream_flags(f)
    return ChatParams(
        model=f.get("model", "string"),
        messages=_messages(body.get("messages")),
        options=_options(f, config),
        tools=f.get("tools", "array"),
        tool_choice=tool_choice,
        chat_template_kwargs=f.get("chat_template_kwargs", "object"),
        separate_reasoning=f.get("separate_reasoning", "boolean", default=True),
        stream=stream,
        include_usage=include_usage,
    )


def parse_completion(body: dict, config: GatewayConfig) -> CompletionParams:
    f = Fields(body)
    _refuse_unsupported(f)
    if f.get("logprobs", "integer"):
        raise Invalid("logprobs: not supported")
    if f.get("echo", "boolean", default=False):
        raise Invalid("echo: not supported")
    if f.get("suffix", "string"):
        raise Invalid("suffix: not supported")
    if f.get("best_of", "integer", default=1) != 1:
        raise Invalid("best_of: only 1 is supported")
    prompt = body.get("prompt")
    if prompt is None:
        raise Invalid("prompt: is required")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise Invalid(f"prompt: one prompt per request is supported, got {len(prompt)}")
        prompt = prompt[0]
    if isinstance(prompt, list):
        for i, t in enumerate(prompt):
            if not isinstance(t, int) or isinstance(t, bool):
                raise FieldTypeError(f"prompt[{i}]: must be integer (a token id), got {json_type(t)}")
            if not 0 <= t <= INT32_MAX:
                raise Invalid(f"prompt[{i}]: token id {t} is outside the vocabulary")
    elif not isinstance(prompt, str):
        raise FieldTypeError(f"prompt: must be string or array of token ids, got {json_type(prompt)}")
    stream, include_usage = _stream_flags(f)
    return CompletionParams(
        model=f.get("model", "string"),
        prompt=prompt,
        options=_options(f, config),
        stream=stream,
        include_usage=include_usage,
    )


# -- responses -------------------------------------------------------------------------------------------
def usage_json(u: common_pb2.Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


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
    """OpenAI stream chunks of one answer: start(), then events(chunk) per GenerateChunk."""

    def __init__(self, rid: str, model: str, created: int, include_usage: bool, obj: str):
        self.rid, self.model, self.created, self.include_usage, self.obj = rid, model, created, include_usage, obj

    def _chunk(self, choices: list, **extra) -> dict:
        return {
            "id": self.rid,
            "object": self.obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def _final(self, choice: dict, c: gateway_pb2.GenerateChunk) -> list[dict]:
        out = [self._chunk([choice], spec=spec_json(c.usage))]
        if self.include_usage:
            out.append(self._chunk([], usage=usage_json(c.usage)))
        return out


class ChatStream(EventStream):
    """chat.completion.chunk events in OpenAI order: role; content / reasoning_content deltas; tool
    calls (id + name first, then argument fragments); finish_reason (+ spec); usage; (then [DONE])."""

    def __init__(self, rid: str, model: str, created: int, include_usage: bool):
        super().__init__(rid, model, created, include_usage, "chat.completion.chunk")

    def _delta(self, delta: dict, finish_reason: str | None = None) -> dict:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def start(self) -> list[dict]:
        return [self._chunk([self._delta({"role": "assistant", "content": ""})])]

    def events(self, c: gateway_pb2.GenerateChunk) -> list[dict]:
        out = []
        delta = {}
        if c.reasoning_delta:  # both names: vLLM's current clients read `reasoning`, older ones `reasoning_content`
            delta["reasoning"] = delta["reasoning_content"] = c.reasoning_delta
        if c.text_delta:
            delta["content"] = c.text_delta
        if delta:
            out.append(self._chunk([self._delta(delta)]))
        for d in c.tool_calls:
            if d.id:
                call = {"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
            else:
                call = {"index": d.index, "function": {"arguments": d.arguments_delta}}
            out.append(self._chunk([self._delta({"tool_calls": [call]})]))
            if d.id and d.arguments_delta:
                out.append(
                    self._chunk(
                        [
                            self._delta(
                                {"tool_calls": [{"index": d.index, "function": {"arguments": d.arguments_delta}}]}
                            )
                        ]
                    )
                )
        if c.finish_reason:
            out += self._final(self._delta({}, c.finish_reason), c)
        return out


class CompletionStream(EventStream):
    """text_completion events: text deltas; finish_reason (+ spec); usage; (then [DONE])."""

    def __init__(self, rid: str, model: str, created: int, include_usage: bool):
        super().__init__(rid, model, created, include_usage, "text_completion")

    def _choice(self, text: str, finish_reason: str | None = None) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def start(self) -> list[dict]:
        return []

    def events(self, c: gateway_pb2.GenerateChunk) -> list[dict]:
        out = []
        if c.text_delta:
            out.append(self._chunk([self._choice(c.text_delta)]))
        if c.finish_reason:
            out += self._final(self._choice("", c.finish_reason), c)
        return out


def chat_response(rid: str, model: str, created: int, r: Result) -> dict:
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
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": r.finish_reason}],
        "usage": usage_json(r.usage),
        "spec": spec_json(r.usage),
    }


def completion_response(rid: str, model: str, created: int, r: Result) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": r.text, "logprobs": None, "finish_reason": r.finish_reason}],
        "usage": usage_json(r.usage),
        "spec": spec_json(r.usage),
    }

"""OpenAI's Responses API (`POST /v1/responses`): text and function tools, streamed or not, over the same
request path as chat (`Pipeline.chat_job`, `Generation`, http_response.py's runner).

- Request: `input` (a string, or items: messages {role user / assistant / system / developer, content a
  string or input_text / output_text parts}, `function_call` {call_id, name, arguments} and
  `function_call_output` {call_id, output}), `instructions` (a system message first), `tools` (function
  tools {name, description, parameters, strict}), `tool_choice` (auto / none / required / {type:
  function, name}), `parallel_tool_calls`, `max_output_tokens`, `temperature`, `top_p`, `stream`, `user`,
  `model`, vLLM's `ignore_eos`, `stop`, `top_k`, `seed`, and at their neutral values `store: false`,
  `text: {format: {type: text}}`, `truncation: disabled`; any other field or item type is a 400 naming
  it. Nothing is stored: `previous_response_id` is refused.
- Answer: a `response` object whose `output` holds the reasoning item (when the model reasoned), the
  message item (output_text) and one `function_call` item per call; status `incomplete` (reason
  max_output_tokens) when the answer hit the limit. Usage as input / output tokens (cached_tokens).
- Stream: `event: TYPE` + `data: {json}` with a sequence_number: response.created, response.in_progress,
  per item output_item.added, its deltas (reasoning_text / output_text with content_part.added and
  .done, function_call_arguments), output_item.done, then response.completed (or `error` after a
  failure).
"""

from __future__ import annotations

import json
from typing import Any

from ddtree.contract.request_params import INT32_MAX, RESPONSES, copy_value, for_api
from ddtree.gateway.api.openai_models import json_type
from ddtree.gateway.api.openai_responses import sum_usage
from ddtree.gateway.errors import Invalid
from ddtree.gateway.generation import Result
from ddtree.protocol.ddtree.v1 import common_pb2, gateway_pb2

FIELDS = {
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
    "stream", "user", "store", "text", "truncation", "metadata", "stop",
    *(p.name for p in for_api(RESPONSES)),  # temperature, top_p; vLLM's ignore_eos, top_k, seed (guidellm's)
}  # fmt: skip
_JSON = {bool: ((bool,), "boolean"), int: ((int,), "integer"), float: ((int, float), "number")}
NEUTRAL = {"store": (False,), "truncation": ("disabled",)}


def _typed(body: dict, key: str, kinds: tuple, what: str) -> Any:
    value = body.get(key)
    if value is not None and (not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds):
        raise Invalid(f"{key}: must be {what}, got {json_type(value)}")
    return value


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise Invalid(f"{where}: must be string or array of content parts, got {json_type(content)}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            raise Invalid(f"{where}[{j}].type: only input_text / output_text parts are supported (text only)")
        if not isinstance(part.get("text"), str):
            raise Invalid(f"{where}[{j}].text: must be string")
        texts.append(part["text"])
    return "\n".join(texts)


def _messages(body: dict) -> list[dict]:
    messages: list[dict] = []
    instructions = _typed(body, "instructions", (str,), "string")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise Invalid("input: must be a string or a non-empty array of items")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise Invalid(f"{where}: must be object, got {json_type(item)}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise Invalid(f"{where}.role: must be user, assistant, system or developer, got {role!r}")
            role = "system" if role == "developer" else role
            messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function"}
            call["function"] = {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)  # consecutive calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
        else:
            raise Invalid(
                f"{where}.type: {kind!r} items are not supported (message, function_call, function_call_output)"
            )
    return messages


def _tools(body: dict) -> list[dict] | None:
    tools = _typed(body, "tools", (list,), "array")
    out = []
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise Invalid(f"tools[{i}].type: only function tools are supported")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(body: dict) -> str:
    choice = body.get("tool_choice")
    if choice is None:
        return "auto"
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return f"function:{choice['name']}"
    if choice not in ("auto", "none", "required"):
        raise Invalid('tool_choice: must be auto, none, required or {"type": "function", "name": NAME}')
    return choice


def parse_responses(body: dict, max_tokens_limit: int | None) -> dict:
    """The pipeline's chat inputs of a Responses request: messages, options, tools, tool_choice,
    parallel_tool_calls, stream, model, user. Invalid naming the field."""
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise Invalid(f"{unknown[0]}: not supported on /v1/responses")
    for key, neutral in NEUTRAL.items():
        if key in body and body[key] not in (None, *neutral):
            raise Invalid(f"{key}: only {neutral[0]!r} (nothing is stored or truncated)")
    text = _typed(body, "text", (dict,), "object") or {}
    if (text.get("format") or {"type": "text"}).get("type") != "text" or set(text) - {"format"}:
        raise Invalid("text.format: only {'type': 'text'} (use /v1/chat/completions for structured outputs)")
    options = gateway_pb2.GenerationOptions()
    max_tokens = _typed(body, "max_output_tokens", (int,), "integer")
    if max_tokens is not None:
        limit = max_tokens_limit or INT32_MAX  # the verifier's (Pipeline.max_tokens_limit)
        if not 1 <= max_tokens <= limit:
            raise Invalid(f"max_output_tokens: must be in [1, {limit}], got {max_tokens}")
        options.max_tokens = max_tokens
    for p in for_api(RESPONSES):  # temperature, top_p, top_k, seed, ignore_eos: checked by the parameter table
        copy_value(options, p.name, _typed(body, p.name, *_JSON[p.kind]), Invalid)
    stop = _typed(body, "stop", (str, list), "string or array of strings")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not all(isinstance(s, str) for s in stop):
        raise Invalid("stop: must be string or array of strings")
    options.stop.extend(stop)
    return {
        "messages": _messages(body),
        "options": options,
        "tools": _tools(body),
        "tool_choice": _tool_choice(body),
        "parallel_tool_calls": _typed(body, "parallel_tool_calls", (bool,), "boolean") is not False,
        "stream": bool(_typed(body, "stream", (bool,), "boolean")),
        "model": _typed(body, "model", (str,), "string"),
        "user": _typed(body, "user", (str,), "string"),
    }


# -- answers -------------------------------------------------------------------------------------------------
def _usage(u: common_pb2.Usage) -> dict:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def _reasoning_item(rid: str, text: str, status: str = "completed") -> dict:
    return {
        "type": "reasoning",
        "id": f"rs_{rid}",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def _message_item(rid: str, text: str, status: str = "completed") -> dict:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {"type": "message", "id": f"msg_{rid}", "status": status, "role": "assistant", "content": content}


def _call_item(rid: str, index: int, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": f"fc_{rid}_{index}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def response_object(rid: str, model: str, created: int, status: str, output: list, usage: dict | None) -> dict:
    return {
        "id": f"resp_{rid}",
        "object": "response",
        "created_at": created,
        "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "error": None,
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": usage,
    }


def _status(finish_reason: str) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def responses_answer(rid: str, model: str, created: int, results: list[Result], strings=None) -> dict:
    r = results[0]
    output = [_reasoning_item(rid, r.reasoning)] if r.reasoning else []
    if r.text or not r.tool_calls:
        output.append(_message_item(rid, r.text))
    output += [_call_item(rid, i, c.id, c.name, c.arguments) for i, c in enumerate(r.tool_calls)]
    return response_object(rid, model, created, _status(r.finish_reason), output, _usage(sum_usage([r.usage])))


class ResponsesStream:
    """The Responses API's events of one generation (start(), then events((index, chunk)) per chunk)."""

    def __init__(self, rid: str, model: str, created: int):
        self.rid, self.model, self.created = rid, model, created
        self._seq = 0
        self._items: list[dict] = []  # output items so far, in order
        self._open: dict | None = None  # the reasoning or message item receiving deltas
        self._calls: dict[int, dict] = {}  # tool call index -> its item

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _response(self, status: str, usage: dict | None = None) -> dict:
        return response_object(self.rid, self.model, self.created, status, list(self._items), usage)

    def start(self) -> list[dict]:
        return [
            self._event("response.created", response=self._response("in_progress")),
            self._event("response.in_progress", response=self._response("in_progress")),
        ]

    def _close_open(self) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self._items.index(item)
        text = item.pop("_text")
        if item["type"] == "reasoning":
            item.update(content=[{"type": "reasoning_text", "text": text}], status="completed")
            done = [self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=text)]  # fmt: skip
        else:
            part = {"type": "output_text", "text": text, "annotations": []}
            item.update(content=[part], status="completed")
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            done = [
                self._event("response.output_text.done", text=text, logprobs=[], **where),
                self._event("response.content_part.done", part=part, **where),
            ]
        return [*done, self._event("response.output_item.done", output_index=index, item=item)]

    def _delta(self, kind: str, delta: str) -> list[dict]:
        out = []
        if self._open is None or self._open["type"] != kind:
            out += self._close_open()
            item = _reasoning_item(self.rid, "", "in_progress") if kind == "reasoning" else None
            item = item or _message_item(self.rid, "", "in_progress")
            item["content"], item["_text"] = [], ""
            self._items.append(item)
            self._open = item
            index = len(self._items) - 1
            shown = {k: v for k, v in item.items() if k != "_text"}
            out.append(self._event("response.output_item.added", output_index=index, item=shown))
            if kind == "message":
                part = {"type": "output_text", "text": "", "annotations": []}
                out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                       content_index=0, part=part))  # fmt: skip
        item, index = self._open, self._items.index(self._open)
        item["_text"] += delta
        kind_name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        out.append(
            self._event(kind_name, item_id=item["id"], output_index=index, content_index=0, delta=delta, **extra)
        )
        return out

    def events(self, item: tuple[int, gateway_pb2.GenerateChunk]) -> list[dict]:
        _, c = item
        out = []
        if c.reasoning_delta:
            out += self._delta("reasoning", c.reasoning_delta)
        if c.text_delta:
            out += self._delta("message", c.text_delta)
        for d in c.tool_calls:
            if d.id:
                out += self._close_open()
                call = _call_item(self.rid, len(self._calls), d.id, d.name, "", "in_progress")
                self._calls[d.index] = call
                self._items.append(call)
                out.append(
                    self._event("response.output_item.added", output_index=len(self._items) - 1, item=dict(call))
                )
            call = self._calls.get(d.index)
            if call is not None and d.arguments_delta:
                call["arguments"] += d.arguments_delta
                out.append(self._event("response.function_call_arguments.delta", item_id=call["id"],
                                       output_index=self._items.index(call), delta=d.arguments_delta))  # fmt: skip
        if c.finish_reason:
            out += self._close_open()
            for call in self._calls.values():
                index = self._items.index(call)
                call["status"] = "completed"
                out.append(self._event("response.function_call_arguments.done", item_id=call["id"], output_index=index,
                                       arguments=call["arguments"], name=call["name"]))  # fmt: skip
                out.append(self._event("response.output_item.done", output_index=index, item=dict(call)))
            if not self._items:
                self._items.append(_message_item(self.rid, ""))
            status = _status(c.finish_reason)
            kind = "response.completed" if status == "completed" else "response.incomplete"
            out.append(self._event(kind, response=self._response(status, _usage(c.usage))))
        return out

    def failed(self) -> list[dict]:
        return []

    def error(self, status: int, message: str) -> dict:
        return self._event("error", code=str(status), message=message, param=None)


def encode(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()

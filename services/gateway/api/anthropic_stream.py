"""Anthropic Messages answers from the pipeline's output (`Result`, `GenerateChunk`s): one `message` object,
or the server-sent event sequence Anthropic streams.

- Content blocks: `thinking` (the reasoning parser's text; `signature` is "", this server signs
  nothing), `text`, then one `tool_use` per parsed tool call (id = the model's `functions.NAME:IDX`,
  input = its JSON arguments; arguments that are not a JSON object, e.g. cut by max_tokens, give
  input {} in the whole answer, while a stream has already sent them as they came).
- stop_reason: end_turn (end of turn token), max_tokens, stop_sequence (with the stop_sequence that
  matched: the earliest in the output, as the stop matcher cut it), tool_use (the answer called tools).
- usage: input_tokens (prompt tokens) and output_tokens (the verifier's completion_tokens: generated
  tokens, the stop token not counted), plus `spec`, the speculative statistics the OpenAI routes report.
- Stream: message_start (usage with input_tokens), ping, then per block content_block_start,
  content_block_delta (text_delta / thinking_delta / input_json_delta) and content_block_stop,
  then message_delta (stop_reason, stop_sequence, usage) and message_stop. A failure after the
  stream started is an `error` event.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from ddtree.gateway.api.openai_responses import spec_json
from ddtree.gateway.generation import Result
from ddtree.gateway.parsers import find_first
from ddtree.protocol.ddtree.v1 import common_pb2, gateway_pb2

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
StopOf = Callable[[str, list[int]], tuple[str, str | None]]


def error_json(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def stop_reason(
    finish_reason: str,
    token_ids: list[int],
    stop_strings: tuple[str, ...],
    stop_ids: frozenset[int],
    decode: Callable[[list[int], bool], str],
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence). The generation reports "stop" for an end token and for a stop
    string alike; the stop string is found again in the decoded output (the earliest, as the matcher
    cuts), with special tokens rendered, then skipped (as the text may have been matched)."""
    if finish_reason == "stop" and stop_strings:
        ids = token_ids[:-1] if token_ids and token_ids[-1] in stop_ids else token_ids
        for skip_special in (False, True):
            _, found = find_first(decode(ids, skip_special), stop_strings)
            if found is not None:
                return "stop_sequence", found
    return STOP_REASONS.get(finish_reason, "end_turn"), None


def usage_json(u: common_pb2.Usage) -> dict:
    return {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens}


def tool_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message_response(mid: str, model: str, r: Result, stop: tuple[str, str | None]) -> dict:
    content: list[dict] = []
    if r.reasoning:
        content.append({"type": "thinking", "thinking": r.reasoning, "signature": ""})
    if r.text:
        content.append({"type": "text", "text": r.text})
    for c in r.tool_calls:
        content.append({"type": "tool_use", "id": c.id, "name": c.name, "input": tool_input(c.arguments)})
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": usage_json(r.usage),
        "spec": spec_json(r.usage),
    }


class MessageStream:
    """The event dicts of one streamed answer: start(), then events(chunk) per GenerateChunk. Blocks
    open when their first delta arrives and close when a block of another kind (or another tool call)
    starts, or at the end."""

    def __init__(self, mid: str, model: str, input_tokens: int, stop_of: StopOf):
        self.mid, self.model, self.input_tokens, self.stop_of = mid, model, input_tokens, stop_of
        self._open: tuple | None = None  # ("text" | "thinking" | ("tool_use", call index)), its block index
        self._blocks = 0
        self._ids: list[int] = []

    def start(self) -> list[dict]:
        message = {
            "id": self.mid,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        }
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        index, self._open = self._open[1], None
        return [{"type": "content_block_stop", "index": index}]

    def _block(self, key, block: dict) -> list[dict]:
        """Events that make `key` the open block (nothing when it already is)."""
        if self._open is not None and self._open[0] == key:
            return []
        out = self._close()
        self._open = (key, self._blocks)
        out.append({"type": "content_block_start", "index": self._blocks, "content_block": block})
        self._blocks += 1
        return out

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self._open[1], "delta": delta}

    def events(self, c: gateway_pb2.GenerateChunk) -> list[dict]:
        out: list[dict] = []
        self._ids += c.token_ids
        if c.reasoning_delta:
            out += self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": c.reasoning_delta}))
        if c.text_delta:
            out += self._block("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": c.text_delta}))
        for d in c.tool_calls:
            if d.id:
                out += self._block(("tool_use", d.index), {"type": "tool_use", "id": d.id, "name": d.name, "input": {}})
            # The tool parsers finish one call before they announce the next: a fragment is the open call's.
            if d.arguments_delta and self._open is not None and self._open[0] == ("tool_use", d.index):
                out.append(self._delta({"type": "input_json_delta", "partial_json": d.arguments_delta}))
        if c.finish_reason:
            out += self._close()
            reason, sequence = self.stop_of(c.finish_reason, self._ids)
            out.append(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage_json(c.usage),
                    "spec": spec_json(c.usage),
                }
            )
            out.append({"type": "message_stop"})
        return out

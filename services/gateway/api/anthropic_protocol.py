"""Anthropic Messages requests (`POST /v1/messages`, `/v1/messages/count_tokens`) as the pipeline's chat
inputs, independent of the web framework; `anthropic_stream.py` formats the answers.

Every field is implemented or refused with a 400 naming it (`Invalid`), nothing is accepted and ignored:

- `system` (a string or text blocks) becomes the first message (system role); without it the template
  writes its default system prompt.
- `messages` (user / assistant turns, content a string or blocks):
  user `text` and `tool_result` {tool_use_id, content (string or text blocks), is_error}, each result a
  tool message (`is_error` prefixes its content with "Error: "), in block order; assistant `text`,
  `thinking` (the turn's reasoning_content; the signature is not checked, this server signs nothing) and
  `tool_use` {id, name, input} (a tool call, input as JSON arguments). A tool_result must answer a
  tool_use id of an earlier assistant turn. Refused: images, documents, redacted_thinking, server tools'
  blocks, and a final assistant turn (prefill: the template cannot continue an assistant message).
- `tools` {name, description, input_schema} become the template's tool declarations; server tools
  (typed `bash_...`, `web_search_...`) are refused. `tool_choice` auto | none (`none`: no
  tools declared, nothing parsed as a call) | any (OpenAI's `required`: 1 to 8 calls of the declared
  tools) | tool {name} (one call of that tool): any and tool are forced by the grammar of the Kimi K2
  tool-call section (structured_outputs.tool_grammar), each call's input valid for its input_schema;
  under auto a call can only name a declared tool, its input a JSON object (valid for input_schema when
  the tool is `strict`). `disable_parallel_tool_use`: at most one tool_use.
- `thinking` {type: enabled, budget_tokens} | {type: adaptive} | {type: disabled} is the Kimi template's
  thinking switch (absent: the template's default, thinking on). `budget_tokens` is checked as Anthropic
  checks it (>= 1024, < max_tokens) but bounds nothing: thinking ends when the model closes it or at
  max_tokens.
- `max_tokens` (required), `temperature` (>= 0), `top_p` (0, 1], `top_k` (0 or vLLM's -1 = off), `stop_sequences`,
  `stream`; `metadata.user_id` goes to the request log; `service_tier` auto | standard_only (one tier).
- `cache_control` on any block or tool is accepted: the verifier's prefix cache reuses every common
  prompt prefix without being asked.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ddtree.contract.request_params import ANTHROPIC, INT32_MAX, copy_value, for_api
from ddtree.gateway.errors import Invalid
from ddtree.gateway.pipeline import MAX_STOP_CHARS, MAX_STOP_STRINGS
from ddtree.protocol.ddtree.v1 import gateway_pb2
from ddtree.tokenization.chat_template import MAX_NAME_CHARS, MAX_TOOL_CALLS, validate_tools

COMMON_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking"}
MESSAGES_FIELDS = COMMON_FIELDS | {
    "max_tokens",
    *(p.name for p in for_api(ANTHROPIC)),
    "stop_sequences",
    "stream",
    "metadata",
    "service_tier",
}
# Fields of the Anthropic API this server refuses, with the reason the 400 gives.
REFUSED = {
    "container": "code-execution containers are not available",
    "mcp_servers": "MCP servers are not available",
    "context_management": "context management is not available",
    "output_config": "output formats and effort are not available (the OpenAI routes take response_format)",
    "output_format": "output formats are not available (the OpenAI routes take response_format)",
    "inference_geo": "this server's location is fixed",
    "speed": "one speed: DDTree speculative decoding",
}
BLOCK_FIELDS = {
    "text": {"text", "citations"},
    "tool_result": {"tool_use_id", "content", "is_error"},
    "thinking": {"thinking", "signature"},
    "tool_use": {"id", "name", "input"},
}
USER_BLOCKS, ASSISTANT_BLOCKS = ("text", "tool_result"), ("text", "thinking", "tool_use")
MIN_THINKING_BUDGET = 1024
MAX_USER_ID_CHARS = 256


@dataclasses.dataclass
class MessagesParams:
    """A parsed Messages request, as `Pipeline.chat_job` takes it."""

    model: str | None
    messages: list[dict]  # OpenAI-style dicts (chat_template.py)
    tools: list[dict] | None  # OpenAI-style declarations
    tool_choice: str  # auto | none | required (any) | function:NAME (tool), as Pipeline.chat_job takes it
    chat_template_kwargs: dict
    options: gateway_pb2.GenerationOptions
    stream: bool = False
    user_id: str | None = None
    parallel_tool_calls: bool = True  # false: tool_choice.disable_parallel_tool_use (at most one tool_use)


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def _typed(obj: dict, key: str, where: str, kind: str, required: bool = False) -> Any:
    """obj[key] checked to be of JSON `kind` (string, integer, number, boolean, array, object)."""
    value = obj.get(key)
    if value is None:
        if required:
            raise Invalid(f"{where}{key}: is required")
        return None
    ok = {
        "string": isinstance(value, str),
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
        "array": isinstance(value, list),
        "object": isinstance(value, dict),
    }[kind]
    if not ok:
        raise Invalid(f"{where}{key}: must be {'an' if kind[0] in 'aeiou' else 'a'} {kind}, got {json_type(value)}")
    return value


def _only(obj: dict, allowed: set[str], where: str, what: str) -> None:
    """Refuse a key outside `allowed` (cache_control, an object, is allowed everywhere)."""
    _typed(obj, "cache_control", where, "object")
    extra = sorted(set(obj) - allowed - {"cache_control"})
    if extra:
        key = extra[0]
        reason = REFUSED.get(key) if not where else None
        fields = ", ".join(sorted(allowed - {"type"}))
        why = f"not supported ({reason})" if reason else f"not supported in {what} (fields: {fields})"
        raise Invalid(f"{where}{key}: {why}")


def _object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise Invalid(f"{where}: must be an object, got {json_type(value)}")
    return value


def _blocks(value: Any, where: str) -> list[dict]:
    """Content as a list of typed blocks (a string is one text block)."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise Invalid(f"{where}: must be a string or an array of content blocks, got {json_type(value)}")
    if not value:
        raise Invalid(f"{where}: must not be an empty array")
    out = []
    for j, block in enumerate(value):
        at = f"{where}[{j}]"
        block = _object(block, at)
        kind = _typed(block, "type", at + ".", "string", required=True)
        if kind not in BLOCK_FIELDS:
            raise Invalid(f"{at}.type: {kind!r} blocks are not supported (text, tool_result, thinking, tool_use)")
        _only(block, BLOCK_FIELDS[kind] | {"type"}, at + ".", f"a {kind} block")
        if kind == "text":
            _typed(block, "text", at + ".", "string", required=True)
            if block.get("citations"):
                raise Invalid(f"{at}.citations: not supported")
        out.append(block)
    return out


def _text_only(value: Any, where: str) -> str:
    """A string, or text blocks joined with newlines (system prompt, tool results)."""
    parts = []
    for j, block in enumerate(_blocks(value, where)):
        if block["type"] != "text":
            raise Invalid(f"{where}[{j}].type: must be 'text' here, got {block['type']!r}")
        parts.append(block["text"])
    return "\n".join(parts)


def _user_turn(blocks: list[dict], where: str, known_ids: set[str]) -> list[dict]:
    out, texts = [], []
    for j, b in enumerate(blocks):
        at = f"{where}[{j}]"
        if b["type"] not in USER_BLOCKS:
            raise Invalid(f"{at}.type: {b['type']!r} blocks belong to assistant turns")
        if b["type"] == "text":
            texts.append(b["text"])
            continue
        if texts:
            out.append({"role": "user", "content": "\n".join(texts)})
            texts = []
        call_id = _typed(b, "tool_use_id", at + ".", "string", required=True)
        if call_id not in known_ids:
            raise Invalid(f"{at}.tool_use_id: {call_id!r} answers no tool_use of an earlier assistant turn")
        raw = b.get("content")
        content = "" if raw is None or raw == [] else _text_only(raw, at + ".content")
        if _typed(b, "is_error", at + ".", "boolean"):
            content = "Error: " + content
        out.append({"role": "tool", "tool_call_id": call_id, "content": content})
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant_turn(blocks: list[dict], where: str, known_ids: set[str]) -> dict:
    texts, thoughts, calls = [], [], []
    for j, b in enumerate(blocks):
        at = f"{where}[{j}]"
        if b["type"] not in ASSISTANT_BLOCKS:
            raise Invalid(f"{at}.type: {b['type']!r} blocks belong to user turns")
        if b["type"] == "text":
            texts.append(b["text"])
        elif b["type"] == "thinking":
            thoughts.append(_typed(b, "thinking", at + ".", "string", required=True))
            _typed(b, "signature", at + ".", "string")
        else:
            call_id = _typed(b, "id", at + ".", "string", required=True)
            if not call_id or len(call_id) > MAX_NAME_CHARS:
                raise Invalid(f"{at}.id: must be 1 to {MAX_NAME_CHARS} characters, got {len(call_id)}")
            name = _typed(b, "name", at + ".", "string", required=True)
            if not name:
                raise Invalid(f"{at}.name: must not be empty")
            args = _typed(b, "input", at + ".", "object", required=True)
            known_ids.add(call_id)
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
                }
            )
    if len(calls) > MAX_TOOL_CALLS:
        raise Invalid(f"{where}: at most {MAX_TOOL_CALLS} tool_use blocks per turn, got {len(calls)}")
    m: dict = {"role": "assistant", "content": "\n".join(texts)}
    if thoughts:
        m["reasoning_content"] = "\n".join(thoughts)
    if calls:
        m["tool_calls"] = calls
    return m


def _messages(body: dict) -> list[dict]:
    out = []
    system = body.get("system")
    if system is not None and system != []:
        out.append({"role": "system", "content": _text_only(system, "system")})
    turns = _typed(body, "messages", "", "array", required=True)
    if not turns:
        raise Invalid("messages: must not be empty")
    known_ids: set[str] = set()
    for i, m in enumerate(turns):
        where = f"messages[{i}]"
        m = _object(m, where)
        _only(m, {"role", "content"}, where + ".", "a message")
        role = _typed(m, "role", where + ".", "string", required=True)
        if role not in ("user", "assistant"):
            raise Invalid(f"{where}.role: must be 'user' or 'assistant', got {role!r} (the system prompt is `system`)")
        if m.get("content") is None:
            raise Invalid(f"{where}.content: is required")
        blocks = _blocks(m["content"], where + ".content")
        if role == "user":
            out += _user_turn(blocks, where + ".content", known_ids)
        else:
            out.append(_assistant_turn(blocks, where + ".content", known_ids))
    if turns[-1].get("role") == "assistant":
        raise Invalid(
            f"messages[{len(turns) - 1}]: a final assistant turn (prefill) is not supported; end with a user turn"
        )
    return out


def _tools(body: dict) -> list[dict] | None:
    tools = _typed(body, "tools", "", "array")
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        t = _object(t, where)
        kind = _typed(t, "type", where + ".", "string")
        if kind not in (None, "custom"):
            raise Invalid(f"{where}.type: server tool {kind!r} is not supported (custom tools only)")
        strict = _typed(t, "strict", where + ".", "boolean")
        _only(t, {"type", "name", "description", "input_schema", "strict"}, where + ".", "a tool")
        fn = {"name": _typed(t, "name", where + ".", "string", required=True)}
        if t.get("description") is not None:
            fn["description"] = _typed(t, "description", where + ".", "string")
        fn["parameters"] = _typed(t, "input_schema", where + ".", "object", required=True)
        if strict:
            fn["strict"] = True  # the input follows input_schema under tool_choice auto too
        out.append({"type": "function", "function": fn})
    try:
        validate_tools(out)  # names and schemas, here so that errors name the Anthropic fields
    except ValueError as e:
        raise Invalid(str(e).replace(".function.parameters", ".input_schema").replace(".function.", ".")) from None
    return out or None


def _tool_choice(body: dict) -> str:
    choice = _typed(body, "tool_choice", "", "object")
    if choice is None:
        return "auto"
    kind = _typed(choice, "type", "tool_choice.", "string", required=True)
    if kind not in ("auto", "none", "any", "tool"):
        raise Invalid(f"tool_choice.type: must be auto, none, any or tool, got {kind!r}")
    _only(
        choice,
        {"type", "disable_parallel_tool_use", *(("name",) if kind == "tool" else ())},
        "tool_choice.",
        "tool_choice",
    )
    _typed(choice, "disable_parallel_tool_use", "tool_choice.", "boolean")  # read by _parallel_tool_use
    if kind in ("any", "tool") and not body.get("tools"):
        raise Invalid(f"tool_choice.type: {kind!r} needs tools")
    if kind == "any":
        return "required"  # the pipeline's forced tool-call section (structured_outputs.tool_grammar)
    if kind == "tool":
        name = _typed(choice, "name", "tool_choice.", "string", required=True)
        declared = [t.get("name") for t in body["tools"] if isinstance(t, dict)]
        if name not in declared:
            raise Invalid(f"tool_choice.name: no declared tool is named {name!r}")
        return f"function:{name}"
    return kind


def _parallel_tool_use(body: dict) -> bool:
    choice = body.get("tool_choice")
    return not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True)


def _thinking(body: dict, max_tokens: int | None) -> dict:
    thinking = _typed(body, "thinking", "", "object")
    if thinking is None:
        return {}
    kind = _typed(thinking, "type", "thinking.", "string", required=True)
    if kind == "disabled":
        _only(thinking, {"type"}, "thinking.", "thinking")
        return {"thinking": False}
    if kind == "adaptive":
        _only(thinking, {"type"}, "thinking.", "thinking")
        return {"thinking": True}
    if kind != "enabled":
        raise Invalid(f"thinking.type: must be enabled, adaptive or disabled, got {kind!r}")
    _only(thinking, {"type", "budget_tokens"}, "thinking.", "thinking")
    budget = _typed(thinking, "budget_tokens", "thinking.", "integer", required=True)
    if budget < MIN_THINKING_BUDGET:
        raise Invalid(f"thinking.budget_tokens: must be >= {MIN_THINKING_BUDGET}, got {budget}")
    if max_tokens is not None and budget >= max_tokens:
        raise Invalid(f"thinking.budget_tokens: must be less than max_tokens ({max_tokens}), got {budget}")
    return {"thinking": True}


def _options(body: dict, max_tokens_limit: int | None) -> gateway_pb2.GenerationOptions:
    o = gateway_pb2.GenerationOptions()
    max_tokens = _typed(body, "max_tokens", "", "integer", required=True)
    limit = max_tokens_limit or INT32_MAX  # the verifier's (Pipeline.max_tokens_limit)
    if not 1 <= max_tokens <= limit:
        raise Invalid(f"max_tokens: must be in [1, {limit}], got {max_tokens}")
    o.max_tokens = max_tokens
    for p in for_api(ANTHROPIC):  # temperature, top_p, top_k: checked by the parameter table
        copy_value(o, p.name, _typed(body, p.name, "", "integer" if p.kind is int else "number"), Invalid)
    stops = _typed(body, "stop_sequences", "", "array") or []
    if len(stops) > MAX_STOP_STRINGS:
        raise Invalid(f"stop_sequences: at most {MAX_STOP_STRINGS} stop sequences, got {len(stops)}")
    for i, s in enumerate(stops):
        if not isinstance(s, str):
            raise Invalid(f"stop_sequences[{i}]: must be a string, got {json_type(s)}")
        if not s or len(s) > MAX_STOP_CHARS:
            raise Invalid(f"stop_sequences[{i}]: must be 1 to {MAX_STOP_CHARS} characters, got {len(s)}")
    o.stop.extend(stops)
    return o


def parse_messages(body: dict, max_tokens_limit: int | None) -> MessagesParams:
    """A `POST /v1/messages` body; Invalid (400) naming the first bad field."""
    _only(body, MESSAGES_FIELDS, "", "a Messages request")
    options = _options(body, max_tokens_limit)
    metadata = _typed(body, "metadata", "", "object") or {}
    _only(metadata, {"user_id"}, "metadata.", "metadata")
    user_id = _typed(metadata, "user_id", "metadata.", "string")
    if user_id is not None and len(user_id) > MAX_USER_ID_CHARS:
        raise Invalid(f"metadata.user_id: at most {MAX_USER_ID_CHARS} characters, got {len(user_id)}")
    tier = _typed(body, "service_tier", "", "string")
    if tier not in (None, "auto", "standard_only"):
        raise Invalid(f"service_tier: must be auto or standard_only, got {tier!r}")
    return MessagesParams(
        model=_typed(body, "model", "", "string"),
        messages=_messages(body),
        tools=_tools(body),
        tool_choice=_tool_choice(body),
        chat_template_kwargs=_thinking(body, options.max_tokens),
        options=options,
        stream=bool(_typed(body, "stream", "", "boolean")),
        user_id=user_id,
        parallel_tool_calls=_parallel_tool_use(body),
    )


def parse_count_tokens(body: dict) -> MessagesParams:
    """A `POST /v1/messages/count_tokens` body (the prompt fields of a Messages request)."""
    _only(body, COMMON_FIELDS, "", "a count_tokens request")
    return MessagesParams(
        model=_typed(body, "model", "", "string"),
        messages=_messages(body),
        tools=_tools(body),
        tool_choice=_tool_choice(body),
        chat_template_kwargs=_thinking(body, None),
        options=gateway_pb2.GenerationOptions(max_tokens=1),
    )

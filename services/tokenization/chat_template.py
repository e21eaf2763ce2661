"""Chat templates: validate OpenAI-style messages and render them with a checkpoint's Jinja template.

Templates come from checkpoints, so they run in jinja2's ImmutableSandboxedEnvironment with the same
helpers Hugging Face provides (`tojson` without HTML escaping, `raise_exception`, loop controls).
Every problem with the input becomes a ValueError that names the message index and field, e.g.
`messages[2].content: must be a string, got int`.

Messages are dicts with `role` (system | user | assistant | tool), `content`, and optionally `name`,
`tool_call_id` (tool), `tool_calls` ([{id, type: "function", function: {name, arguments}}], assistant)
and `reasoning_content` (assistant). Tool-call ids that are not in Kimi's `functions.{name}:{idx}` form
(e.g. OpenAI's `call_...`) are rewritten to it, idx counting calls across the conversation, and the
tool results that refer to them follow, so the model sees the ids it was trained on.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ddtree.protocol.json_limits import load_json

ROLES = ("system", "user", "assistant", "tool")
RESERVED_KWARGS = ("messages", "tools", "add_generation_prompt")
KIMI_TOOL_CALL_ID = re.compile(r"^functions\.[\w.\-]+:\d+$")
# Names the tool-call parsers can read back (Kimi's `functions.NAME:IDX`): word characters, '.' and '-'.
TOOL_NAME = re.compile(r"[\w.\-]{1,64}")
SCHEMA_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
MAX_SCHEMA_DEPTH = 32
# Counts checked before rendering (a template's loops cost per item): OpenAI's own tool limit is 128.
MAX_MESSAGES = 4096
MAX_TOOLS = 128
MAX_TOOL_CALLS = 128  # per assistant message
MAX_NAME_CHARS = 256  # message names and tool-call ids


def _tojson(
    value: Any, indent: int | None = None, separators=None, sort_keys: bool = False, ensure_ascii: bool = False
) -> str:
    # Hugging Face's tojson: plain json.dumps (jinja's own escapes <, >, & and ').
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols"],
        undefined=jinja2.Undefined,
        autoescape=False,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env


_ENV = _environment()


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _check_str(value: Any, where: str, required: bool = False) -> None:
    if value is None:
        if required:
            raise ValueError(f"{where}: is required")
        return
    if not isinstance(value, str):
        raise ValueError(f"{where}: must be a string, got {_type_name(value)}")


def _check_length(value: str | None, where: str) -> None:
    if value is not None and len(value) > MAX_NAME_CHARS:
        raise ValueError(f"{where}: {len(value)} characters, over the limit of {MAX_NAME_CHARS}")


def text_chars(value: Any) -> int:
    """Characters in every string value of a parsed JSON value (not its keys), without recursion."""
    total, stack = 0, [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            total += len(node)
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return total


def _check_schema(schema: Any, where: str, depth: int = 0) -> None:
    """The parts of a JSON Schema a tool declaration relies on: type names, properties, items,
    required, enum. Anything else is passed to the template as given."""
    if not isinstance(schema, dict):
        raise ValueError(f"{where}: must be a JSON Schema object, got {_type_name(schema)}")
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"{where}: nested deeper than {MAX_SCHEMA_DEPTH} levels")
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        bad = [k for k in kinds if k not in SCHEMA_TYPES]
        if bad or not kinds:
            raise ValueError(
                f"{where}.type: must be one of {', '.join(SCHEMA_TYPES)} (or a list of them), got {kind!r}"
            )
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            raise ValueError(f"{where}.properties: must be an object, got {_type_name(props)}")
        for key, sub in props.items():
            _check_schema(sub, f"{where}.properties.{key}", depth + 1)
    if "items" in schema and not isinstance(schema["items"], bool):
        _check_schema(schema["items"], f"{where}.items", depth + 1)
    required = schema.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise ValueError(f"{where}.required: must be a list of property names, got {required!r}")
    if "enum" in schema and not isinstance(schema["enum"], list):
        raise ValueError(f"{where}.enum: must be a list, got {_type_name(schema['enum'])}")


def validate_tools(tools: Any) -> list[dict] | None:
    """OpenAI tool declarations: [{"type": "function", "function": {"name": str, "description": str,
    "parameters": JSON Schema}}, ...]. Names are 1-64 letters, digits, '_', '.' or '-'."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ValueError(f"tools: must be a list, got {_type_name(tools)}")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ValueError(f"{where}: must be an object, got {_type_name(tool)}")
        if tool.get("type", "function") != "function":
            raise ValueError(f"{where}.type: must be 'function', got {tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{where}.function: must be an object, got {_type_name(fn)}")
        _check_str(fn.get("name"), f"{where}.function.name", required=True)
        if not fn["name"]:
            raise ValueError(f"{where}.function.name: must not be empty")
        if not TOOL_NAME.fullmatch(fn["name"]):
            raise ValueError(f"{where}.function.name: {fn['name']!r} is not 1-64 letters, digits, '_', '.' or '-'")
        if fn["name"] in names:
            raise ValueError(f"{where}.function.name: {fn['name']!r} is declared twice")
        names.add(fn["name"])
        _check_str(fn.get("description"), f"{where}.function.description")
        if fn.get("parameters") is not None:
            _check_schema(fn["parameters"], f"{where}.function.parameters")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise ValueError(f"{where}.function.strict: must be true or false, got {fn['strict']!r}")
    return tools or None


def _validate_tool_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, list):
        raise ValueError(f"{where}: must be a list, got {_type_name(calls)}")
    if len(calls) > MAX_TOOL_CALLS:
        raise ValueError(f"{where}: at most {MAX_TOOL_CALLS} tool calls per message, got {len(calls)}")
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise ValueError(f"{at}: must be an object, got {_type_name(call)}")
        _check_str(call.get("id"), f"{at}.id")
        _check_length(call.get("id"), f"{at}.id")
        if call.get("type", "function") != "function":
            raise ValueError(f"{at}.type: must be 'function', got {call.get('type')!r}")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{at}.function: must be an object, got {_type_name(fn)}")
        _check_str(fn.get("name"), f"{at}.function.name", required=True)
        if not fn["name"]:
            raise ValueError(f"{at}.function.name: must not be empty")
        args = fn.get("arguments")
        if isinstance(args, str):
            load_json(args, f"{at}.function.arguments")  # raises JsonInputError (a ValueError) naming the field
        elif not isinstance(args, dict):
            raise ValueError(f"{at}.function.arguments: must be a JSON string or an object, got {_type_name(args)}")


def validate_messages(messages: Any) -> None:
    """Raise ValueError naming the first bad message and field."""
    if not isinstance(messages, list):
        raise ValueError(f"messages: must be a list, got {_type_name(messages)}")
    if not messages:
        raise ValueError("messages: must not be empty")
    if len(messages) > MAX_MESSAGES:
        raise ValueError(f"messages: at most {MAX_MESSAGES} messages, got {len(messages)}")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where}: must be an object, got {_type_name(m)}")
        role = m.get("role")
        if not role:
            raise ValueError(f"{where}.role: is required")
        if role not in ROLES:
            raise ValueError(f"{where}.role: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        for field in ("name", "reasoning_content", "tool_call_id"):
            _check_str(m.get(field), f"{where}.{field}")
        for field in ("name", "tool_call_id"):
            _check_length(m.get(field), f"{where}.{field}")
        has_calls = bool(m.get("tool_calls"))
        # Assistant turns that only call tools may omit content; every other message needs it.
        _check_str(m.get("content"), f"{where}.content", required=not (role == "assistant" and has_calls))
        if m.get("tool_calls") is not None and role != "assistant":
            raise ValueError(f"{where}.tool_calls: only assistant messages may have tool calls")
        if has_calls:
            _validate_tool_calls(m["tool_calls"], f"{where}.tool_calls")
        if m.get("reasoning_content") and role != "assistant":
            raise ValueError(f"{where}.reasoning_content: only assistant messages may have reasoning")
        if role == "tool" and not m.get("tool_call_id"):
            raise ValueError(f"{where}.tool_call_id: is required for tool messages")


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Copies of the messages with tool-call ids in Kimi's `functions.{name}:{idx}` form."""
    renamed: dict[str, str] = {}
    out: list[dict] = []
    idx = 0
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                call = dict(call, function=dict(call["function"]))
                old = call.get("id") or ""
                if not KIMI_TOOL_CALL_ID.match(old):
                    new = f"functions.{call['function']['name']}:{idx}"
                    if old:
                        renamed[old] = new
                    call["id"] = new
                call.setdefault("type", "function")
                calls.append(call)
                idx += 1
            m["tool_calls"] = calls
        if m.get("role") == "tool" and m.get("tool_call_id") in renamed:
            m["tool_call_id"] = renamed[m["tool_call_id"]]
        out.append(m)
    return out


class ChatTemplate:
    """A compiled chat template. `render` is thread-safe."""

    def __init__(self, source: str):
        self.source = source
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template: syntax error at line {e.lineno}: {e.message}") from None

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render; template variables come from `chat_template_kwargs` (a request's JSON object) and
        keyword arguments (e.g. thinking=False)."""
        validate_messages(messages)
        tools = validate_tools(tools)
        chat_template_kwargs = {**(chat_template_kwargs or {}), **kwargs}
        for key in chat_template_kwargs:
            if key in RESERVED_KWARGS:
                raise ValueError(f"chat_template_kwargs.{key}: reserved, set it through the request instead")
        try:
            return self._template.render(
                messages=normalize_messages(messages),
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **chat_template_kwargs,
            )
        except jinja2.TemplateError as e:  # raise_exception(), undefined access, sandbox violations
            raise ValueError(f"chat template: {e}") from None
        except (TypeError, KeyError, AttributeError, IndexError) as e:
            raise ValueError(f"chat template: {type(e).__name__}: {e}") from None


def render_chat(
    template: str | ChatTemplate,
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> str:
    """Validate and render in one call (compiles `template` when given as text)."""
    if isinstance(template, str):
        template = ChatTemplate(template)
    return template.render(
        messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        chat_template_kwargs=chat_template_kwargs,
        **kwargs,
    )

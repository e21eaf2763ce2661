"""JSON from clients, parsed with limits that hold before parsing gets expensive.

Python's `json.loads` converts an integer of any length with `int()` (over 4300 digits that raises a
ValueError that is not a JSONDecodeError) and recurses once per nesting level (RecursionError near
1000). `load_json` turns both, and every other malformation, into one `JsonInputError` with a message
that names the field, so the HTTP body, the gRPC JSON-in-string fields (`tools_json`,
`chat_template_kwargs_json`) and tool-call arguments all answer 400 / INVALID_ARGUMENT, never 500.
"""

from __future__ import annotations

import json
from typing import Any

MAX_NUMBER_CHARS = 100  # digits (and sign, point, exponent) of one JSON number
MAX_DEPTH = 64  # nested arrays / objects


class JsonInputError(ValueError):
    """A client's JSON text that is malformed or over a limit; str() is the message for the client."""


def _number(limit: int, kind):
    def parse(text: str):
        if len(text) > limit:
            raise JsonInputError(f"a number of {len(text)} characters (the limit is {limit})")
        return kind(text)

    return parse


def _constant(name: str):
    raise JsonInputError(f"{name} is not a JSON number")


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
    return deepest


def parse_hooks(max_number_chars: int = MAX_NUMBER_CHARS) -> dict:
    """json.loads keyword arguments that bound numbers (JsonInputError past the limit) and refuse the
    non-standard NaN / Infinity."""
    return dict(
        parse_int=_number(max_number_chars, int),
        parse_float=_number(max_number_chars, float),
        parse_constant=_constant,
    )


def check_depth(value: Any, what: str, max_depth: int = MAX_DEPTH) -> None:
    if _depth(value) > max_depth:
        raise JsonInputError(f"{what} is nested too deeply (the limit is {max_depth} levels)")


def load_json(
    text: str | bytes, what: str, max_depth: int = MAX_DEPTH, max_number_chars: int = MAX_NUMBER_CHARS
) -> Any:
    """Parse `text`; raise JsonInputError naming `what` when it is not JSON or exceeds a limit."""
    try:
        value = json.loads(text, **parse_hooks(max_number_chars))
    except JsonInputError as e:
        raise JsonInputError(f"{what}: {e}") from None
    except UnicodeDecodeError:
        raise JsonInputError(f"{what}: not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise JsonInputError(f"{what}: not valid JSON ({e.msg} at char {e.pos})") from None
    except RecursionError:
        raise JsonInputError(f"{what} is nested too deeply (the limit is {max_depth} levels)") from None
    check_depth(value, what, max_depth)
    return value

"""Streaming output parsers (reasoning, tool calls), the marker scan and the types they share.

Each parser is a streaming state machine (`push(text)` / `finish()`) with a non-streaming twin (a
function over the whole text) that gives the same result; tests hold the two together for every way
of cutting an output into chunks. `registry.py` maps configuration names to parsers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class ToolCallDelta:
    """A streamed piece of a tool call: first (id, name) with no arguments, then argument fragments."""

    index: int
    id: str = ""
    name: str = ""
    arguments_delta: str = ""


@dataclasses.dataclass(frozen=True)
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str


def merge_deltas(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """Fold streamed deltas into whole calls, by index."""
    calls: dict[int, dict] = {}
    for d in deltas:
        c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
        c["id"] = c["id"] or d.id
        c["name"] = c["name"] or d.name
        c["arguments"] += d.arguments_delta
    return [ToolCall(index=i, **calls[i]) for i in sorted(calls)]


def scan(buffer: str, markers: Sequence[str]) -> tuple[int, str | None]:
    """Find the first marker in `buffer`.

    Returns (position, marker) for the earliest complete marker (ties: the first in `markers`), else
    (safe, None) where buffer[:safe] cannot be the start of any marker and buffer[safe:] (a proper
    prefix of a marker) must be held back until more text arrives.
    """
    best, found = len(buffer), None
    for marker in markers:
        pos = buffer.find(marker)
        if pos != -1 and pos < best:
            best, found = pos, marker
    if found is not None:
        return best, found
    hold = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(buffer)), hold, -1):
            if buffer.endswith(marker[:k]):
                hold = k
                break
    return len(buffer) - hold, None


def find_first(text: str, markers: Sequence[str], start: int = 0) -> tuple[int, str | None]:
    """Non-streaming counterpart of `scan`: (position, marker) of the earliest marker at or after
    `start` (ties: the first in `markers`), or (len(text), None)."""
    best, found = len(text), None
    for marker in markers:
        pos = text.find(marker, start)
        if pos != -1 and pos < best:
            best, found = pos, marker
    return best, found

"""Streaming output parsers (reasoning, tool calls) and the marker scan they share.

Each parser is a streaming state machine (`push(text)` / `finish()`) with a non-streaming twin (a
function over the whole text) that gives the same result; tests hold the two together.
"""
from __future__ import annotations

from typing import Sequence


def scan(buffer: str, markers: Sequence[str]) -> tuple[int, str | None]:
    """Find the first marker in `buffer`.

    Returns (position, marker) for the earliest complete marker, else (safe, None) where
    buffer[:safe] cannot be the start of any marker and buffer[safe:] (a proper prefix of a marker)
    must be held back until more text arrives.
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

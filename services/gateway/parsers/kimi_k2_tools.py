"""Kimi K2 tool-call parser (docs/design.md §9.3).

The model writes

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>
    ...
    <|tool_calls_section_end|>

States: TEXT (content; a section begin, or a bare call begin, starts a section), SECTION (between
calls; stray text is dropped), CALL_ID (reading `functions.NAME:IDX`), ARGS (argument text, streamed
as it arrives, up to `<|tool_call_end|>`). A call is announced (index, id, name, empty arguments) as
soon as its id is complete, then its arguments follow as deltas. Text after the section end is content
again. At the end of the output a call whose id never completed is dropped and truncated arguments are
kept as they are.

The OpenAI id of a call is the model's `functions.NAME:IDX`; when the model wrote no index, IDX is
`index_offset` (tool calls earlier in the conversation) + the call's index in this answer.
"""

from __future__ import annotations

import dataclasses
import re

from ddtree.gateway.parsers import ToolCall, ToolCallDelta, merge_deltas, scan

__all__ = ["KimiK2ToolParser", "ToolCall", "ToolCallDelta", "merge_deltas", "parse_call_id", "parse_tool_calls"]

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARG_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARG_BEGIN, CALL_END)

TEXT, SECTION, CALL_ID, ARGS = "text", "section", "call_id", "args"
# The markers each state reacts to; any other marker is plain text of that state.
_WATCH = {
    TEXT: (SECTION_BEGIN, CALL_BEGIN),
    SECTION: (CALL_BEGIN, SECTION_END),
    CALL_ID: (ARG_BEGIN, CALL_END, SECTION_END),
    ARGS: (CALL_END, SECTION_END),
}
_ID = re.compile(r"^(?:functions\.)?(?P<name>[\w.\-]+):(?P<index>\d+)$")


def parse_call_id(raw: str, index: int, index_offset: int = 0) -> tuple[str, str]:
    """(OpenAI id, function name) of the text between call begin and argument begin."""
    raw = raw.strip()
    m = _ID.match(raw)
    if m:
        return f"functions.{m['name']}:{m['index']}", m["name"]
    name = raw[len("functions.") :] if raw.startswith("functions.") else raw
    return f"functions.{name}:{index_offset + index}", name


class KimiK2ToolParser:
    """Streaming: push(text) -> (content_delta, [ToolCallDelta]); finish() flushes."""

    def __init__(self, index_offset: int = 0):
        self.state = TEXT
        self.index_offset = index_offset
        self.calls = 0  # calls announced so far
        self._buffer = ""
        self._call_id = ""

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buffer += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while self._buffer:
            pos, marker = scan(self._buffer, _WATCH[self.state])
            self._take(self._buffer[:pos], content, deltas)
            if marker is None:
                self._buffer = self._buffer[pos:]
                break
            self._buffer = self._buffer[pos + len(marker) :]
            self._on_marker(marker, deltas)
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        held, self._buffer = self._buffer, ""
        self._take(held, content, deltas)
        return "".join(content), deltas

    def _take(self, text: str, content: list[str], deltas: list[ToolCallDelta]) -> None:
        if not text:
            return
        if self.state == TEXT:
            content.append(text)
        elif self.state == CALL_ID:
            self._call_id += text
        elif self.state == ARGS:
            deltas.append(ToolCallDelta(index=self.calls - 1, arguments_delta=text))
        # SECTION: text between calls is dropped

    def _on_marker(self, marker: str, deltas: list[ToolCallDelta]) -> None:
        if marker == SECTION_BEGIN:
            self.state = SECTION
        elif marker == CALL_BEGIN:
            self.state, self._call_id = CALL_ID, ""
        elif self.state == CALL_ID:  # ARG_BEGIN, CALL_END or SECTION_END: the id is complete
            call_id, name = parse_call_id(self._call_id, self.calls, self.index_offset)
            deltas.append(ToolCallDelta(index=self.calls, id=call_id, name=name))
            self.calls += 1
            self.state = {ARG_BEGIN: ARGS, CALL_END: SECTION, SECTION_END: TEXT}[marker]
        else:  # CALL_END or SECTION_END in ARGS, SECTION_END in SECTION
            self.state = SECTION if marker == CALL_END else TEXT


_SPLIT = re.compile("(" + "|".join(re.escape(m) for m in MARKERS) + ")")


def parse_tool_calls(text: str, index_offset: int = 0) -> tuple[str, list[ToolCall]]:
    """Non-streaming twin: (content, calls) of a whole output. Walks the marker-split pieces with the
    same grammar as the state machine, without any buffering."""
    content: list[str] = []
    calls: list[ToolCall] = []
    state, call_id, args = TEXT, "", None

    def close_call():
        nonlocal args
        calls[-1] = dataclasses.replace(calls[-1], arguments=args or "")
        args = None

    for piece in _SPLIT.split(text):
        if piece in MARKERS and piece in _WATCH[state]:
            if piece == SECTION_BEGIN:
                state = SECTION
            elif piece == CALL_BEGIN:
                state, call_id = CALL_ID, ""
            elif state == CALL_ID:
                cid, name = parse_call_id(call_id, len(calls), index_offset)
                calls.append(ToolCall(index=len(calls), id=cid, name=name, arguments=""))
                args = ""
                if piece != ARG_BEGIN:
                    close_call()
                state = {ARG_BEGIN: ARGS, CALL_END: SECTION, SECTION_END: TEXT}[piece]
            else:
                if state == ARGS:
                    close_call()
                state = SECTION if piece == CALL_END else TEXT
        elif state == TEXT:
            content.append(piece)
        elif state == CALL_ID:
            call_id += piece
        elif state == ARGS:
            args += piece
    if state == ARGS:
        close_call()
    return "".join(content), calls

"""Parsers by configuration name (`--reasoning-parser`, `--tool-call-parser`), and the output pipeline
that chains them: reasoning first, then tool calls on the content.

Each tool-call format names the marker that opens its section; the reasoning parser ends reasoning
there too (a model may start calling tools without closing its think block).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

from ddtree.gateway.parsers import ToolCall, ToolCallDelta, deepseek_v3_tools, kimi_k2_tools
from ddtree.gateway.parsers.kimi_k2_reasoning import THINK_END, THINK_START, KimiK2ReasoningParser, parse_reasoning


class ToolParser(Protocol):
    calls: int

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]: ...
    def finish(self) -> tuple[str, list[ToolCallDelta]]: ...


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    name: str
    streaming: Callable[[int], ToolParser]  # index_offset -> parser
    parse: Callable[[str, int], tuple[str, list[ToolCall]]]  # (text, index_offset) -> (content, calls)
    section_begin: str


TOOL_FORMATS = {
    "kimi_k2": ToolFormat(
        "kimi_k2", kimi_k2_tools.KimiK2ToolParser, kimi_k2_tools.parse_tool_calls, kimi_k2_tools.SECTION_BEGIN
    ),
    "deepseek_v3": ToolFormat(
        "deepseek_v3",
        deepseek_v3_tools.DeepSeekV3ToolParser,
        deepseek_v3_tools.parse_tool_calls,
        deepseek_v3_tools.CALLS_BEGIN,
    ),
}
TOOL_CALL_PARSERS = (*TOOL_FORMATS, "none")
REASONING_PARSERS = ("kimi_k2", "none")


def check_names(reasoning_parser: str, tool_call_parser: str) -> None:
    if reasoning_parser not in REASONING_PARSERS:
        raise ValueError(
            f"reasoning_parser {reasoning_parser!r} is not available (choose from {', '.join(REASONING_PARSERS)})"
        )
    if tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(
            f"tool_call_parser {tool_call_parser!r} is not available (choose from {', '.join(TOOL_CALL_PARSERS)})"
        )


def parser_markers(reasoning: str | None, tools: str | None) -> tuple[str, ...]:
    """The marker strings the active parsers read (the detokenizer keeps these special tokens when it
    skips the others). The reasoning parser's tool-section marker counts only with a tool parser."""
    fmt = TOOL_FORMATS.get(tools or "")
    marks: tuple[str, ...] = (THINK_START, THINK_END) if reasoning == "kimi_k2" else ()
    if fmt is not None:
        module = kimi_k2_tools if fmt.name == "kimi_k2" else deepseek_v3_tools
        marks += module.MARKERS
    return marks


class OutputParsers:
    """Reasoning parser, then tool-call parser on its content; either may be off (None name)."""

    def __init__(
        self, reasoning: str | None, tools: str | None, in_reasoning: bool = False, tool_index_offset: int = 0
    ):
        fmt = TOOL_FORMATS.get(tools or "")
        tool_start = fmt.section_begin if fmt else kimi_k2_tools.SECTION_BEGIN
        self._reasoning = KimiK2ReasoningParser(in_reasoning, tool_start) if reasoning == "kimi_k2" else None
        self._tools = fmt.streaming(tool_index_offset) if fmt else None

    @property
    def called_tools(self) -> bool:
        return self._tools is not None and self._tools.calls > 0

    def push(self, text: str) -> tuple[str, str, list[ToolCallDelta]]:
        """-> (content delta, reasoning delta, tool-call deltas)."""
        reasoning, content = self._reasoning.push(text) if self._reasoning else ("", text)
        content, calls = self._tools.push(content) if self._tools else (content, [])
        return content, reasoning, calls

    def finish(self) -> tuple[str, str, list[ToolCallDelta]]:
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        calls: list[ToolCallDelta] = []
        if self._tools:
            content, calls = self._tools.push(content)
            tail, more = self._tools.finish()
            content, calls = content + tail, calls + more
        return content, reasoning, calls


def parse_output(
    text: str, reasoning: str | None, tools: str | None, in_reasoning: bool = False, tool_index_offset: int = 0
) -> tuple[str, str, list[ToolCall]]:
    """Non-streaming twin of OutputParsers: (content, reasoning, calls) of a whole output."""
    fmt = TOOL_FORMATS.get(tools or "")
    if reasoning == "kimi_k2":
        tool_start = fmt.section_begin if fmt else kimi_k2_tools.SECTION_BEGIN
        thought, content = parse_reasoning(text, in_reasoning, tool_start)
    else:
        thought, content = "", text
    if fmt is None:
        return content, thought, []
    content, calls = fmt.parse(content, tool_index_offset)
    return content, thought, calls

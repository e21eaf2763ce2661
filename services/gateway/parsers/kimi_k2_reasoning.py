"""Kimi K2 reasoning parser: split `<think>…</think>` reasoning from the answer (docs/design.md §9.3).

States: BEFORE (no reasoning yet: text is content; `<think>` opens reasoning, once), REASONING (text is
reasoning; `</think>` closes it and is dropped; `<|tool_calls_section_begin|>` also ends it and is
passed on, intact, as content for the tool parser), AFTER (everything is content).

Start in REASONING when the prompt already ends with `<think>` (the thinking generation prompt).
Truncated reasoning (no `</think>` before the end) is flushed as reasoning by `finish()`.
`tool_start` is the section marker of the tool-call format in use (Kimi's by default; the DeepSeek-V3
tool parser passes `<｜tool▁calls▁begin｜>`).
"""

from __future__ import annotations

from ddtree.gateway.parsers import scan

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_SECTION_BEGIN = "<|tool_calls_section_begin|>"

BEFORE, REASONING, AFTER = "before", "reasoning", "after"


def starts_in_reasoning(prompt: str) -> bool:
    """Whether generation continues inside a think block the prompt opened."""
    return prompt.endswith(THINK_START)


class KimiK2ReasoningParser:
    """Streaming: push(text) -> (reasoning_delta, content_delta); finish() flushes."""

    def __init__(self, in_reasoning: bool = False, tool_start: str = TOOL_SECTION_BEGIN):
        self.state = REASONING if in_reasoning else BEFORE
        self._tool_start = tool_start
        self._buffer = ""

    def push(self, text: str) -> tuple[str, str]:
        self._buffer += text
        reasoning, content = [], []
        while self._buffer:
            if self.state == AFTER:
                content.append(self._buffer)
                self._buffer = ""
                break
            markers = (THINK_START,) if self.state == BEFORE else (THINK_END, self._tool_start)
            out = content if self.state == BEFORE else reasoning
            pos, marker = scan(self._buffer, markers)
            out.append(self._buffer[:pos])
            if marker is None:
                self._buffer = self._buffer[pos:]
                break
            rest = self._buffer[pos + len(marker) :]
            if marker == THINK_START:
                self.state = REASONING
            elif marker == THINK_END:
                self.state = AFTER
            else:  # the tool section ends reasoning and belongs to the content
                self.state = AFTER
                rest = marker + rest
            self._buffer = rest
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        held, self._buffer = self._buffer, ""
        return (held, "") if self.state == REASONING else ("", held)


def parse_reasoning(text: str, in_reasoning: bool = False, tool_start: str = TOOL_SECTION_BEGIN) -> tuple[str, str]:
    """Non-streaming twin: (reasoning, content) of a whole output."""
    if not in_reasoning:
        start = text.find(THINK_START)
        if start == -1:
            return "", text
        head, text = text[:start], text[start + len(THINK_START) :]
    else:
        head = ""
    end = text.find(THINK_END)
    tool = text.find(tool_start)
    if end == -1 and tool == -1:
        return text, head
    if tool != -1 and (end == -1 or tool < end):
        return text[:tool], head + text[tool:]
    return text[:end], head + text[end + len(THINK_END) :]

"""DeepSeek-V3 tool-call parser (docs/design.md §9.3).

The model writes (`｜` and `▁` are the full-width characters of DeepSeek's special tokens)

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {args}
    ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

States and the markers each reacts to (any other text is dropped unless noted):

    TEXT       content; `calls begin` -> SECTION, a bare `call begin` -> TYPE
    SECTION    `call begin` -> TYPE, `calls end` -> TEXT
    TYPE       ("function") `sep` -> NAME
    NAME       the name, kept; "\\n" ends it -> FENCE
    FENCE      "```json\\n" -> ARGS_FENCED; "{" (no fence) -> ARGS_PLAIN, the "{" kept as arguments
    ARGS_FENCED  arguments, streamed; "\\n```" ends them -> SKIP
    ARGS_PLAIN   arguments, streamed
    SKIP       the closing fence and anything up to the call end

In every call state `call end` -> SECTION and `calls end` -> TEXT. A call is announced (index, id, name,
empty arguments) when its name is complete; a call without a name, or whose name never completed
before the end of the output, is dropped. The OpenAI id is `call_{index_offset + index}` (index_offset =
tool calls earlier in the conversation), unique within a conversation and the same on every run.
"""

from __future__ import annotations

from ddtree.gateway.parsers import ToolCall, ToolCallDelta, find_first, scan

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE_OPEN = "```json\n"
FENCE_CLOSE = "\n```"
NEWLINE = "\n"
BRACE = "{"
MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

TEXT, SECTION, TYPE, NAME, FENCE, ARGS_FENCED, ARGS_PLAIN, SKIP = (
    "text",
    "section",
    "type",
    "name",
    "fence",
    "args_fenced",
    "args_plain",
    "skip",
)
_CALL_STATES = (TYPE, NAME, FENCE, ARGS_FENCED, ARGS_PLAIN, SKIP)
_WATCH = {
    TEXT: (CALLS_BEGIN, CALL_BEGIN),
    SECTION: (CALL_BEGIN, CALLS_END),
    TYPE: (SEP, CALL_END, CALLS_END),
    NAME: (NEWLINE, CALL_END, CALLS_END),
    FENCE: (FENCE_OPEN, BRACE, CALL_END, CALLS_END),
    ARGS_FENCED: (FENCE_CLOSE, CALL_END, CALLS_END),
    ARGS_PLAIN: (CALL_END, CALLS_END),
    SKIP: (CALL_END, CALLS_END),
}


def call_id(index: int, index_offset: int = 0) -> str:
    return f"call_{index_offset + index}"


class _Grammar:
    """The transitions, shared by the streaming parser and its non-streaming twin."""

    def __init__(self):
        self.state = TEXT
        self.name = ""

    def on_marker(self, marker: str) -> str | None:
        """Apply `marker` (one of _WATCH[state]); return a completed call name or None."""
        state, announced = self.state, None
        if marker == CALLS_END:
            self.state = TEXT
        elif marker == CALL_END:
            self.state = SECTION
        elif marker == CALLS_BEGIN:
            self.state = SECTION
        elif marker == CALL_BEGIN:
            self.state = TYPE
        elif marker == SEP:
            self.state, self.name = NAME, ""
        elif marker == NEWLINE:
            self.state = FENCE
        elif marker == FENCE_OPEN:
            self.state = ARGS_FENCED
        elif marker == BRACE:
            self.state = ARGS_PLAIN
        elif marker == FENCE_CLOSE:
            self.state = SKIP
        if state == NAME:
            name = self.name.strip()
            if name:
                announced = name
            elif self.state == FENCE:
                self.state = SKIP  # a call without a name is dropped
        return announced


class DeepSeekV3ToolParser:
    """Streaming: push(text) -> (content_delta, [ToolCallDelta]); finish() flushes."""

    def __init__(self, index_offset: int = 0):
        self.index_offset = index_offset
        self.calls = 0  # calls announced so far
        self._g = _Grammar()
        self._buffer = ""

    @property
    def state(self) -> str:
        return self._g.state

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buffer += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while self._buffer:
            pos, marker = scan(self._buffer, _WATCH[self._g.state])
            self._take(self._buffer[:pos], content, deltas)
            if marker is None:
                self._buffer = self._buffer[pos:]
                break
            self._buffer = self._buffer[pos + len(marker) :]
            name = self._g.on_marker(marker)
            if name is not None:
                deltas.append(ToolCallDelta(index=self.calls, id=call_id(self.calls, self.index_offset), name=name))
                self.calls += 1
            if marker == BRACE:  # unfenced arguments: the brace is their first character
                self._buffer = BRACE + self._buffer
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
        state = self._g.state
        if state == TEXT:
            content.append(text)
        elif state == NAME:
            self._g.name += text
        elif state in (ARGS_FENCED, ARGS_PLAIN):
            deltas.append(ToolCallDelta(index=self.calls - 1, arguments_delta=text))


def parse_tool_calls(text: str, index_offset: int = 0) -> tuple[str, list[ToolCall]]:
    """Non-streaming twin: (content, calls) of a whole output, walking it marker by marker with the
    same grammar and no buffering."""
    g = _Grammar()
    content: list[str] = []
    calls: list[ToolCall] = []
    args: list[str] = []

    def close() -> None:
        if calls and args:
            last = calls[-1]
            calls[-1] = ToolCall(last.index, last.id, last.name, last.arguments + "".join(args))
        args.clear()

    pos = 0
    while True:
        at, marker = find_first(text, _WATCH[g.state], pos)
        piece = text[pos:at]
        if g.state == TEXT:
            content.append(piece)
        elif g.state == NAME:
            g.name += piece
        elif g.state in (ARGS_FENCED, ARGS_PLAIN):
            args.append(piece)
        if marker is None:
            break
        pos = at + len(marker)
        if g.state in (ARGS_FENCED, ARGS_PLAIN):
            close()
        name = g.on_marker(marker)
        if name is not None:
            calls.append(ToolCall(len(calls), call_id(len(calls), index_offset), name, ""))
        if marker == BRACE:
            pos -= len(BRACE)  # the brace starts the arguments
    close()
    return "".join(content), calls

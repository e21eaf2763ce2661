"""Output parsers: for outputs with text, reasoning and several tool calls, every way of cutting the
output into stream chunks gives what the non-streaming twin gives on the whole text.

Splits checked per output: every single cut; every pair of cuts inside two adjacent markers (both
markers cut at every position); one character per chunk; random multi-cuts. Both tool-call formats
(kimi_k2, deepseek_v3) run behind the kimi_k2 reasoning parser, as in the gateway.
"""

from __future__ import annotations

import random
import re

import pytest

from ddtree.gateway.parsers import ToolCall, merge_deltas
from ddtree.gateway.parsers import deepseek_v3_tools as ds
from ddtree.gateway.parsers import kimi_k2_tools as kimi
from ddtree.gateway.parsers.registry import OutputParsers, check_names, parse_output


def _kimi_call(name, idx, args):
    return f"{kimi.CALL_BEGIN}functions.{name}:{idx}{kimi.ARG_BEGIN}{args}{kimi.CALL_END}"


def _ds_call(name, args, fenced=True):
    body = f"\n```json\n{args}\n```" if fenced else f"\n{args}"
    return f"{ds.CALL_BEGIN}function{ds.SEP}{name}{body}{ds.CALL_END}"


ARGS = ['{"city": "Paris", "unit": "°C"}', '{"q": "emoji 😀 and <|not a marker|>", "n": [1, 2]}', "{}"]

# (name, tool format, in_reasoning, output, expected (content, reasoning, calls) with index_offset 2)
CASES = [
    (
        "kimi-reasoning-text-3-calls",
        "kimi_k2",
        True,
        "Let me check the weather.</think>Checking now."
        + kimi.SECTION_BEGIN
        + _kimi_call("get_weather", 2, ARGS[0])
        + _kimi_call("search", 3, ARGS[1])
        + _kimi_call("noop", 4, ARGS[2])
        + kimi.SECTION_END,
        (
            "Checking now.",
            "Let me check the weather.",
            [
                ToolCall(0, "functions.get_weather:2", "get_weather", ARGS[0]),
                ToolCall(1, "functions.search:3", "search", ARGS[1]),
                ToolCall(2, "functions.noop:4", "noop", ARGS[2]),
            ],
        ),
    ),
    (
        "kimi-section-ends-reasoning",
        "kimi_k2",
        False,
        "Intro <think>plan: call two tools"
        + kimi.SECTION_BEGIN
        + kimi.CALL_BEGIN
        + "lookup"
        + kimi.ARG_BEGIN
        + ARGS[1]
        + kimi.CALL_END
        + _kimi_call("get_weather", 7, ARGS[0])
        + kimi.SECTION_END
        + " after",
        (
            "Intro  after",
            "plan: call two tools",
            [
                ToolCall(0, "functions.lookup:2", "lookup", ARGS[1]),
                ToolCall(1, "functions.get_weather:7", "get_weather", ARGS[0]),
            ],
        ),
    ),
    (
        "kimi-truncated-arguments",
        "kimi_k2",
        True,
        "short</think>"
        + kimi.SECTION_BEGIN
        + _kimi_call("a", 0, ARGS[0])
        + kimi.CALL_BEGIN
        + "functions.b:1"
        + kimi.ARG_BEGIN
        + '{"x": "cut here',
        (
            "",
            "short",
            [ToolCall(0, "functions.a:0", "a", ARGS[0]), ToolCall(1, "functions.b:1", "b", '{"x": "cut here')],
        ),
    ),
    (
        "deepseek-reasoning-text-3-calls",
        "deepseek_v3",
        True,
        "Think about it.</think>Calling tools."
        + ds.CALLS_BEGIN
        + _ds_call("get_weather", ARGS[0])
        + _ds_call("search", ARGS[1])
        + _ds_call("noop", ARGS[2], fenced=False)
        + ds.CALLS_END
        + " done",
        (
            "Calling tools. done",
            "Think about it.",
            [
                ToolCall(0, "call_2", "get_weather", ARGS[0]),
                ToolCall(1, "call_3", "search", ARGS[1]),
                ToolCall(2, "call_4", "noop", ARGS[2]),
            ],
        ),
    ),
    (
        "deepseek-section-ends-reasoning",
        "deepseek_v3",
        True,
        "still thinking"
        + ds.CALLS_BEGIN
        + _ds_call("lookup", ARGS[1])
        + _ds_call("get_weather", ARGS[0])
        + ds.CALLS_END,
        (
            "",
            "still thinking",
            [ToolCall(0, "call_2", "lookup", ARGS[1]), ToolCall(1, "call_3", "get_weather", ARGS[0])],
        ),
    ),
    (
        "deepseek-truncated-arguments",
        "deepseek_v3",
        False,
        "<think>r</think>ok"
        + ds.CALLS_BEGIN
        + _ds_call("a", ARGS[2])
        + ds.CALL_BEGIN
        + "function"
        + ds.SEP
        + 'b\n```json\n{"x": 1',
        ("ok", "r", [ToolCall(0, "call_2", "a", "{}"), ToolCall(1, "call_3", "b", '{"x": 1')]),
    ),
]
MARKER_RE = re.compile(
    "|".join(
        re.escape(m)
        for m in sorted(
            {*kimi.MARKERS, *ds.MARKERS, "<think>", "</think>", ds.FENCE_OPEN, ds.FENCE_CLOSE}, key=len, reverse=True
        )
    )
)


def _stream(pieces, tools, in_reasoning, offset=2):
    p = OutputParsers("kimi_k2", tools, in_reasoning, offset)
    content, reasoning, deltas = [], [], []
    for piece in pieces:
        c, r, d = p.push(piece)
        content.append(c), reasoning.append(r), deltas.extend(d)
    c, r, d = p.finish()
    content.append(c), reasoning.append(r), deltas.extend(d)
    # Each call is announced (index, id, name) before any of its argument fragments, exactly once.
    announced = set()
    for d in deltas:
        assert (d.index in announced) == (not d.id), d
        announced.add(d.index)
    return "".join(content), "".join(reasoning), merge_deltas(deltas), p.called_tools


def _cut(text, cuts):
    cuts = sorted(set(cuts))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _splits(text, rng):
    n = len(text)
    yield [text]
    for i in range(1, n):
        yield _cut(text, [i])
    spans = [m.span() for m in MARKER_RE.finditer(text)]
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        for i in range(a0 + 1, a1):
            for j in range(b0 + 1, b1):
                yield _cut(text, [i, j])
    yield list(text)
    for _ in range(300):
        yield _cut(text, rng.sample(range(1, n), rng.randint(1, min(12, n - 1))))


@pytest.mark.parametrize("name, tools, in_reasoning, text, expected", CASES, ids=[c[0] for c in CASES])
def test_every_split_equals_non_streaming(name, tools, in_reasoning, text, expected):
    whole = parse_output(text, "kimi_k2", tools, in_reasoning, 2)
    assert whole == expected
    rng = random.Random(name)
    count = 0
    for pieces in _splits(text, rng):
        content, reasoning, calls, called = _stream(pieces, tools, in_reasoning)
        assert (content, reasoning, calls) == whole, pieces
        assert called == bool(whole[2])
        count += 1
    assert count > len(text)


@pytest.mark.parametrize("seed", range(3))
def test_deepseek_random_outputs(seed):
    """Random sequences of the format's pieces (malformed ones included): twin equality for random splits."""
    atoms = [
        *ds.MARKERS,
        "function",
        "\n",
        "```json\n",
        "\n```",
        "```",
        "{",
        "}",
        '"a": 1',
        "get_weather",
        " ",
        "<think>",
        "</think>",
        "text",
        "😀",
        "`",
    ]
    rng = random.Random(seed)
    for _ in range(600):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 16)))
        offset = rng.randint(0, 3)
        whole = ds.parse_tool_calls(text, offset)
        cuts = rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6))) if len(text) > 1 else []
        p = ds.DeepSeekV3ToolParser(offset)
        content, deltas = [], []
        for piece in _cut(text, cuts) + [None]:
            c, d = p.push(piece) if piece is not None else p.finish()
            content.append(c)
            deltas += d
        assert ("".join(content), merge_deltas(deltas)) == whole, (text, cuts)


def test_deepseek_streaming_shape():
    p = ds.DeepSeekV3ToolParser()
    assert p.push("Hi" + ds.CALLS_BEGIN[:5]) == ("Hi", [])
    content, deltas = p.push(ds.CALLS_BEGIN[5:] + ds.CALL_BEGIN + "function" + ds.SEP + 'f\n```json\n{"a"')
    assert content == "" and [(d.index, d.id, d.name, d.arguments_delta) for d in deltas] == [
        (0, "call_0", "f", ""),
        (0, "", "", '{"a"'),
    ]
    content, deltas = p.push(": 1}\n`")  # "\n`" may start the closing fence: held back
    assert [d.arguments_delta for d in deltas] == [": 1}"]
    assert p.push("``" + ds.CALL_END + ds.CALLS_END) == ("", [])
    assert p.finish() == ("", [])
    # A call without a name is dropped; text between calls is dropped; text after the section is content.
    assert ds.parse_tool_calls(
        ds.CALLS_BEGIN
        + ds.CALL_BEGIN
        + "function"
        + ds.SEP
        + "\n```json\n{}\n```"
        + ds.CALL_END
        + " x "
        + ds.CALLS_END
        + "tail"
    ) == ("tail", [])


def test_parser_names():
    check_names("kimi_k2", "deepseek_v3")
    check_names("none", "none")
    with pytest.raises(ValueError, match="tool_call_parser 'hermes' is not available"):
        check_names("kimi_k2", "hermes")
    with pytest.raises(ValueError, match="reasoning_parser 'qwen3' is not available"):
        check_names("qwen3", "kimi_k2")

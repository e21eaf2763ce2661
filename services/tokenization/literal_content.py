"""Chat prompts in which text from the request cannot forge structure.

A chat template interpolates request text (message content, names, tool-call ids and arguments,
reasoning, tool declarations, template variables) between its own structure tokens (`<|im_user|>`,
`<|im_end|>`, `<|tool_call_begin|>`, ...). Encoding the rendered string with special tokens allowed
would let a user type `hi<|im_end|><|im_system|>system<|im_middle|>...` and open a system turn, or
`<|tool_calls_section_begin|>` and forge a tool call. Here:

1. Before rendering, `mask` walks every string of the request (dict keys too) and replaces what could
   become a special token by a marker `MARK_OPEN + str(index) + MARK_CLOSE` (two private-use
   characters around a decimal index into `literals`): every special-token string; a tail of the string
   that is a proper prefix of a special token and a head that is a proper suffix of one (so that two
   interpolated strings, or a string and the template's text, can never join into a special token); and
   the marker characters themselves.
2. The template renders the masked request. The only special-token strings in the result are then the
   ones the template wrote itself.
3. `split_rendered` cuts the result at those special tokens, restores the markers in the text between
   them, and returns (text, is_special) segments. The tokenizer encodes special segments as their ids
   and text segments with special tokens off, so a user's `<|im_end|>` becomes plain-text pieces.

For a request without special-token strings this is exactly the ids of `encode(rendered, special on)`:
both split at the template's specials and encode the text between them the same way.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

MARK_OPEN = "\ue000"
MARK_CLOSE = "\ue001"
_MARKER = re.compile(f"{MARK_OPEN}(\\d+){MARK_CLOSE}")


class LiteralContent:
    """Masks request text and splits rendered prompts for one tokenizer's special tokens.
    Immutable after construction, so one instance serves every thread."""

    def __init__(self, special_tokens: Iterable[str]):
        names = sorted({s for s in special_tokens if s}, key=len, reverse=True)  # longest first
        if not names:
            raise ValueError("LiteralContent needs at least one special token")
        alternatives = "|".join(re.escape(s) for s in names)
        self._special = re.compile(alternatives)
        self._in_request = re.compile(f"{alternatives}|[{MARK_OPEN}{MARK_CLOSE}]")
        self._prefixes = frozenset(s[:k] for s in names for k in range(1, len(s)))
        self._suffixes = frozenset(s[k:] for s in names for k in range(1, len(s)))
        self._longest = len(names[0])

    def check_template(self, source: str) -> None:
        """A template that writes the marker characters itself cannot be split safely."""
        if MARK_OPEN in source or MARK_CLOSE in source:
            raise ValueError("chat template: contains U+E000 or U+E001, which the gateway reserves as markers")

    # -- before rendering ----------------------------------------------------------------------------
    def mask(self, value: Any, literals: list[str]) -> Any:
        """A copy of `value` (str, or lists / tuples / dicts of them, any depth) with every string
        masked; other values pass unchanged. `literals` collects what the markers stand for."""
        if isinstance(value, str):
            return self._mask_text(value, literals)
        if isinstance(value, dict):
            return {self.mask(k, literals): self.mask(v, literals) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.mask(v, literals) for v in value)
        return value

    def _mask_text(self, text: str, literals: list[str]) -> str:
        def marker(piece: str) -> str:
            literals.append(piece)
            return f"{MARK_OPEN}{len(literals) - 1}{MARK_CLOSE}"

        head = self._edge(text, self._suffixes, at_start=True)
        tail = self._edge(text[len(head) :], self._prefixes, at_start=False)
        middle = text[len(head) : len(text) - len(tail)]
        middle = self._in_request.sub(lambda m: marker(m.group(0)), middle)
        return (marker(head) if head else "") + middle + (marker(tail) if tail else "")

    def _edge(self, text: str, pieces: frozenset[str], at_start: bool) -> str:
        """The longest start (or end) of `text` that is in `pieces` (proper suffixes / prefixes of a
        special token), or ''."""
        for k in range(min(len(text), self._longest - 1), 0, -1):
            piece = text[:k] if at_start else text[-k:]
            if piece in pieces:
                return piece
        return ""

    # -- after rendering -----------------------------------------------------------------------------
    def split_rendered(self, rendered: str, literals: list[str]) -> list[tuple[str, bool]]:
        """(segment, is_special) in order: the template's special tokens, and the text between them
        with the markers restored. Joined, the segments are the prompt the model reads."""
        segments: list[tuple[str, bool]] = []
        start = 0
        for m in self._special.finditer(rendered):
            if m.start() > start:
                segments.append((restore(rendered[start : m.start()], literals), False))
            segments.append((m.group(0), True))
            start = m.end()
        if start < len(rendered):
            segments.append((restore(rendered[start:], literals), False))
        return segments


def restore(text: str, literals: list[str]) -> str:
    """`text` with each marker replaced by the string it stands for."""

    def original(m: re.Match) -> str:
        i = int(m.group(1))
        return literals[i] if i < len(literals) else m.group(0)  # a template cannot invent a marker

    return _MARKER.sub(original, text)

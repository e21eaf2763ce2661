"""Incremental detokenization: token ids arrive a few at a time, text leaves as soon as it is complete.

Invariant: "".join(push(...) for each batch) + flush() == tokenizer.decode(all_ids, skip_special).
A push never returns a broken UTF-8 sequence: a character whose bytes are split across tokens (CJK,
emoji in a byte-level vocabulary) is held back until its last byte arrives; a sequence that can never
complete becomes U+FFFD exactly where the full decode puts one.

Two paths:
- bytes: the tokenizer knows each token's bytes (byte-level BPE, tiktoken). Bytes go through Python's
  incremental UTF-8 decoder with errors="replace", which substitutes maximal invalid subparts as the
  full decode does. O(1) per token.
- text: otherwise (fallback), decode all ids so far and release the new suffix once it no longer ends
  in U+FFFD. Exact but O(n) per push; fine for the tokenizers that lack per-token bytes.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

from ddtree.tokenization.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Detokenizes one sequence. Not thread-safe: one instance per request."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False, keep: frozenset[int] = frozenset()):
        """skip_special: special ids render as nothing, except those in `keep` (the output parsers'
        markers, which the parsers consume)."""
        self._tok = tokenizer
        self._skip = tokenizer.special_ids - keep if skip_special else frozenset()
        self._bytes_path = tokenizer.vocab_size > 0 and tokenizer.token_bytes(0) is not None
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # text path state
        self._ids: list[int] = []
        self._emitted = ""

    def push(self, token_ids: Iterable[int]) -> str:
        """Feed new ids; return the text they completed (possibly "")."""
        token_ids = [i for i in token_ids if i not in self._skip]
        self._tok.check_ids(token_ids)
        if self._bytes_path:
            data = b"".join(self._tok.token_bytes(i) or b"" for i in token_ids)
            return self._utf8.decode(data, final=False)
        self._ids.extend(token_ids)
        return self._release(final=False)

    def flush(self) -> str:
        """Text still held back at the end of the sequence (an incomplete tail becomes U+FFFD)."""
        if self._bytes_path:
            return self._utf8.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        text = self._tok.decode(self._ids)
        if not final and text.endswith(REPLACEMENT):
            return ""  # the last token may end inside a character: wait for the next one
        if not text.startswith(self._emitted):
            # A decoder whose output for earlier tokens changed with later ones; released text
            # cannot be taken back, so continue after the common prefix.
            common = 0
            while common < min(len(text), len(self._emitted)) and text[common] == self._emitted[common]:
                common += 1
            new = text[common:]
        else:
            new = text[len(self._emitted) :]
        self._emitted = text
        return new

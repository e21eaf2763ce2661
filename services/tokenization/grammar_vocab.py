"""A checkpoint's vocabulary as llguidance sees it, for structured outputs.

llguidance (the grammar engine: JSON schema, regex, Lark) computes a token mask from the exact bytes of
every token, so it is built from our `Tokenizer` rather than from a Hugging Face object: one code path
for both backends (`tokenizer.json` and Kimi's `tiktoken.model`). Ordinary tokens are their bytes
(`Tokenizer.token_bytes`); special tokens are flagged as such (a grammar names them, `<|tool_call_begin|>`
or `<[id]>`, and never produces them from text). Building it walks the vocabulary once, which is slow for
a vocabulary of Kimi's 164k tokens: callers keep one per tokenizer.
"""

from __future__ import annotations

import llguidance

from ddtree.tokenization.tokenizer import Tokenizer


class _Vocab:
    """The duck-typed tokenizer `llguidance.TokenizerWrapper` reads."""

    def __init__(self, tok: Tokenizer, eos_id: int):
        self.eos_token_id = eos_id
        self.bos_token_id = tok.bos_id
        self.special_token_ids = sorted(tok.special_ids)
        self.tokens = [
            tok.id_to_token(i).encode() if tok.is_special(i) else (tok.token_bytes(i) or b"")
            for i in range(tok.vocab_size)
        ]
        self._tok = tok

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, allow_special=False)


def ll_tokenizer(tok: Tokenizer):
    """An `llguidance.LLTokenizer` of `tok`. Its eos is the tokenizer's eos (or `<|im_end|>`): a grammar
    that has ended allows it; the verifier allows the request's own stop ids at the same points."""
    eos = tok.eos_id if tok.eos_id is not None else tok.special_tokens.get("<|im_end|>", 0)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab(tok, eos)))

"""Letter vocabularies for grammar tests: token i is the letter chr(ord("a") + i), the last one is the eos."""

from __future__ import annotations

import llguidance

from ddtree.verifier.constraints.grammar import SequenceGrammar


class LetterVocab:
    """The tokenizer protocol llguidance.TokenizerWrapper reads, over `size` one-letter tokens."""

    bos_token_id, special_token_ids = None, []

    def __init__(self, size: int):
        self.eos_token_id = size - 1
        self.tokens = [bytes([ord("a") + i]) for i in range(size)]

    def __call__(self, text):
        return [ord(ch) - ord("a") for ch in (text.decode() if isinstance(text, bytes) else text)]


def letter_tokenizer(size: int) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(LetterVocab(size)))


def letter_grammar(tokenizer: llguidance.LLTokenizer, regex: str, matcher=None) -> SequenceGrammar:
    """A sequence's grammar state for `regex` (or for `matcher` as given), no stop ids."""
    matcher = matcher or llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_regex(regex), log_level=0)
    return SequenceGrammar(matcher, frozenset(), tuple(tokenizer.eos_tokens))

"""vLLM's bad_words as token-id words (vLLM `SamplingParams.update_from_tokenizer`).

Each word is tokenized twice, without and with a leading space (after stripping its own leading
whitespace), so that it is banned at the start of the text and in the middle of it; the spaced variant
is kept only when it differs in its first token and has the same length (otherwise it is not the same
word as a new token). The verifier masks a word's last token wherever its other tokens end the output.
"""

from __future__ import annotations

from ddtree.protocol.ddtree.v1 import common_pb2
from ddtree.tokenization.tokenizer import Tokenizer

MAX_BAD_WORDS = 64  # words per request (each becomes up to two token-id words on the verifier)
MAX_BAD_WORD_TOKENS = 64  # tokens per word (the verifier's limit)


def bad_word_ids(tokenizer: Tokenizer, words) -> list[common_pb2.TokenIds]:
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), allow_special=False)
        out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), allow_special=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return [common_pb2.TokenIds(ids=ids) for ids in out if ids]

"""The verifier's per-token logprobs (`TokenLogprobs`, one per output token id) in OpenAI's two shapes.

- chat: `choices[i].logprobs = {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
  bytes}]}]}`, top_logprobs exactly the request's top_logprobs most likely tokens, most likely first.
- completions (legacy): `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`, each
  dict the `logprobs` most likely tokens plus the chosen one when it is not among them (as OpenAI and
  vLLM answer), text_offset the character offset of each token's string in the concatenated strings.

A token's string is its own decode (special tokens by name, a partial UTF-8 character as U+FFFD, as
vLLM shows them); `bytes` is the token's exact bytes when the tokenizer knows them (byte-level BPE,
tiktoken), else the string's UTF-8. Every output token has an entry, reasoning and tool-call tokens
included; the stop token that ends the answer (an eos / stop id) has none. An id past the tokenizer's
vocabulary (a padded-vocabulary checkpoint such as DeepSeek-V3 has more logit rows than tokens; such an
id can appear among the top logprobs) is shown as `<|N|>` (N the id) with empty bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

from ddtree.protocol.ddtree.v1 import common_pb2
from ddtree.tokenization.tokenizer import Tokenizer


class TokenStrings:
    """Token id -> (string, bytes), cached (a vocabulary has a few hundred thousand ids at most)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None and not 0 <= token_id < self._tok.vocab_size:
            return f"<|{token_id}|>", []  # a padding row of the logits: no token, no bytes (not cached)
        if hit is None:
            text = self._tok.decode([token_id])
            raw = self._tok.token_bytes(token_id)
            hit = self._cache[token_id] = (text, list(raw if raw is not None else text.encode("utf-8")))
        return hit


def _entry(strings: TokenStrings, token_id: int, logprob: float) -> dict:
    text, raw = strings(token_id)
    return {"token": text, "logprob": logprob, "bytes": raw}


def chat_logprobs(strings: TokenStrings, ids: Sequence[int], lps: Sequence[common_pb2.TokenLogprobs]) -> dict:
    content = []
    for token_id, lp in zip(ids, lps):
        entry = _entry(strings, token_id, lp.logprob)
        entry["top_logprobs"] = [_entry(strings, i, v) for i, v in zip(lp.top_ids, lp.top_logprobs)]
        content.append(entry)
    return {"content": content}


def completion_logprobs(
    strings: TokenStrings, ids: Sequence[int], lps: Sequence[common_pb2.TokenLogprobs], offset: int = 0
) -> dict:
    """offset: the text offset of the first token (the characters of the tokens before it)."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, lp in zip(ids, lps):
        text = strings(token_id)[0]
        top = {strings(i)[0]: v for i, v in zip(lp.top_ids, lp.top_logprobs)}
        top.setdefault(text, lp.logprob)
        out["tokens"].append(text)
        out["token_logprobs"].append(lp.logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out

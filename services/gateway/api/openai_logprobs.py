"""The verifier's logprobs in OpenAI's and vLLM's shapes: per output token (`TokenLogprobs`, one per
output token id) in OpenAI's two shapes, and per prompt token (`PromptLogprobs`) in vLLM's.

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

- prompt_logprobs (vLLM's): a list as long as the prompt, `null` for its first token (nothing scores it),
  then per prompt token a dict keyed by token id (a string in JSON) of `{logprob, rank, decoded_token}`:
  the prompt token first, then the k most likely tokens (rank 1..k; when the prompt token is one of
  them its entry stays first and carries that rank, as vLLM's dict does). Completions put it on each choice, chat
  on the response (both as vLLM); with n > 1 they are choice 0's (the one choice that asks for them:
  choices.choice_jobs). A stream sends them whole once choice 0's entries are all in, ahead of any
  text they precede (chat: once, a chunk with an empty delta and `prompt_logprobs`; completions: a
  choice with empty text and `prompt_logprobs`, for each choice): vLLM refuses prompt_logprobs > 0 with
  stream. -inf is shown as -9999.0 (vLLM's clamp; JSON has no infinity).
- echo (completions, vLLM's shape): the prompt's tokens ahead of the output's in `tokens`,
  `token_logprobs` and `top_logprobs`, the first prompt token's logprob and top_logprobs `null`
  (`echo_logprobs`, from the same verifier prompt log-probabilities).
"""

from __future__ import annotations

from collections.abc import Sequence

from ddtree.protocol.ddtree.v1 import common_pb2
from ddtree.tokenization.tokenizer import Tokenizer


class TokenStrings:
    """Token id -> (string, bytes), cached (a vocabulary has a few hundred thousand ids at most).
    `output` / `prompt`: what the request it renders for asked (`for_request`)."""

    def __init__(self, tokenizer: Tokenizer, cache: dict | None = None, output: bool = True, prompt: bool = False):
        self._tok = tokenizer
        self.cache: dict[int, tuple[str, list[int]]] = {} if cache is None else cache
        self.output, self.prompt = output, prompt

    def for_request(self, options) -> TokenStrings | None:
        """These strings (the same cache) for a request's GenerationOptions: None when it asks for no
        logprobs; else `output` = top_logprobs set, `prompt` = prompt_logprobs set."""
        output, prompt = options.HasField("top_logprobs"), options.HasField("prompt_logprobs")
        return TokenStrings(self._tok, self.cache, output, prompt) if output or prompt else None

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self.cache.get(token_id)
        if hit is None and not 0 <= token_id < self._tok.vocab_size:
            return f"<|{token_id}|>", []  # a padding row of the logits: no token, no bytes (not cached)
        if hit is None:
            text = self._tok.decode([token_id])
            raw = self._tok.token_bytes(token_id)
            hit = self.cache[token_id] = (text, list(raw if raw is not None else text.encode("utf-8")))
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


def _prompt_entry(strings: TokenStrings, token_id: int, logprob: float, rank: int) -> dict:
    return {"logprob": max(logprob, -9999.0), "rank": rank, "decoded_token": strings(token_id)[0]}


def prompt_logprobs_json(strings: TokenStrings, pieces: Sequence[common_pb2.PromptLogprobs]) -> list:
    """The prompt's entries (the verifier's pieces, in order from position 1) as vLLM's list."""
    out: list = [None]
    for piece in pieces:
        for token_id, lp, rank in zip(piece.token_ids, piece.logprobs, piece.ranks):
            entry = {str(token_id): _prompt_entry(strings, token_id, lp.logprob, rank)}
            for k, (top_id, value) in enumerate(zip(lp.top_ids, lp.top_logprobs)):
                entry[str(top_id)] = _prompt_entry(strings, top_id, value, k + 1)
            out.append(entry)
    return out


class PromptLogprobsStream:
    """A stream's prompt_logprobs: choice 0's pieces (the only choice whose verifier request asks for
    them) held until its first chunk with tokens or a finish_reason, which follows the last of them;
    then given once, whole (`take`)."""

    def __init__(self, strings: TokenStrings):
        self._strings = strings
        self._pieces: list[common_pb2.PromptLogprobs] | None = []  # None: given

    @property
    def pending(self) -> bool:
        """Choice 0's entries are not all in yet."""
        return self._pieces is not None

    def take(self, index: int, chunk) -> list | None:
        """The whole prompt_logprobs when `chunk` (a GenerateChunk of choice `index`) is choice 0's first
        after its prompt's entries; else None (held, given before, or another choice's chunk)."""
        pieces = self.take_pieces(index, chunk)
        return None if pieces is None else prompt_logprobs_json(self._strings, pieces)

    def take_pieces(self, index: int, chunk) -> list[common_pb2.PromptLogprobs] | None:
        """As `take`, the verifier's pieces themselves."""
        if index != 0 or self._pieces is None:
            return None
        if chunk.HasField("prompt_logprobs"):
            self._pieces.append(chunk.prompt_logprobs)
        if not (chunk.token_ids or chunk.finish_reason):
            return None
        pieces, self._pieces = self._pieces, None
        return pieces


def echo_logprobs(strings: TokenStrings, first_id: int, pieces: Sequence[common_pb2.PromptLogprobs], top: int) -> dict:
    """The prompt's entries in the completions shape (echo with logprobs, as vLLM): the first token with
    `null` logprob and `null` top_logprobs (nothing scores it), then each prompt token's logprob and its
    `top` most likely tokens plus itself; text_offset from 0."""
    first = strings(first_id)[0]
    out: dict = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
    offset = len(first)
    for piece in pieces:
        for token_id, lp in zip(piece.token_ids, piece.logprobs):
            text = strings(token_id)[0]
            tops = {strings(i)[0]: max(v, -9999.0) for i, v in list(zip(lp.top_ids, lp.top_logprobs))[:top]}
            tops.setdefault(text, max(lp.logprob, -9999.0))
            out["tokens"].append(text)
            out["token_logprobs"].append(max(lp.logprob, -9999.0))
            out["top_logprobs"].append(tops)
            out["text_offset"].append(offset)
            offset += len(text)
    return out


def join_logprobs(head: dict, tail: dict) -> dict:
    """Two completions-shape logprobs one after the other (the echoed prompt's, then the output's)."""
    return {key: head[key] + tail[key] for key in head}


def prompt_logprobs_field(strings: TokenStrings | None, pieces: Sequence[common_pb2.PromptLogprobs]) -> dict:
    """{"prompt_logprobs": [...]} for an answer whose request asked for them, else {} (vLLM's field)."""
    return {"prompt_logprobs": prompt_logprobs_json(strings, pieces)} if strings and strings.prompt else {}

"""A `GenerateRequest` as the verifier's `GenerateParams`, checked: the one conversion proto -> verifier.
Raises ValueError with the message the client sees (INVALID_ARGUMENT).

The table's parameters (contract/request_params.PARAMS) are read by their row's `to`: a SamplingParams
row becomes the `SamplingConfig` field of the same name (the wire's unset 0 as the row's `neutral`, an
unset `optional` field as None) and `SamplingConfig.validate` checks it; a request row that is a number
(top_logprobs, prompt_logprobs) becomes the `GenerateParams` field of the same name, checked here by its
row; ignore_eos and the spec rows (budget, no_spec) decide the stop ids and the speculation here. What
has a shape of its own (prompt, max_new_tokens against this verifier's limits, token-id lists against its
vocabulary) is checked here too.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

from ddtree.config import VerifierConfig
from ddtree.contract.request_params import PARAMS, REQUEST, SAMPLING, Param, has_presence, sent_to
from ddtree.contract.sampling_params import SamplingConfig
from ddtree.protocol.ddtree.v1 import common_pb2, verifier_pb2
from ddtree.verifier.sequence import GenerateParams

MAX_REQUEST_ID_CHARS = 256
MAX_BAD_WORDS = 128  # bad_words: words per request, and tokens per word (each word is matched on every row)
MAX_BAD_WORD_TOKENS = 64
_FLOATS = tuple(p.name for p in sent_to(SAMPLING) if p.kind is float)
_NAN = f"{', '.join(_FLOATS[:-1])} and {_FLOATS[-1]} must be numbers, got NaN"


def _value(message: Any, p: Param) -> Any:
    """A table parameter as the verifier reads it: None when an `optional` field is unset, the row's
    neutral value for the wire's unset 0."""
    if has_presence(message, p.name) and not message.HasField(p.name):
        return None
    value = getattr(message, p.name)
    return p.neutral if p.neutral is not None and p.unset and value == 0 else value


def _checked(p: Param, value: Any, where: str) -> Any:
    """A number of a request row in its range (None: unset), in the verifier's wording."""
    if value is not None and not p.contains(value):
        raise ValueError(f"{where} must be {p.phrase(wire=True)}, got {value}")
    return value


def sampling_config(s: common_pb2.SamplingParams, vocab_size: int) -> SamplingConfig:
    """The request's SamplingConfig, every field checked (token ids against `vocab_size`)."""
    if any(math.isnan(getattr(s, name)) for name in _FLOATS):
        raise ValueError(_NAN)
    check_token_ids(s, vocab_size)
    sampling = SamplingConfig(
        **{p.name: _value(s, p) for p in sent_to(SAMPLING)},
        logit_bias=tuple(sorted(s.logit_bias.items())),
        allowed_token_ids=tuple(sorted(set(s.allowed_token_ids))),
        bad_words=tuple(tuple(w.ids) for w in s.bad_words),
    )
    sampling.validate()
    return sampling


def check_token_ids(s: common_pb2.SamplingParams, vocab: int) -> None:
    """logit_bias, allowed_token_ids and bad_words name tokens of the vocabulary, in bounded numbers."""
    if len(s.logit_bias) > vocab or len(s.allowed_token_ids) > vocab:
        raise ValueError(f"logit_bias and allowed_token_ids hold at most {vocab} ids (the vocabulary)")
    if len(s.bad_words) > MAX_BAD_WORDS or any(len(w.ids) > MAX_BAD_WORD_TOKENS for w in s.bad_words):
        raise ValueError(f"bad_words: at most {MAX_BAD_WORDS} words of at most {MAX_BAD_WORD_TOKENS} tokens")
    for name, ids in (
        ("logit_bias", s.logit_bias.keys()),
        ("allowed_token_ids", s.allowed_token_ids),
        ("bad_words", [t for w in s.bad_words for t in w.ids]),
    ):
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name} has a token id outside [0, {vocab}): {bad[0]}")


def _check_prompt(req: verifier_pb2.GenerateRequest, cfg: VerifierConfig, vocab_size: int) -> None:
    if len(req.request_id) > MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
    if not req.input_ids:
        raise ValueError("input_ids is empty: a prompt needs at least one token")
    if len(req.input_ids) > cfg.max_context:
        raise ValueError(f"prompt has {len(req.input_ids)} tokens, the maximum context is {cfg.max_context}")
    bad = [t for t in req.input_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"input_ids has {len(bad)} token ids outside [0, {vocab_size}), first {bad[0]}")
    if req.max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be >= 1, got {req.max_new_tokens}")
    if req.max_new_tokens > cfg.max_new_tokens_limit:
        raise ValueError(f"max_new_tokens {req.max_new_tokens} is above the limit {cfg.max_new_tokens_limit}")
    if len(req.input_ids) + req.max_new_tokens > cfg.max_context:
        raise ValueError(
            f"prompt ({len(req.input_ids)}) + max_new_tokens ({req.max_new_tokens}) exceeds "
            f"the maximum context {cfg.max_context}"
        )
    bad_stop = [t for t in req.stop_token_ids if not 0 <= t < vocab_size]
    if bad_stop:
        raise ValueError(f"stop_token_ids has an id outside [0, {vocab_size}): {bad_stop[0]}")


def generate_params(
    req: verifier_pb2.GenerateRequest,
    cfg: VerifierConfig,
    vocab_size: int,
    eos_token_ids: tuple[int, ...],
    max_budget: int | None,
) -> GenerateParams:
    """The request's GenerateParams. `max_budget`: the drafter's tree budget cap (None: no drafter)."""
    _check_prompt(req, cfg, vocab_size)
    sampling = sampling_config(req.sampling, vocab_size)
    if sampling.min_tokens > req.max_new_tokens:
        raise ValueError(f"sampling.min_tokens {sampling.min_tokens} is above max_new_tokens {req.max_new_tokens}")
    budget = _checked(PARAMS["budget"], req.spec.budget, "spec.budget") or cfg.default_budget
    if max_budget is not None and budget > max_budget:
        raise ValueError(f"spec.budget {budget} is above the drafter's maximum {max_budget}")
    use_spec = max_budget is not None and not req.spec.no_spec and budget > 0
    stops = set(req.stop_token_ids) | (set() if req.ignore_eos else set(eos_token_ids))
    numbers = {p.name: _checked(p, _value(req, p), p.name) for p in sent_to(REQUEST) if p.kind is not bool}
    return GenerateParams(
        request_id=req.request_id or uuid.uuid4().hex,
        input_ids=tuple(req.input_ids),
        sampling=sampling,
        max_new_tokens=req.max_new_tokens,
        stop_token_ids=frozenset(stops),
        use_spec=use_spec,
        budget=budget if use_spec else 0,
        chain=use_spec and req.spec.chain,
        grammar=req.grammar,
        **numbers,  # top_logprobs, prompt_logprobs
    )

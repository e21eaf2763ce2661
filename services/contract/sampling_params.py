"""A request's sampling parameters, validated (the verifier's `GenerateRequest.sampling`, in Python)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from ddtree.contract.request_params import (
    MAX_LOGIT_BIAS,
    MAX_PENALTY,
    MAX_TOP_LOGPROBS,
    PARAMS,
    SAMPLING,
    Param,
    sent_to,
)

__all__ = ["MAX_LOGIT_BIAS", "MAX_PENALTY", "MAX_TOP_LOGPROBS", "SamplingConfig"]

SAMPLER_FIELDS = ("temperature", "top_p", "top_k", "seed", "min_p", "min_tokens")  # what sampling.py reads


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    top_k: int = 0  # 0 = off
    seed: int | None = None  # per-request seed; see make_generator
    min_p: float = 0.0  # keep tokens with p >= min_p * max p (after temperature); 0 = off
    min_tokens: int = 0  # the request's stop ids cannot be chosen for output tokens 0..min_tokens-1
    # Penalties and logit masks (verifier/constraints/penalties.py; vLLM's formulas): counts are of the output so far.
    repetition_penalty: float = 1.0  # > 0; tokens in the prompt or output: logit / it if > 0, else * it
    presence_penalty: float = 0.0  # in [-2, 2]: minus this for every token in the output
    frequency_penalty: float = 0.0  # in [-2, 2]: minus this times the token's count in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) pairs, ids distinct
    allowed_token_ids: tuple[int, ...] = ()  # non-empty: every other token is masked
    bad_words: tuple[tuple[int, ...], ...] = ()  # token-id words: the last id is masked after the others

    @property
    def penalizes(self) -> bool:
        """Counts of the output (and the prompt, for repetition_penalty) change the logits."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Any penalty, bias or mask: the choice needs full logits (the greedy walk shortcut reads raw argmaxes)."""
        return self.penalizes or bool(self.logit_bias or self.allowed_token_ids or self.bad_words)

    def validate(self) -> None:
        """Every field: the table's rows by their ranges (request_params.PARAMS), then the logit masks (the
        verifier checks token ids against its vocabulary itself)."""
        for p in sent_to(SAMPLING):
            _check(p, getattr(self, p.name), p.name in _OPTIONAL)
        ids = [t for t, _ in self.logit_bias]
        if len(set(ids)) != len(ids) or any(not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError("logit_bias token ids must be distinct integers >= 0")
        if any(
            not isinstance(b, (int, float)) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for _, b in self.logit_bias
        ):
            raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids):
            raise ValueError("allowed_token_ids must be integers >= 0")
        for word in self.bad_words:
            if not word or any(not isinstance(t, int) or t < 0 for t in word):
                raise ValueError(f"bad_words entries must be non-empty lists of token ids >= 0, got {list(word)!r}")

    def validate_sampler(self) -> None:
        """The fields the sampler reads (sampling.py checks them on every call: cheap)."""
        for name in SAMPLER_FIELDS:
            _check(PARAMS[name], getattr(self, name), name in _OPTIONAL)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


_OPTIONAL = frozenset(f.name for f in fields(SamplingConfig) if f.default is None)  # None = unset (seed)


def _check(p: Param, value, optional: bool) -> None:
    """A field in its row's range, in the verifier's wording: "top_k must be an integer >= 0, got -1",
    "repetition_penalty must be a finite number > 0, got -1.0"; an optional field may be None (unset)."""
    if value is None and optional:
        return
    if p.kind is int:
        if isinstance(value, bool) or not isinstance(value, int) or not p.contains(value):
            raise ValueError(f"{p.name} must be an integer {p.phrase(wire=True)}, got {value!r}")
    elif not isinstance(value, (int, float)) or isinstance(value, bool) or not p.contains(value):
        finite = p.hi is not None and math.isinf(p.hi) and not p.says
        phrase = f"a finite number {p.phrase(wire=False)}" if finite else p.phrase(wire=False)
        raise ValueError(f"{p.name} must be {phrase}, got {value!r}")

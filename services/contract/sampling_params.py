"""A request's sampling parameters, validated (the verifier's `GenerateRequest.sampling`, in Python)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ddtree.contract.request_params import MAX_LOGIT_BIAS, MAX_PENALTY, MAX_TOP_LOGPROBS

__all__ = ["MAX_LOGIT_BIAS", "MAX_PENALTY", "MAX_TOP_LOGPROBS", "SamplingConfig"]


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    top_k: int = 0  # 0 = off
    seed: int | None = None  # per-request seed; see make_generator
    min_p: float = 0.0  # keep tokens with p >= min_p * max p (after temperature); 0 = off
    min_tokens: int = 0  # the request's stop ids cannot be chosen for output tokens 0..min_tokens-1
    # Penalties and logit masks (verifier/penalties.py; vLLM's formulas): counts are of the output so far.
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
        """Every field (the verifier checks token ids against its vocabulary itself)."""
        self.validate_sampler()
        r = self.repetition_penalty
        if not isinstance(r, (int, float)) or not math.isfinite(r) or r <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {r!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v!r}")
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
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or math.isinf(t):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

"""A request's sampling parameters, validated (the verifier's `GenerateRequest.sampling`, in Python)."""

from __future__ import annotations

from dataclasses import dataclass

from ddtree.contract.request_params import MAX_LOGIT_BIAS, MAX_PENALTY, MAX_TOP_LOGPROBS, PARAMS

__all__ = ["MAX_LOGIT_BIAS", "MAX_PENALTY", "MAX_TOP_LOGPROBS", "SamplingConfig"]


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
        """Every field (the verifier checks token ids against its vocabulary itself)."""
        self.validate_sampler()
        r = self.repetition_penalty
        if not _number(r) or not PARAMS["repetition_penalty"].contains(r):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {r!r}")
        _check("presence_penalty", self.presence_penalty)
        _check("frequency_penalty", self.frequency_penalty)
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
        _check("temperature", self.temperature)
        _check("top_p", self.top_p)
        for name in ("top_k", "min_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not PARAMS[name].contains(v):
                raise ValueError(f"{name} must be an integer {PARAMS[name].phrase(wire=True)}, got {v!r}")
        _check("min_p", self.min_p)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _number(v) -> bool:
    return isinstance(v, (int, float))


def _check(name: str, value) -> None:
    """A number in its range as request_params.PARAMS defines it, in this module's wording."""
    p = PARAMS[name]
    if not _number(value) or not p.contains(value):
        raise ValueError(f"{name} must be {p.phrase(wire=False)}, got {value!r}")

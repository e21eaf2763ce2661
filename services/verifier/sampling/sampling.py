"""Target token choice per tree node: argmax at temperature 0, else one sample per row.

Why "sample at every node and walk" is exact (docs/design.md §3.7):
  The tree is a deterministic function of the drafter's output (top-K marginals, nothing sampled on
  the draft side), so it is independent of the target's draws. Row i's sample is drawn from the
  target's (filtered) conditional p(. | prefix, path(i)), independently of every other row. The walk
  (accept.py) commits the token sampled at the current node and moves to the child carrying it, if
  any; the next committed token is then the sample drawn at that child, i.e. a draw from
  p(. | prefix, path). By induction every committed token and the bonus are draws from the target's
  conditional given exactly the committed prefix, so the output has the target's distribution. No
  min(1, p/q) ratio is involved: there is no draft distribution q to correct for, and applying the
  Leviathan rule to top-K candidates would bias the output. Temperature 0 is the limit where every
  draw is the argmax, which makes the output identical to greedy autoregressive decoding.

Filtering order (as vLLM): logits / T, then min_p (a token stays when p >= min_p * max p; the ratio
does not change under top_k's renormalization, so min_p and top_k commute), then top_k, then top_p on
the renormalized distribution of what is left, then renormalize. min_p never changes the argmax.

min_tokens (vLLM's MinTokensLogitsProcessor): `mask_stop_tokens` sets the request's stop ids to -inf
in the rows whose choice would be an output token before min_tokens; it runs before the argmax or the
sample, at temperature 0 too. Row i of a tree chooses output token `generated + depth(i)`, so the mask
is per row by depth, and the walk still commits only target choices: output equals masked AR decoding.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from ddtree.contract.sampling_params import SamplingConfig


def make_generator(cfg: SamplingConfig, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded from cfg.seed, or None (global RNG) when no seed is set.

    Create it ONCE per request and pass it to every step's target_choices: a fresh generator per step
    would repeat the same draws.
    """
    if cfg.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(cfg.seed)


def sampling_probs(logits: Tensor, cfg: SamplingConfig) -> Tensor:
    """The distribution sampled from at temperature > 0: fp32 [N, V], rows sum to 1.

    top_k keeps every token whose scaled logit is >= the k-th largest (ties at the boundary are all
    kept). top_p keeps the smallest set of highest-probability tokens whose mass >= top_p: a token is
    kept iff the mass of the tokens sorted strictly before it is < top_p.
    """
    cfg.validate_sampler()
    if cfg.greedy:
        raise ValueError("sampling_probs needs temperature > 0 (temperature 0 is argmax)")
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    scores = logits.float() / cfg.temperature  # [N, V]
    vocab = scores.shape[-1]
    if cfg.min_p > 0.0:
        # p_i >= min_p * p_max  <=>  s_i >= s_max + log(min_p) (no softmax needed; -inf rows stay -inf)
        floor = scores.max(dim=-1, keepdim=True).values + math.log(cfg.min_p)  # [N, 1]
        scores = scores.masked_fill(scores < floor, float("-inf"))
    if 0 < cfg.top_k < vocab:
        kth = torch.topk(scores, cfg.top_k, dim=-1).values[:, -1:]  # [N, 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [N, V]
    if cfg.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)  # [N, V]
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p  # [N, V]
        keep_sorted = mass_before < cfg.top_p  # the first entry is always kept
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def target_choices(logits: Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None) -> Tensor:
    """logits [N, V] (one row per tree node) -> LongTensor [N] of chosen tokens.

    Temperature 0: argmax per row (top_k / top_p do not change the argmax). Otherwise one independent
    sample per row from sampling_probs, using the exponential-race trick: argmax_i p_i / E_i with
    E_i ~ Exp(1) i.i.d. picks i with probability p_i (it is Gumbel-max in disguise) and needs no host
    sync. Deterministic given the generator's state.
    """
    cfg.validate_sampler()
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    if cfg.greedy:
        return logits.argmax(dim=-1)
    if generator is not None and generator.device.type != logits.device.type:
        raise ValueError(
            f"generator is on {generator.device} but logits are on {logits.device}; "
            f"create it with make_generator(cfg, logits.device)"
        )
    probs = sampling_probs(logits, cfg)  # [N, V]
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)  # [N, V]
    # NOTE: an exact 0 draw would make 0/0 = NaN win the argmax for a zero-probability token.
    race.clamp_min_(torch.finfo(race.dtype).tiny)
    return (probs / race).argmax(dim=-1)


def stop_mask_rows(min_tokens: int, generated: int, depths: Sequence[int]) -> list[int]:
    """The rows (row r chooses output token `generated + depths[r]`) where stop ids are masked for
    min_tokens: those whose output token index is < min_tokens."""
    return [r for r, d in enumerate(depths) if generated + d < min_tokens]


def mask_stop_tokens(logits: Tensor, rows: Sequence[int], stop_ids: Iterable[int]) -> Tensor:
    """logits [N, V] with the stop ids set to -inf in `rows` (a new tensor; the input is untouched)."""
    ids = sorted(i for i in stop_ids if 0 <= i < logits.shape[-1])
    if not rows or not ids:
        return logits
    out = logits.clone()
    r = torch.tensor(list(rows), dtype=torch.int64, device=logits.device)
    c = torch.tensor(ids, dtype=torch.int64, device=logits.device)
    out[r.unsqueeze(1), c.unsqueeze(0)] = float("-inf")
    return out

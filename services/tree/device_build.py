"""The best-first tree build with tensor ops, for every sequence of a Draft call at once, on the drafter's
device: the trees of best_first.py `build_tree` (the reference, and the host's build), read to the host once.

The tree of budget b is the b best prefixes by (-score, rank tuple), a prefix's score being the float sum,
left to right, of its tokens' log-probs; its nodes in that order (the heap's pop order). Every ancestor of a
chosen prefix is chosen and comes first (log-probs are <= 0, and a prefix sorts before its extensions). So a
beam per depth finds them: depth 1 keeps its b best ranks, depth d the b best children of depth d - 1's
beam, each beam sorted by (-score, rank tuple); a chosen prefix of depth d has its parent in beam d - 1 and
is among the b best of its candidates. The chosen prefixes are then the b best of all beams. Only ranks
below b matter (a prefix with rank r at some depth has at least r better siblings), so sequences with
different budgets share one table width and take their first b of one order.

Numerics: scores are summed in float64 from the fp32 log-probs, as the reference sums Python floats, so
they are bit-identical; ties are broken by the rank tuple exactly (stable sorts, one per depth digit).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree.contract.token_tree import TokenTree


def build_trees(logprobs: Tensor, token_ids: Tensor, budgets: list[int]) -> list[TokenTree]:
    """logprobs fp32 [S, D, K] (rows sorted descending, <= 0), token_ids int64 [S, D, K] (a checked table
    per sequence, as topk_logprobs makes it), budgets [S] -> sequence s's build_tree(logprobs[s],
    token_ids[s], budgets[s])."""
    S, D, K = logprobs.shape
    budget = max(budgets, default=0)
    if S == 0 or budget == 0 or D == 0 or K == 0:
        return [TokenTree() for _ in range(S)]
    dev = logprobs.device
    lp = logprobs.double()
    width = min(budget, K)
    # Beam of depth 1: the first `width` ranks (rows sorted: already in (-score, rank) order).
    score = lp[:, 0, :width]  # [S, W] float64
    ranks = torch.arange(width, device=dev).expand(S, 1, width).clone()  # [S, d, W]: the rank tuple per entry
    parent = torch.full((S, width), -1, dtype=torch.long, device=dev)  # index in the previous beam
    beams = [(score, ranks, parent)]
    for d in range(1, D):
        prev_score, prev_ranks, _ = beams[-1]
        P = prev_score.shape[1]
        cand = (prev_score[:, :, None] + lp[:, d, None, :width]).reshape(S, P * width)  # [S, P·W]
        # lexicographic rank tuple of a child = (its parent's place in rank-tuple order, its own rank)
        parent_lex = _lex_places(prev_ranks)  # [S, P]
        lexkey = (parent_lex[:, :, None] * width + torch.arange(width, device=dev)).reshape(S, P * width)
        keep = min(budget, P * width)
        order = _by_score_then(cand, lexkey)[:, :keep]  # [S, keep]
        src = order // width
        ranks = torch.cat([prev_ranks.gather(2, src[:, None, :].expand(S, d, keep)), (order % width)[:, None, :]], 1)
        beams.append((cand.gather(1, order), ranks, src))
    return _pick(beams, token_ids, budgets)


def _lex_places(ranks: Tensor) -> Tensor:
    """ranks int64 [S, d, P] (each entry's rank tuple) -> int64 [S, P]: each entry's place in rank-tuple order."""
    S, d, P = ranks.shape
    order = torch.arange(P, device=ranks.device).expand(S, P)
    for j in range(d - 1, -1, -1):  # least significant digit first, stable: lexicographic
        order = order.gather(1, torch.sort(ranks[:, j, :].gather(1, order), dim=1, stable=True).indices)
    return torch.empty_like(order).scatter_(1, order, torch.arange(P, device=ranks.device).expand(S, P))


def _by_score_then(score: Tensor, key: Tensor) -> Tensor:
    """[S, N] indices ordering each row by score descending, then key ascending."""
    by_key = torch.sort(key, dim=1, stable=True).indices
    return by_key.gather(1, torch.sort(score.gather(1, by_key), dim=1, descending=True, stable=True).indices)


def _pick(beams, token_ids: Tensor, budgets: list[int]) -> list[TokenTree]:
    """The best prefixes of all beams in (-score, rank tuple) order, as each sequence's tree."""
    S, D = token_ids.shape[0], len(beams)
    dev = token_ids.device
    sizes = [b[0].shape[1] for b in beams]
    score = torch.cat([b[0] for b in beams], 1)  # [S, N]
    # Rank tuples padded to D digits with -1 (a prefix sorts before its extensions), sorted digit by digit.
    digits = torch.cat([torch.nn.functional.pad(b[1], (0, 0, 0, D - b[1].shape[1]), value=-1) for b in beams], 2)
    N = score.shape[1]
    order = torch.arange(N, device=dev).expand(S, N)
    for j in range(D - 1, -1, -1):
        order = order.gather(1, torch.sort(digits[:, j, :].gather(1, order), dim=1, stable=True).indices)
    order = order.gather(1, torch.sort(score.gather(1, order), dim=1, descending=True, stable=True).indices)
    n = min(max(budgets), N)
    order = order[:, :n]  # [S, n] entries in node order
    place = torch.full((S, N), -1, dtype=torch.long, device=dev).scatter_(
        1, order, torch.arange(n, device=dev).expand(S, n)
    )
    offsets = torch.tensor([0, *sizes[:-1]], device=dev).cumsum(0)  # first entry of each beam
    depth_of = torch.repeat_interleave(torch.arange(D, device=dev), torch.tensor(sizes, device=dev), output_size=N)
    depth = depth_of[order]  # [S, n] 0-based
    parent_entry = torch.cat([b[2] for b in beams], 1).gather(1, order)  # index in the previous beam
    parent_global = torch.where(depth > 0, offsets[(depth - 1).clamp(min=0)] + parent_entry, 0)
    parent = torch.where(depth > 0, place.gather(1, parent_global) + 1, 0)
    own_rank = _last_digit(digits, order, depth)  # [S, n]
    tokens = token_ids[torch.arange(S, device=dev)[:, None], depth, own_rank]
    chosen = score.gather(1, order)  # [S, n] float64
    # The one host read: the scores travel as their float64 bit patterns beside the int64 ids.
    host = torch.stack([tokens, parent, depth + 1, chosen.view(torch.int64)], 0).cpu()
    packed = host[:3].tolist()
    scores = host[3].view(torch.float64).tolist()
    trees = []
    for s, b in enumerate(budgets):
        k = min(b, n)
        trees.append(
            TokenTree(tuple(packed[0][s][:k]), tuple(packed[1][s][:k]), tuple(packed[2][s][:k]), tuple(scores[s][:k]))
        )
    return trees


def _last_digit(digits: Tensor, order: Tensor, depth: Tensor) -> Tensor:
    """[S, n]: each chosen entry's own rank (digit `depth` of its rank tuple)."""
    per_entry = digits.gather(2, order[:, None, :].expand(-1, digits.shape[1], -1))  # [S, D, n]
    return per_entry.gather(1, depth[:, None, :]).squeeze(1)

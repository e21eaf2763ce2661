"""The best-first tree build over per-depth draft marginals (docs/design.md §4.1), and its input table.

Pure functions, no state. The drafter produces one row of logits per depth (slot d of the draft
block predicts depth d); `topk_logprobs` turns them into true log-probs of the K best tokens (a
`TokenTable`), and `build_tree` selects the `budget` highest-scoring prefixes, where a prefix's score
is the sum of its per-depth log-probs. Both services use it: the drafter builds every tree it returns,
and the verifier builds the tree of a sequence with a grammar from the drafter's table, keeping only
grammar-valid prefixes (`allowed`; grammar_build.py). `build_tree` checks its table
(check_table); `build_checked_tree` takes one that TokenTable.validate passed (the verifier checks each table
once, where the Draft RPC returns it).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ddtree.contract.token_tree import TokenTree

# The widest top-K table a Draft call may ask for (SeqDraft.table_width): 15 rows x 256 x 8 bytes = 30 KB per
# sequence on the wire, and the verifier's grammar build pops at most about (budget + 1) x K candidates.
MAX_TABLE_WIDTH = 256

# allowed(parent node index, token id) -> bool | LEAF: may this token follow the parent's path (parent 0 = the
# root)? False: no; True: yes; LEAF: yes, and nothing may follow it (a stop token: the answer ends there).
LEAF = 2  # truthy, and != True: a bool-answering predicate never gives it
Allowed = Callable[[int, int], int]


@dataclass(frozen=True)
class TokenTable:
    """A draft's top-K table (proto `TokenTable`): logprobs fp32 [D, K], each row sorted descending (true
    log-probs over the full vocabulary, so rows of different depths are comparable), token_ids int64 [D, K]
    (distinct per row). Row d holds the drafter's K best tokens for depth d + 1."""

    logprobs: Tensor
    token_ids: Tensor

    @property
    def depth(self) -> int:
        return self.logprobs.shape[0]

    @property
    def width(self) -> int:
        return self.logprobs.shape[1] if self.logprobs.dim() == 2 else 0

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the first broken invariant (check_table's, finite, ids < vocab_size). A table
        that passed is what `build_checked_tree` takes without checking it again."""
        _check_tensors(self.logprobs, self.token_ids)
        if not bool(torch.isfinite(self.logprobs).all()):
            raise ValueError("logprobs must be finite")
        if self.token_ids.numel() and int(self.token_ids.max()) >= vocab_size:
            raise ValueError(f"token_ids has an id outside [0, {vocab_size})")


def topk_logprobs(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-k true log-probs per row.

    logits [D, V] (any float dtype) -> (logprobs fp32 [D, k] sorted descending, token ids int64 [D, k]).
    The log-prob is logit - logsumexp(full row), computed in fp32, so scores of different depths are
    comparable (a top-k softmax would not be).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [D, V], got shape {tuple(logits.shape)}")
    vocab = logits.shape[1]
    if not 0 <= k <= vocab:
        raise ValueError(f"k must be in [0, {vocab}] (the vocab size), got {k}")
    # log_softmax, then top-k of it (the same order as top-k of the logits): on the CPU a fused
    # log_softmax is faster than logsumexp for these rows (docs/performance.md).
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [D, V]
    vals, ids = torch.topk(logprobs, k, dim=-1, largest=True, sorted=True)  # [D, k]
    return vals, ids


def check_table(logprobs: Tensor, token_ids: Tensor, budget: int) -> tuple[list[list[float]], list[list[int]]]:
    """Raise ValueError naming the first broken invariant of a build's input; else the table as lists."""
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    lpf, tid = _check_tensors(logprobs, token_ids)
    return lpf.tolist(), tid.tolist()


def _check_tensors(logprobs: Tensor, token_ids: Tensor) -> tuple[Tensor, Tensor]:
    """check_table's invariants of the table itself; the table as fp32 [D, K] and int64 [D, K] CPU tensors."""
    if logprobs.dim() != 2 or tuple(logprobs.shape) != tuple(token_ids.shape):
        raise ValueError(
            f"logprobs and token_ids must both be [D, K]; got {tuple(logprobs.shape)} and {tuple(token_ids.shape)}"
        )
    if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
        raise ValueError(f"token_ids must be an integer tensor, got {token_ids.dtype}")
    lpf = logprobs.detach().float().cpu()  # [D, K]
    tid = token_ids.detach().cpu().long()  # [D, K]
    if torch.isnan(lpf).any():
        raise ValueError(f"logprobs has NaN at {tuple(torch.nonzero(torch.isnan(lpf))[0].tolist())}")
    if (lpf > 0).any():
        raise ValueError(f"logprobs must be <= 0 (true log-probs); got {lpf.max().item()}")
    bad = lpf[:, 1:] > lpf[:, :-1]  # [D, K-1]
    if bad.any():
        d, r = torch.nonzero(bad)[0].tolist()
        raise ValueError(f"logprobs row {d} is not sorted descending at rank {r + 1}")
    if (tid < 0).any():
        raise ValueError(f"token_ids row {torch.nonzero(tid < 0)[0, 0].item()} has a negative id")
    srt = tid.sort(dim=-1).values
    dup = srt[:, 1:] == srt[:, :-1]
    if dup.any():
        raise ValueError(f"token_ids row {torch.nonzero(dup)[0, 0].item()} repeats a token")
    return lpf, tid


def build_tree(logprobs: Tensor, token_ids: Tensor, budget: int, allowed: Allowed | None = None) -> TokenTree:
    """Best-first DDTree build (docs/design.md §4.1).

    logprobs [D, K] fp32, rows sorted descending (depth d+1 uses row d); token_ids [D, K] int64.
    Returns the `budget` highest-scoring prefixes (fewer if the table has fewer), in pop order, with
    each node's score (TokenTree.scores; non-increasing, since every push scores <= its pop).

    A candidate is a rank tuple (r_1..r_d): the prefix taking the r_j-th best token at depth j.
    score = lp[0, r_1] + ... + lp[d-1, r_d]. Popping a candidate pushes at most two new ones:
      - its next sibling (same parent, rank + 1): score <= its own since rows are sorted;
      - its first child (rank 0 at depth + 1): score <= its own since log-probs are <= 0.
    Every prefix is reachable by exactly one such chain, so the heap pops all prefixes in
    non-increasing score, each after its parent and its better siblings. Equal scores are broken
    by the lexicographic rank tuple (a prefix sorts before its extensions), which makes the tree a
    deterministic function of the table and equal to "sort all prefixes by (-score, ranks), take
    the first `budget`".

    `allowed` (None = every token): a popped candidate whose token may not follow its parent is
    dropped: it is no node and gets no child candidate, but its next sibling is still pushed. A valid
    prefix (every token on it allowed) is still reached by its chain (the dropped siblings on the way
    push their next sibling), so the tree is the first `budget` valid prefixes in (-score, ranks)
    order: the budget goes to the best valid prefixes only. Call contract (what a stateful predicate
    may rely on): `allowed` is called exactly once per popped candidate, in pop order, and only while
    the tree has fewer than `budget` nodes; parent is always an existing node (0 = the root) that did
    not answer LEAF; a True answer makes that candidate the next node (index = nodes so far + 1), a LEAF
    answer too, but it gets no child candidate (its children would all be dropped: a stop token's
    answer has ended), so no later call has it as the parent.

    Raises ValueError naming the first broken invariant of the table (check_table); a table that passed
    TokenTable.validate goes to `build_checked_tree`, which does not check it again.

    NOTE: the score of a candidate is its parent's score + one log-prob (not "sibling score -
    lp[r] + lp[r+1]" as in the reference code); same value in exact arithmetic, but this keeps
    every score equal to the left-to-right float sum along its path.
    """
    lp, ids = check_table(logprobs, token_ids, budget)
    return _best_first(lp, ids, budget, allowed)


def build_checked_tree(table: TokenTable, budget: int, allowed: Allowed | None = None) -> TokenTree:
    """build_tree of a table that passed TokenTable.validate (the verifier checks every table once, where it
    comes back from the Draft RPC): the same tree, without checking the table again."""
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    return _best_first(table.logprobs.tolist(), table.token_ids.tolist(), budget, allowed)


def _best_first(lp: list[list[float]], ids: list[list[int]], budget: int, allowed: Allowed | None) -> TokenTree:
    """build_tree's heap walk over a checked table (lp [D][K] sorted descending, ids [D][K]), budget >= 0."""
    depth_max = len(lp)
    width = len(lp[0]) if depth_max else 0
    if budget == 0 or depth_max == 0 or width == 0:
        return TokenTree()

    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    # heap entry: (-score, ranks, parent node, depth, rank, parent score); ranks are unique per candidate,
    # so entries never compare past them.
    heap: list[tuple[float, tuple[int, ...], int, int, int, float]] = [(-lp[0][0], (0,), 0, 1, 0, 0.0)]
    cand = heapq.heappop(heap)
    while True:
        neg_score, ranks, parent, depth, rank, parent_score = cand
        tok = ids[depth - 1][rank]
        sibling = None
        if rank + 1 < width:
            s = parent_score + lp[depth - 1][rank + 1]
            sibling = (-s, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, parent_score)
        verdict = True if allowed is None else allowed(parent, tok)
        if not verdict:
            if sibling is not None:  # the dropped candidate's place in the queue goes to its next sibling
                cand = heapq.heappushpop(heap, sibling)
                continue
        else:
            score = -neg_score
            tokens.append(tok)
            parents.append(parent)
            depths.append(depth)
            scores.append(score)
            if sibling is not None:
                heapq.heappush(heap, sibling)
            if depth < depth_max and verdict != LEAF:  # first child
                s = score + lp[depth][0]
                heapq.heappush(heap, (-s, ranks + (0,), len(tokens), depth + 1, 0, score))
        if not heap or len(tokens) >= budget:
            break
        cand = heapq.heappop(heap)
    return TokenTree(tuple(tokens), tuple(parents), tuple(depths), tuple(scores))

"""How the speculating sequences of one step share a cap on tree tokens (`--max-tree-tokens`).

On a device where every verified row costs time (a CPU), a step of many sequences verifies fewer
draft nodes per sequence: the trees of the n sequences drafted together, root + nodes each, must fit in
max_tree_tokens (0 = no cap). Every sequence keeps at least one node. Two rules, pure functions:

- `tree_budget`: the same share for everyone, max_tree_tokens // n - 1 nodes (how the trees are cut when
  the drafter gives no node scores);
- `allocate_nodes`: the drafter built every tree with the sequence's full budget and scored each node
  with its path log-prob s (TokenTree.scores). Under the drafter's own model a node is on the accepted
  path with probability exp(s), so the expected accepted drafts of a step are the sum of exp(s) over the
  verified nodes. Taking the best-scoring nodes over the whole batch maximises that sum for the cap: a
  confident sequence lends nodes to an uncertain one. Scores fall along each tree's node order, so the
  best nodes of a tree are its first ones, and keeping the first k_i nodes of tree i (TokenTree.prefix)
  is exactly the tree its drafter would have built with budget k_i.

- `cost_cut` (`--tree-cut cost`): every node verified costs step time (step_cost.py estimates how much,
  more at long context), so the best tree is not the biggest one: it keeps the nodes that raise the step's
  expected tokens per millisecond, G / T. With p a node's expected gain (its calibrated probability of
  acceptance) and m its cost, adding it raises G / T exactly when p / m > G / T. Within a tree p falls
  and m is constant, so the
  nodes are taken best ratio first over the batch until the best one left is below the running G / T;
  that is the optimum of G / T over all prefix cuts (Dinkelbach: the optimal set is every node whose
  ratio beats the optimal value), which the tests check by brute force. With a margin μ < 1 the nodes are
  taken while p / m > μ·G / T: every node the optimum keeps and those just under it (the verifier's
  step uses μ = 0.5, cut.CUT_MARGIN, because p and m are estimates).

None of these rules changes the output: the verifier decides every token; they only decide how many drafts each
step checks.
"""

from __future__ import annotations

import heapq
import math
from collections import abc


def tree_budget(requested: int, speculating: int, max_tree_tokens: int) -> int:
    """A sequence's tree budget this step: what it asked for, shrunk so that the trees of all `speculating`
    sequences (root + nodes each) fit in max_tree_tokens (0 = no limit), and at least one node."""
    if max_tree_tokens <= 0 or requested <= 0:
        return requested
    return max(1, min(requested, max_tree_tokens // speculating - 1))


def allocate_nodes(scores: abc.Sequence[abc.Sequence[float]], max_tree_tokens: int) -> list[int]:
    """scores[i]: tree i's node scores, non-increasing (one per node). Returns k_i, the nodes tree i keeps.

    Every tree with nodes keeps its first; the room left in max_tree_tokens after the roots (one row per
    tree) and those first nodes goes to the highest scores over all trees, ties to the lower tree index.
    0 = no cap: every tree keeps all its nodes."""
    sizes = [len(s) for s in scores]
    if max_tree_tokens <= 0:
        return sizes
    kept = [min(1, n) for n in sizes]
    room = max_tree_tokens - len(scores) - sum(kept)
    heap = [(-s[1], i) for i, s in enumerate(scores) if len(s) > 1]  # each tree's best node not yet kept
    heapq.heapify(heap)
    while room > 0 and heap:
        _, i = heapq.heappop(heap)
        kept[i] += 1
        room -= 1
        if kept[i] < sizes[i]:
            heapq.heappush(heap, (-scores[i][kept[i]], i))
    return kept


def cost_cut(
    gains: abc.Sequence[abc.Sequence[float]],
    node_ms: abc.Sequence[float],
    base_tokens: float,
    base_ms: float,
    margin: float = 1.0,
) -> list[int]:
    """The nodes each tree keeps to maximise expected tokens per ms of the step.

    gains[i]: tree i's nodes' expected accepted tokens, non-increasing in node order
    (step_cost.AcceptCalibration.gains); node_ms[i]: the cost of one node of tree i (ms, >= 0);
    base_tokens / base_ms: the step's tokens and time with no node at all (a bonus token per decoding
    sequence; the step's predicted time with roots only, > 0). Every tree with nodes keeps its first.
    margin in [0, 1]: a node is kept while its ratio beats margin x the running G / T (1 = the optimum;
    smaller keeps a superset, 0 every node with a gain)."""
    if not 0.0 <= margin <= 1.0:
        raise ValueError(f"margin must be in [0, 1], got {margin}")
    kept = [min(1, len(g)) for g in gains]
    tokens = base_tokens + sum(g[0] for g in gains if g)
    ms = base_ms + sum(m for g, m in zip(gains, node_ms) if g)
    heap = [(-_ratio(g[1], node_ms[i]), i) for i, g in enumerate(gains) if len(g) > 1]  # each tree's next node
    heapq.heapify(heap)
    while heap:
        neg_ratio, i = heap[0]
        # ratio <= margin·G / T: stop (at margin 1, this node and every later one would lower G / T)
        if -neg_ratio * ms <= margin * tokens:
            break
        heapq.heappop(heap)
        tokens += gains[i][kept[i]]
        ms += node_ms[i]
        kept[i] += 1
        if kept[i] < len(gains[i]):
            heapq.heappush(heap, (-_ratio(gains[i][kept[i]], node_ms[i]), i))
    return kept


def _ratio(gain: float, node_ms: float) -> float:
    """A node's expected tokens per ms; a free node (node_ms 0) is always worth verifying."""
    return gain / node_ms if node_ms > 0 else math.inf

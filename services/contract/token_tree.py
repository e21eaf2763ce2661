"""The token tree: what the drafter returns and the verifier verifies (proto `TokenTree`, Python here).

A tree is plain data with its invariants checked by `validate`; `ddtree.tree.build_tree` builds
one, `ddtree.verifier` masks, verifies and walks it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenTree:
    """Nodes 1..n in pop order; node 0 is the root (the last emitted token: the previous step's next_root) and is not stored.

    token_ids[i-1], parents[i-1], depths[i-1] describe node i. parents[i-1] is the parent's node index
    (0 = the root) and always < i, so ancestors precede descendants; depth(root) = 0 and
    depth(child) = depth(parent) + 1. Siblings carry distinct tokens (the accept walk keys children
    by token).

    scores[i-1], when the drafter gives them, is node i's path log-prob under the drafter (the sum of
    its per-depth log-probs from the root): non-increasing in node order for a best-first build, so the
    first k nodes are the k best prefixes. They steer how a capped batch shares tree tokens
    (services/tree/budget.py) and never affect which tokens are accepted; empty = not given.
    Trees compare equal by their nodes alone.
    """

    token_ids: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    depths: tuple[int, ...] = ()
    scores: tuple[float, ...] = field(default=(), compare=False)

    @property
    def n(self) -> int:
        """Number of non-root nodes."""
        return len(self.token_ids)

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    def validate(self) -> None:
        """Raise ValueError naming the first broken invariant."""
        n = len(self.token_ids)
        if len(self.parents) != n or len(self.depths) != n:
            raise ValueError(
                f"TokenTree lengths differ: {n} token_ids, {len(self.parents)} parents, {len(self.depths)} depths"
            )
        seen: set[tuple[int, int]] = set()  # (parent, token) pairs
        for i in range(1, n + 1):
            tok, parent, depth = self.token_ids[i - 1], self.parents[i - 1], self.depths[i - 1]
            if tok < 0:
                raise ValueError(f"TokenTree node {i}: negative token id {tok}")
            if parent < 0:
                raise ValueError(f"TokenTree node {i}: negative parent {parent}")
            if parent >= i:
                raise ValueError(f"TokenTree node {i}: parent {parent} >= own index {i}")
            parent_depth = 0 if parent == 0 else self.depths[parent - 1]
            if depth != parent_depth + 1:
                raise ValueError(f"TokenTree node {i}: depth {depth} != parent {parent} depth {parent_depth} + 1")
            if (parent, tok) in seen:
                raise ValueError(f"TokenTree node {i}: token {tok} repeats among children of node {parent}")
            seen.add((parent, tok))
        self.validate_scores()

    def validate_scores(self) -> None:
        """Raise ValueError when scores are given but not one finite log-prob per node, non-increasing."""
        n = len(self.token_ids)
        if self.scores:
            if len(self.scores) != n:
                raise ValueError(f"TokenTree has {len(self.scores)} scores for {n} nodes")
            if not all(math.isfinite(x) and x <= 0 for x in self.scores):
                raise ValueError("TokenTree scores must be finite log-probs (<= 0)")
            if any(b > a for a, b in zip(self.scores, self.scores[1:])):
                raise ValueError("TokenTree scores must be non-increasing in node order")

    def prefix(self, k: int) -> TokenTree:
        """The first k nodes (a valid tree: parents precede children). For a best-first build this is
        exactly the tree the same table gives with budget k."""
        if k >= self.n:
            return self
        return TokenTree(self.token_ids[:k], self.parents[:k], self.depths[:k], self.scores[:k])

    def child_maps(self) -> list[dict[int, int]]:
        """child_maps()[i] = {token: child node index} for node i in 0..n."""
        maps: list[dict[int, int]] = [{} for _ in range(self.n + 1)]
        for i, (tok, parent) in enumerate(zip(self.token_ids, self.parents), start=1):
            maps[parent][tok] = i
        return maps


EMPTY_TREE = TokenTree()  # no drafted nodes: the step verifies the root alone (an AR step)

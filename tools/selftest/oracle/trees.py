"""The oracle's trees: a chain along the true continuation broken at a random depth, plus wrong siblings.

Noise, per tree, from the caller's RNG: the chain breaks at depth b drawn uniformly from 1..D+1 (b = D+1:
the whole chain is right); with probability 1/3 the right token at depth b is also present as a later
sibling; the remaining budget goes to wrong siblings at random depths. The tests' oracle drafter and
`ddtree selftest gpu`'s replay drafter build their trees here, so the acceptance they drive is known
(`expected_accept_length`).
"""

from __future__ import annotations

import random

from ddtree.contract.token_tree import TokenTree


def noisy_tree(truth: list[int], budget: int, vocab_size: int, rng: random.Random) -> TokenTree:
    """A chain along `truth` broken at a random depth, plus siblings, within `budget` nodes."""
    depth = min(len(truth), budget)
    if depth == 0:
        return TokenTree((), (), ())
    brk = rng.randint(1, depth + 1)

    def wrong(d: int, avoid: set[int]) -> int:
        while True:
            t = rng.randrange(vocab_size)
            if t != truth[d - 1] and t not in avoid:
                return t

    tokens, parents, depths = [], [], []
    children: dict[int, set[int]] = {}
    for d in range(1, depth + 1):
        tok = truth[d - 1] if d != brk else wrong(d, set())
        tokens.append(tok)
        parents.append(d - 1)
        depths.append(d)
        children.setdefault(d - 1, set()).add(tok)
    if brk <= depth and len(tokens) < budget and rng.random() < 1 / 3:
        tokens.append(truth[brk - 1])
        parents.append(brk - 1)
        depths.append(brk)
        children[brk - 1].add(truth[brk - 1])
    while len(tokens) < budget and len(tokens) < 4 * depth:
        d = rng.randint(1, depth)
        tok = wrong(d, children.setdefault(d - 1, set()))
        tokens.append(tok)
        parents.append(d - 1)
        depths.append(d)
        children[d - 1].add(tok)
    return TokenTree(tuple(tokens), tuple(parents), tuple(depths))


def expected_accept_length(depth: int = 7, budget: int = 16, trials: int = 5000, seed: int = 0) -> float:
    """Mean accepted drafts + 1 of noisy_tree over a reference that the target follows (Monte Carlo)."""
    rng = random.Random(seed)
    truth = list(range(1, depth + 1))
    total = 0
    for _ in range(trials):
        tree = noisy_tree(truth, budget, 1 << 20, rng)
        node, accepted = 0, 0  # walk from the root: the child holding the next true token
        while accepted < depth:
            nxt = next((i + 1 for i, (t, p) in enumerate(zip(tree.token_ids, tree.parents))
                        if p == node and t == truth[accepted]), None)  # fmt: skip
            if nxt is None:
                break
            node, accepted = nxt, accepted + 1
        total += accepted + 1
    return total / trials

"""The LM head along the accept walk gives exactly the verdict of the full-row argmax, reading fewer rows."""
from __future__ import annotations

import random

import pytest
import torch

from services.drafter.tree import TokenTree
from services.verifier.accept import accept
from services.verifier.greedy_head import NOT_READ, greedy_walk_choices

V, D = 12, 8


def _random_tree(rng: random.Random, n: int) -> TokenTree:
    tokens, parents, depths, used = [], [], [], {}
    for i in range(1, n + 1):
        parent = rng.randrange(0, i)
        free = [t for t in range(V) if t not in used.setdefault(parent, set())]
        tok = rng.choice(free)
        used[parent].add(tok)
        tokens.append(tok)
        parents.append(parent)
        depths.append(1 if parent == 0 else depths[parent - 1] + 1)
    return TokenTree(tuple(tokens), tuple(parents), tuple(depths))


def test_walk_matches_full_argmax_verdicts():
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    head = torch.randn(V, D, generator=g)
    calls = []

    def lm_head(rows):
        calls.append(rows.shape[0])
        return rows @ head.T

    for trial in range(200):
        trees = [_random_tree(rng, rng.randrange(0, 12)) for _ in range(rng.randrange(1, 5))]
        # Steer the hidden rows so that walks go deep: row i's argmax is often a child's token.
        hidden = []
        for tree in trees:
            h = torch.randn(tree.n + 1, D, generator=g)
            for i, kids in enumerate(tree.child_maps()):
                if kids and rng.random() < 0.7:
                    h[i] = head[rng.choice(list(kids))] * 3 + 0.01 * h[i]
            hidden.append(h)
        calls.clear()
        lazy = greedy_walk_choices(trees, hidden, lm_head)
        for tree, h, got in zip(trees, hidden, lazy):
            full = (h @ head.T).argmax(dim=-1)
            want = accept(tree, 5, full)
            assert accept(tree, 5, got) == want
            read = [i for i in range(tree.n + 1) if got[i] != NOT_READ]
            assert read == list(want.accepted_nodes), "only the walked nodes are read"
            assert all(got[i] == full[i] for i in read)
        assert len(calls) == max(len(accept(t, 5, (h @ head.T).argmax(-1)).accepted_nodes)
                                 for t, h in zip(trees, hidden))
        assert sum(calls) == sum(len(accept(t, 5, (h @ head.T).argmax(-1)).accepted_nodes)
                                 for t, h in zip(trees, hidden))


def test_shape_errors():
    tree = TokenTree((1,), (0,), (1,))
    with pytest.raises(ValueError, match="expected \\[2, d\\]"):
        greedy_walk_choices([tree], [torch.zeros(3, D)], lambda r: r)
    with pytest.raises(ValueError, match="1 trees but 0"):
        greedy_walk_choices([tree], [], lambda r: r)

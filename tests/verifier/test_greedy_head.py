"""The LM head along the accept walk gives exactly the verdict of the full-row argmax, reading fewer rows."""

from __future__ import annotations

import random

import pytest
import torch

from ddtree.contract.token_tree import TokenTree
from ddtree.verifier.sampling.accept import accept
from ddtree.verifier.sampling.greedy_head import NOT_READ, greedy_walk_choices

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
    calls, seen = [], []

    def lm_head(rows):
        calls.append(rows.shape[0])
        seen.extend(tuple(r) for r in rows.tolist())
        return rows @ head.T

    for _trial in range(200):
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
        seen.clear()
        lazy = greedy_walk_choices(trees, hidden, lm_head)
        for tree, h, got in zip(trees, hidden, lazy):
            full = (h @ head.T).argmax(dim=-1)
            want = accept(tree, 5, full)
            assert accept(tree, 5, got) == want
            read = [i for i in range(tree.n + 1) if got[i] != NOT_READ]
            assert read == list(want.accepted_nodes), "only the walked nodes are read"
            assert all(got[i] == full[i] for i in read)
        # Rounds: one, plus one each time a walk leaves its primary chain (moves to a child that is not
        # its parent's lowest-index child). Rows: the primary chains from each round's start, each once.
        rounds, rows = [], 0
        for t, h in zip(trees, hidden):
            nodes = accept(t, 5, (h @ head.T).argmax(-1)).accepted_nodes
            first = _first_children_brute(t)
            starts = [0] + [b for a, b in zip(nodes, nodes[1:]) if first[a] != b]
            rounds.append(len(starts))
            rows += sum(len(_chain_brute(first, s)) for s in starts)
        assert len(seen) == len(set(seen)), "a row went through the LM head twice"
        assert len(calls) == max(rounds)
        assert sum(calls) == rows <= sum(t.n + 1 for t in trees)


def _first_children_brute(tree: TokenTree) -> list[int]:
    return [min((j for j in range(1, tree.n + 1) if tree.parents[j - 1] == i), default=-1) for i in range(tree.n + 1)]


def _chain_brute(first: list[int], node: int) -> list[int]:
    return [node] + (_chain_brute(first, first[node]) if first[node] >= 0 else [])


def test_a_walk_along_first_children_takes_one_round():
    """A chain tree whose every node the target agrees with: one LM-head call over the whole chain."""
    tree = TokenTree((3, 4, 5), (0, 1, 2), (1, 2, 3))
    head = torch.zeros(V, D)
    head[:D, :D] = torch.eye(D)  # token t < D has logit hidden[t]
    hidden = torch.zeros(4, D)
    for row, tok in enumerate((3, 4, 5, 7)):  # root -> 3 -> 4 -> 5, bonus 7
        hidden[row, tok] = 1.0
    calls = []
    got = greedy_walk_choices([tree], [hidden], lambda r: calls.append(r.shape[0]) or r @ head.T)
    assert calls == [4]
    assert got[0].tolist() == [3, 4, 5, 7]


def test_shape_errors():
    tree = TokenTree((1,), (0,), (1,))
    with pytest.raises(ValueError, match="expected \\[2, d\\]"):
        greedy_walk_choices([tree], [torch.zeros(3, D)], lambda r: r)
    with pytest.raises(ValueError, match="1 trees but 0"):
        greedy_walk_choices([tree], [], lambda r: r)

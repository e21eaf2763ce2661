"""The drafter's batched tensor-op tree build (tree/device_build.py) equals the reference best-first build
(tree/best_first.build_tree) node for node, scores bit for bit: random tables, tables full of ties
(log-probs on a coarse grid), budgets 1..64, several sequences with different budgets in one call."""

from __future__ import annotations

import random

import pytest
import torch

from ddtree.tree.best_first import build_tree
from ddtree.tree.device_build import build_trees


def _table(rng: random.Random, depth: int, width: int, ties: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A checked table: rows sorted descending, <= 0, distinct ids per row."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    if ties:  # few distinct values: many equal scores, the rank tuples decide
        lp = -torch.randint(0, 4, (depth, width), generator=g).float() * 0.5
    else:
        lp = torch.log_softmax(torch.randn(depth, 500, generator=g) * 3, -1)[:, :width]
    lp = lp.sort(dim=-1, descending=True).values
    ids = torch.stack([torch.randperm(1000, generator=g)[:width] for _ in range(depth)])
    return lp, ids


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
def test_equals_the_reference_build_for_budgets_1_to_64(ties):
    rng = random.Random(7 if ties else 3)
    for budget in range(1, 65):
        depth, width = rng.randint(1, 15), min(budget, 64)
        lp, ids = _table(rng, depth, width, ties)
        (got,) = build_trees(lp[None], ids[None], [budget])
        want = build_tree(lp, ids, budget)
        assert got == want, f"budget {budget}, depth {depth}, width {width}"


def test_one_call_for_sequences_of_different_budgets():
    rng = random.Random(11)
    budgets = [1, 5, 16, 64, 0, 33]
    tables = [_table(rng, 7, 64, ties=i % 2 == 1) for i in range(len(budgets))]
    lp, ids = torch.stack([t[0] for t in tables]), torch.stack([t[1] for t in tables])
    got = build_trees(lp, ids, budgets)
    for (t_lp, t_ids), b, tree in zip(tables, budgets, got):
        assert tree == build_tree(t_lp, t_ids, b)


def test_small_tables_give_every_prefix():
    lp = torch.tensor([[-0.1, -2.0], [-0.5, -0.7]])
    ids = torch.tensor([[3, 4], [5, 6]])
    (tree,) = build_trees(lp[None], ids[None], [50])
    assert tree == build_tree(lp, ids, 50) and tree.n == 6  # 2 + 4 prefixes

"""--max-tree-tokens: under load each sequence's tree shrinks so the batch's tree tokens fit the cap; the
output stays exactly the AR output. The batch shares the cap by the drafter's node scores when it gives
them (allocate_nodes, against a brute force), else equally (tree_budget)."""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import math
import random

import pytest

from ddtree.tree.budget import allocate_nodes, tree_budget
from tests.support.paths import ORACLE_DRAFTER
from tests.support.stack_calls import generate

CAP = 24


def test_tree_budget_arithmetic():
    assert tree_budget(16, 1, 0) == 16 and tree_budget(16, 8, 0) == 16  # no cap
    assert tree_budget(16, 1, 64) == 16  # 17 tree tokens fit
    assert tree_budget(16, 4, 64) == 15 and tree_budget(16, 8, 64) == 7
    assert tree_budget(16, 30, 64) == 1  # never below one node
    assert tree_budget(0, 8, 64) == 0


def _expected_drafts(scores, kept) -> float:
    """Expected accepted drafts under the drafter's model: sum of exp(score) over the kept nodes."""
    return sum(math.exp(x) for s, k in zip(scores, kept) for x in s[:k])


def _brute_best(scores, cap) -> float:
    """Best expected drafts over every allocation that keeps each tree's first node and fits the cap."""
    floors = [min(1, len(s)) for s in scores]
    room = max(cap - len(scores) - sum(floors), 0)
    best = -1.0
    for kept in itertools.product(*[range(f, len(s) + 1) for f, s in zip(floors, scores)]):
        if sum(kept) - sum(floors) <= room:
            best = max(best, _expected_drafts(scores, kept))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_allocate_nodes_matches_brute_force(seed):
    rng = random.Random(seed)
    trees = rng.randint(1, 4)
    scores = [sorted((-rng.expovariate(0.7) for _ in range(rng.randint(0, 5))), reverse=True) for _ in range(trees)]
    if seed % 5 == 0:  # exact ties across trees
        scores = [[round(x) for x in s] for s in scores]
    cap = rng.randint(0, 4 * trees + 12)
    kept = allocate_nodes(scores, cap)
    sizes = [len(s) for s in scores]
    if cap == 0:
        assert kept == sizes
        return
    assert all(min(1, n) <= k <= n for k, n in zip(kept, sizes))
    floors = sum(min(1, n) for n in sizes)
    assert sum(kept) == min(sum(sizes), max(cap - trees, floors))  # the cap is filled, never passed beyond floors
    assert math.isclose(_expected_drafts(scores, kept), _brute_best(scores, cap), rel_tol=1e-12)


def test_allocate_nodes_lends_nodes_to_the_uncertain_tree():
    confident = [-0.01, -0.02, -0.03, -5.0, -5.1, -5.2]  # a sure chain, then long shots
    uncertain = [-0.7, -0.8, -0.9, -1.0, -1.1, -1.2]
    assert allocate_nodes([confident, uncertain], 2 + 8) == [3, 5]
    assert allocate_nodes([confident, uncertain], 1) == [1, 1]  # never below one node
    assert allocate_nodes([[], uncertain], 5) == [0, 3]  # an empty tree costs its root row only


def _ar_then_concurrent(ckpt, tmp_path, texts, max_new, drafter_args=(), drafter_module="ddtree.cli"):
    """On one capped stack: each prompt alone with AR, then all four at once with DDTree (budget 16).
    Returns (AR tokens per prompt, (tokens, step records) per concurrent run)."""
    from ddtree.launcher import start_stack
    from ddtree.tokenization.tokenizer import Tokenizer

    tok = Tokenizer(ckpt.target)
    prompts = [tok.encode(t) for t in texts]
    with start_stack(
        str(ckpt.target),
        str(ckpt.drafter),
        tmp_path,
        drafter_args=drafter_args,
        drafter_module=drafter_module,
        verifier_args=("--max-tree-tokens", str(CAP), "--max-batch", "4"),
    ) as stack:
        ar = [generate(stack.verifier, ids, no_spec=True, max_new=max_new)[0] for ids in prompts]
        with cf.ThreadPoolExecutor(4) as pool:
            runs = list(
                pool.map(
                    lambda ids: generate(stack.verifier, ids, no_spec=False, budget=16, max_new=max_new)[:2], prompts
                )
            )
    return ar, runs


def test_capped_trees_are_lossless(default_ckpt, tmp_path):
    """The oracle drafter gives no node scores: equal shares."""
    ar, runs = _ar_then_concurrent(
        default_ckpt,
        tmp_path,
        [f"def function_{i}(x):\n    return x * {i} + " for i in range(4)],
        48,
        drafter_args=("--oracle-seed", "7"),
        drafter_module=ORACLE_DRAFTER,
    )
    assert [r[0] for r in runs] == ar
    nodes = [s.tree_nodes for r in runs for s in r[1]]
    assert max(nodes) <= CAP - 1  # a sequence alone: at most cap - 1 nodes
    # with four running, at most cap // 4 - 1 = 5 nodes each: most steps of these concurrent streams
    assert sum(n <= CAP // 4 - 1 for n in nodes) >= len(nodes) // 2, nodes
    assert max(s.accept_length for r in runs for s in r[1]) > 1


def test_scored_trees_share_the_cap_and_stay_lossless(default_ckpt, tmp_path):
    """The DFlash drafter scores its nodes, so the capped batch is shared by score: tree sizes that equal
    shares never give, never more than the cap allows, the AR output."""
    ar, runs = _ar_then_concurrent(
        default_ckpt, tmp_path, [f"class Widget{i}:\n    def size(self):\n        return " for i in range(4)], 32
    )
    assert [r[0] for r in runs] == ar
    nodes = [s.tree_nodes for r in runs for s in r[1]]
    assert max(nodes) <= CAP - 1 and min(nodes) >= 1
    equal_shares = {tree_budget(16, n, CAP) for n in range(1, 5)}  # what equal parts would give: 16, 11, 7, 5
    assert set(nodes) - equal_shares, nodes  # shared by score

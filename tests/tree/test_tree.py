"""DDTree build (`ddtree.tree.best_first`: services/tree/best_first.py, the drafter's and the verifier's
one copy) and tree mask / positions (services/verifier/step/tree_mask.py)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import pytest
import torch

from ddtree.contract.token_tree import TokenTree
from ddtree.tree.best_first import LEAF, TokenTable, build_checked_tree, build_tree, topk_logprobs
from ddtree.verifier.step.tree_mask import tree_input_ids, tree_mask, tree_positions
from tests.support.tree_tables import brute_force, node_paths, random_table


def node_scores(tree: TokenTree, lp: torch.Tensor, ids: torch.Tensor) -> list[float]:
    rank = [{t: r for r, t in enumerate(row)} for row in ids.tolist()]
    table = lp.tolist()
    out = []
    for path in node_paths(tree):
        s = 0.0
        for d, t in enumerate(path):
            s += table[d][rank[d][t]]
        out.append(s)
    return out


@dataclass(frozen=True)
class Case:
    name: str
    depth: int
    width: int
    budget: int
    vocab: int = 12
    quantize: float | None = None


CASES = [
    Case("empty_budget0", 3, 3, 0),
    Case("depth1", 1, 4, 3),
    Case("depth1_all", 1, 4, 10),
    Case("width1_chain", 5, 1, 3),
    Case("width1_chain_all", 5, 1, 9),
    Case("small", 3, 3, 7),
    Case("medium", 4, 3, 30),
    Case("budget_at_max", 3, 3, 3 + 9 + 27),
    Case("budget_over_max", 3, 2, 100),
    Case("ties", 4, 3, 40, vocab=6, quantize=1.0),
    Case("ties_heavy", 3, 4, 50, vocab=5, quantize=4.0),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_build_tree_matches_brute_force(case: Case, seed: int) -> None:
    lp, ids = random_table(case.depth, case.width, case.vocab, seed, case.quantize)
    tree = build_tree(lp, ids, case.budget)
    tree.validate()
    ref = brute_force(lp, ids, case.budget)
    assert tree.n == len(ref) == min(case.budget, sum(case.width**d for d in range(1, case.depth + 1)))
    # same prefixes, in the same order (pop order = sort by (-score, rank tuple))
    assert node_paths(tree) == [r[1] for r in ref]
    assert set(node_paths(tree)) == {r[1] for r in ref}
    scores = node_scores(tree, lp, ids)
    assert all(a >= b for a, b in zip(scores, scores[1:])), "pop order must be non-increasing in score"
    assert all(d <= case.depth for d in tree.depths)
    # the tree's own scores are the brute force's left-to-right path sums, exactly
    assert list(tree.scores) == [r[2] for r in ref]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_prefix_is_the_smaller_budget_tree(case: Case) -> None:
    """Cutting a best-first tree to its first k nodes gives the tree of budget k (what a capped batch
    relies on), scores included."""
    lp, ids = random_table(case.depth, case.width, case.vocab, 5, case.quantize)
    full = build_tree(lp, ids, case.budget)
    for k in range(full.n + 1):
        small = build_tree(lp, ids, k)
        cut = full.prefix(k)
        cut.validate()
        assert cut == small and cut.scores == small.scores


@pytest.mark.parametrize(
    "scores, msg",
    [
        ((-1.0,), "1 scores for 2 nodes"),
        ((-1.0, -0.5), "non-increasing"),
        ((-1.0, 0.5), "finite log-probs"),
        ((-1.0, float("nan")), "finite log-probs"),
    ],
)
def test_token_tree_rejects_bad_scores(scores, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        TokenTree((3, 4), (0, 1), (1, 2), scores).validate()
    assert TokenTree((3, 4), (0, 1), (1, 2), scores) == TokenTree((3, 4), (0, 1), (1, 2))  # nodes decide equality


def test_named_shapes() -> None:
    lp, ids = random_table(4, 3, 10, 0)
    assert build_tree(lp, ids, 0) == TokenTree()
    chain = build_tree(lp[:, :1], ids[:, :1], 10)
    assert chain.parents == (0, 1, 2, 3) and chain.depths == (1, 2, 3, 4)
    assert chain.token_ids == tuple(ids[:, 0].tolist())
    flat = build_tree(lp[:1], ids[:1], 10)
    assert flat.parents == (0, 0, 0) and flat.token_ids == tuple(ids[0].tolist())
    empty = build_tree(torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.long), 5)
    assert empty.n == 0


def test_tie_break_by_rank_tuple() -> None:
    # uniform marginals: all depth-1 nodes tie, then all depth-2 nodes; ranks decide the order
    lp = torch.full((2, 2), -0.6931471805599453)
    ids = torch.tensor([[5, 7], [9, 3]])
    tree = build_tree(lp, ids, 6)
    assert node_paths(tree) == [(5,), (7,), (5, 9), (5, 3), (7, 9), (7, 3)]
    # equal score between a child and a later sibling: the lexicographically smaller ranks win
    lp = torch.tensor([[-1.0, -2.0], [0.0 - 1.0, -5.0]])
    ids = torch.tensor([[1, 2], [3, 4]])
    assert node_paths(build_tree(lp, ids, 2)) == [(1,), (1, 3)]  # (0,0) score -2 ties (1,) score -2


def test_first_child_is_best_child() -> None:
    lp, ids = random_table(4, 4, 16, 5)
    tree = build_tree(lp, ids, 60)
    scores = node_scores(tree, lp, ids)
    first: dict[int, int] = {}
    for i, p in enumerate(tree.parents, start=1):
        first.setdefault(p, i)
        assert scores[first[p] - 1] >= scores[i - 1]


@pytest.mark.parametrize(
    "bad, msg",
    [
        (lambda lp, ids: (lp[:, [1, 0, 2]], ids), "not sorted descending at rank 1"),
        (lambda lp, ids: (lp, ids[:, [0, 0, 2]]), "repeats a token"),
        (lambda lp, ids: (lp, -ids), "negative id"),
        (lambda lp, ids: (lp.clone().fill_(float("nan")), ids), "NaN"),
        (lambda lp, ids: (lp + 10, ids), "must be <= 0"),
        (lambda lp, ids: (lp[:, :2], ids), "both be \\[D, K\\]"),
        (lambda lp, ids: (lp, ids.float()), "integer tensor"),
    ],
)
def test_build_tree_rejects_bad_tables(bad, msg: str) -> None:
    lp, ids = random_table(3, 3, 10, 0)
    lp2, ids2 = bad(lp, ids)
    with pytest.raises(ValueError, match=msg):
        build_tree(lp2, ids2, 5)
    with pytest.raises(ValueError, match="budget must be >= 0"):
        build_tree(lp, ids, -1)


def test_topk_logprobs_true_logprobs() -> None:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, 300, generator=g) * 4).to(torch.bfloat16)
    lp, ids = topk_logprobs(logits, 7)
    assert lp.dtype == torch.float32 and ids.dtype == torch.int64 and lp.shape == (5, 7)
    full = torch.log_softmax(logits.float(), dim=-1)
    ref_lp, ref_ids = full.topk(7, dim=-1)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    assert torch.equal(ids, ref_ids)
    # true log-probs over the full row, not a softmax over the top-k only
    assert (lp.exp().sum(-1) < 1 - 1e-3).all()
    assert topk_logprobs(logits, 0)[0].shape == (5, 0)
    with pytest.raises(ValueError, match="k must be in"):
        topk_logprobs(logits, 301)
    with pytest.raises(ValueError, match="must be \\[D, V\\]"):
        topk_logprobs(logits[0], 3)


@pytest.mark.parametrize(
    "tree, msg",
    [
        (TokenTree((1, 2), (0,), (1, 2)), "lengths differ"),
        (TokenTree((1, 2), (0, 2), (1, 2)), "parent 2 >= own index 2"),
        (TokenTree((1, 2), (0, 0), (1, 2)), "depth 2 != parent 0 depth 0 \\+ 1"),
        (TokenTree((1, 2), (0, -1), (1, 1)), "negative parent"),
        (TokenTree((1, -2), (0, 0), (1, 1)), "negative token"),
        (TokenTree((1, 1), (0, 0), (1, 1)), "token 1 repeats among children of node 0"),
    ],
)
def test_token_tree_validate(tree: TokenTree, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        tree.validate()


def brute_ancestor(tree: TokenTree, i: int, j: int) -> bool:
    while True:
        if i == j:
            return True
        if i == 0:
            return False
        i = tree.parents[i - 1]


@pytest.mark.parametrize("seed", range(4))
def test_tree_mask_vs_brute_force(seed: int) -> None:
    lp, ids = random_table(4, 3, 12, seed)
    tree = build_tree(lp, ids, 25)
    mask = tree_mask(tree)
    t = tree.n + 1
    assert mask.shape == (t, t) and mask.dtype == torch.bool
    ref = torch.tensor([[brute_ancestor(tree, i, j) for j in range(t)] for i in range(t)])
    assert torch.equal(mask, ref)
    assert mask[:, 0].all() and mask[0, 1:].sum() == 0
    assert torch.equal(mask.sum(-1), torch.tensor((1,) + tuple(d + 1 for d in tree.depths)))


def test_tree_mask_empty_and_positions() -> None:
    assert torch.equal(tree_mask(TokenTree()), torch.ones(1, 1, dtype=torch.bool))
    tree = TokenTree((4, 5, 6, 7), (0, 0, 1, 3), (1, 1, 2, 3))
    assert tree_positions(tree, 10).tolist() == [10, 11, 11, 12, 13]
    assert tree_positions(TokenTree(), 3).tolist() == [3]
    assert tree_input_ids(tree, 9).tolist() == [9, 4, 5, 6, 7]
    with pytest.raises(ValueError, match="parent 3 >= own index 2"):
        tree_mask(TokenTree((1, 2), (0, 3), (1, 2)))
    with pytest.raises(ValueError, match="start must be >= 0"):
        tree_positions(tree, -1)


# -- the build under a validity predicate (services/tree/best_first.py) ------------------------------------
class PathRule:
    """A random predicate over token paths, as build_tree's `allowed(parent, token)`: it mirrors the tree
    the build grows (the k-th True answer is node k, build_tree's call contract) to know the parent's path."""

    def __init__(self, seed: int, keep: float):
        self.seed, self.keep = seed, keep
        self.paths: list[tuple[int, ...]] = [()]  # by node index
        self.calls = 0

    def valid(self, path: tuple[int, ...]) -> bool:
        """The token path[-1] may follow path[:-1]: a fixed random draw per (seed, path)."""
        return zlib.crc32(repr((self.seed,) + path).encode()) % 1000 < self.keep * 1000

    def __call__(self, parent: int, token: int) -> bool:
        self.calls += 1
        path = self.paths[parent] + (token,)
        ok = self.valid(path)
        if ok:
            self.paths.append(path)
        return ok


def brute_force_valid(lp: torch.Tensor, ids: torch.Tensor, budget: int, rule: PathRule):
    """brute_force over the prefixes whose every token is valid after its own prefix."""
    everything = brute_force(lp, ids, 10**9)
    valid = [r for r in everything if all(rule.valid(r[1][: d + 1]) for d in range(len(r[1])))]
    return valid[:budget]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("keep", [0.3, 0.7])
def test_build_tree_with_a_predicate_matches_brute_force(case: Case, seed: int, keep: float) -> None:
    """The first `budget` valid prefixes in (-score, ranks) order; dropped candidates give no node and no
    child, but the budget still reaches their valid siblings; the scores are the path sums."""
    lp, ids = random_table(case.depth, case.width, case.vocab, seed, case.quantize)
    rule = PathRule(seed, keep)
    tree = build_tree(lp, ids, case.budget, rule)
    tree.validate()
    ref = brute_force_valid(lp, ids, case.budget, PathRule(seed, keep))
    assert node_paths(tree) == [r[1] for r in ref]
    assert list(tree.scores) == [r[2] for r in ref]
    assert rule.paths[1:] == node_paths(tree), "a True answer was not the next node"
    assert tree.n == 0 or rule.calls >= tree.n


def test_a_predicate_that_allows_all_changes_nothing() -> None:
    for case in CASES:
        lp, ids = random_table(case.depth, case.width, case.vocab, 3, case.quantize)
        plain = build_tree(lp, ids, case.budget)
        ruled = build_tree(lp, ids, case.budget, lambda parent, token: True)
        assert ruled == plain and ruled.scores == plain.scores


def test_a_dropped_candidate_is_skipped_not_the_budget() -> None:
    """Depth 1 allows only the third-best token: the tree is that token, then its best children, and
    the predicate is never asked once the budget is full."""
    lp, ids = random_table(2, 4, 12, 0)
    third = int(ids[0, 2])
    asked = []

    def allowed(parent: int, token: int) -> bool:
        asked.append((parent, token))
        return parent != 0 or token == third

    tree = build_tree(lp, ids, 3, allowed)
    assert node_paths(tree) == [(third,), (third, int(ids[1, 0])), (third, int(ids[1, 1]))]
    assert asked[-1] == (1, int(ids[1, 1])), "asked past the budget"


class StopRule(PathRule):
    """PathRule whose valid tokens in `stops` answer LEAF (a stop token: nothing may follow it); it notes every
    parent it is asked about."""

    def __init__(self, seed: int, keep: float, stops: set[int]):
        super().__init__(seed, keep)
        self.stops, self.leaves, self.asked_parents = stops, set(), set()

    def __call__(self, parent: int, token: int) -> int:
        self.asked_parents.add(parent)
        if not super().__call__(parent, token):
            return False
        if token in self.stops:
            self.leaves.add(len(self.paths) - 1)
            return LEAF
        return True


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_leaf_answer_is_a_node_without_children(case: Case, seed: int) -> None:
    """LEAF: the candidate is a node, and the predicate is never asked about a child of it (no candidate is
    pushed under it); the tree is the brute force's valid prefixes with stop tokens only last."""
    lp, ids = random_table(case.depth, case.width, case.vocab, seed, case.quantize)
    stops = {t for t in range(case.vocab) if t % 3 == 0}
    rule = StopRule(seed, 0.7, stops)
    tree = build_tree(lp, ids, case.budget, rule)
    tree.validate()
    ref = [r for r in brute_force_valid(lp, ids, 10**9, PathRule(seed, 0.7)) if not stops & set(r[1][:-1])]
    assert node_paths(tree) == [r[1] for r in ref[: case.budget]]
    assert list(tree.scores) == [r[2] for r in ref[: case.budget]]
    assert not rule.leaves & rule.asked_parents, "a child of a LEAF node was popped"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_checked_table_builds_the_same_tree(case: Case) -> None:
    """build_checked_tree (a table TokenTable.validate passed) gives build_tree's tree, with or without a
    predicate, and still refuses a negative budget."""
    lp, ids = random_table(case.depth, case.width, case.vocab, 4, case.quantize)
    table = TokenTable(lp, ids)
    table.validate(case.vocab)
    for rule in (None, PathRule(4, 0.5)):
        fresh = None if rule is None else PathRule(4, 0.5)
        checked, plain = build_checked_tree(table, case.budget, rule), build_tree(lp, ids, case.budget, fresh)
        assert checked == plain and checked.scores == plain.scores
    with pytest.raises(ValueError, match="budget must be >= 0"):
        build_checked_tree(table, -1)


def test_the_drafter_builds_with_the_tree_package() -> None:
    from ddtree.drafter import engine
    from ddtree.tree import best_first, drafted

    assert engine.drafted_trees is drafted.drafted_trees and engine.topk_logprobs is best_first.topk_logprobs
    assert drafted.build_tree is best_first.build_tree  # the host's build is the reference itself

"""--tree-cut cost: the cut maximises expected tokens per ms (brute force), the cost fit recovers a known
linear cost, the calibration follows the acceptance seen, and a served request's tokens equal AR's."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from ddtree.config import VerifierConfig
from ddtree.contract.sampling_params import SamplingConfig
from ddtree.contract.token_tree import TokenTree
from ddtree.tree.budget import cost_cut
from ddtree.tree.step_cost import (
    MIN_OBSERVATIONS,
    AcceptCalibration,
    StepCostModel,
    StepShape,
)
from ddtree.verifier.drafting.drafter_client import DraftResult
from ddtree.verifier.drafting.step_drafter import StepDrafter
from ddtree.verifier.sequence import GenerateParams, Sequence


def _value(gains, node_ms, base_tokens, base_ms, kept) -> float:
    tokens = base_tokens + sum(x for g, k in zip(gains, kept) for x in g[:k])
    ms = base_ms + sum(m * k for m, k in zip(node_ms, kept))
    return tokens / ms


def _brute_force(gains, node_ms, base_tokens, base_ms) -> float:
    ranges = [range(min(1, len(g)), len(g) + 1) for g in gains]
    return max(_value(gains, node_ms, base_tokens, base_ms, k) for k in itertools.product(*ranges))


def _random_gains(rng: random.Random, n: int) -> list[float]:
    s, out = 0.0, []
    for _ in range(n):
        s -= rng.expovariate(1.5)
        out.append(min(1.0, rng.uniform(0.3, 2.0) * math.exp(s)) if not out else min(out[-1], math.exp(s)))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_cost_cut_is_the_best_prefix_cut(seed):
    rng = random.Random(seed)
    trees = rng.randint(1, 3)
    gains = [_random_gains(rng, rng.randint(0, 6)) for _ in range(trees)]
    node_ms = [rng.choice([0.0, rng.uniform(0.05, 2.0)]) if seed % 5 == 0 else rng.uniform(0.05, 2.0) for _ in gains]
    base_tokens, base_ms = float(trees), rng.uniform(2.0, 30.0)
    kept = cost_cut(gains, node_ms, base_tokens, base_ms)
    assert all(min(1, len(g)) <= k <= len(g) for g, k in zip(gains, kept))
    best = _brute_force(gains, node_ms, base_tokens, base_ms)
    assert _value(gains, node_ms, base_tokens, base_ms, kept) == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("seed", range(20))
def test_cost_cut_margin_keeps_the_optimum_and_the_nodes_just_under_it(seed):
    """With margin μ the nodes are taken best ratio first while ratio > μ·G / T (checked here against its own
    greedy walk over every node sorted by ratio): a superset of the optimum's nodes, every node at μ = 0."""
    rng = random.Random(100 + seed)
    gains = [_random_gains(rng, rng.randint(0, 7)) for _ in range(rng.randint(1, 3))]
    node_ms = [rng.uniform(0.05, 2.0) for _ in gains]
    base_tokens, base_ms = float(len(gains)), rng.uniform(2.0, 30.0)
    optimum = cost_cut(gains, node_ms, base_tokens, base_ms)
    sizes = [cost_cut(gains, node_ms, base_tokens, base_ms, margin) for margin in (1.0, 0.75, 0.5, 0.25, 0.0)]
    assert sizes[0] == optimum
    for looser, tighter in zip(sizes[1:], sizes):
        assert all(a >= b for a, b in zip(looser, tighter))
    assert sizes[-1] == [len(g) for g in gains]  # every gain > 0
    # μ = 0.5 by hand: first nodes kept; then the rest by ratio, while ratio > 0.5 · tokens / ms
    kept = [min(1, len(g)) for g in gains]
    tokens = base_tokens + sum(g[0] for g in gains if g)
    ms = base_ms + sum(m for g, m in zip(gains, node_ms) if g)
    # by ratio, best first; a tree's equal gains in node order (a node comes after its ancestors)
    rest = sorted((-g[k] / node_ms[i], i, k) for i, g in enumerate(gains) for k in range(1, len(g)))
    for neg_ratio, i, k in rest:
        ratio = -neg_ratio
        if ratio <= 0.5 * tokens / ms:
            break
        tokens, ms, kept[i] = tokens + gains[i][k], ms + node_ms[i], k + 1
    assert sizes[2] == kept


def test_cost_cut_margin_is_checked():
    with pytest.raises(ValueError, match="margin"):
        cost_cut([[0.5]], [0.1], 1.0, 5.0, margin=1.5)


def test_cost_cut_shrinks_as_nodes_get_dearer():
    gains = [[0.9, 0.8, 0.6, 0.4, 0.2, 0.1, 0.05, 0.02]]
    sizes = [cost_cut(gains, [m], 1.0, 10.0)[0] for m in (0.0, 0.1, 0.5, 2.0, 50.0)]
    assert sizes[0] == 8  # free nodes: the whole tree
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] == 1  # the first node is always kept
    assert len(set(sizes)) >= 3


def test_cost_model_recovers_a_linear_cost():
    rng = random.Random(1)
    model = StepCostModel(forget=1.0)
    a, b, c = 4.0, 0.3, 0.2  # verify ms: intercept; per row; per row per 1000 context
    for i in range(200):
        items = [(rng.randint(1, 17), rng.randint(0, 4096)) for _ in range(rng.randint(1, 3))]
        shape = StepShape.of(items)
        model.observe(shape, a + b * shape.rows + c * shape.row_context + rng.gauss(0, 0.05), 3.0 + (i % 2))
    assert model.ready
    assert model.coefficients == pytest.approx((a, b, c), abs=0.05)
    assert model.draft_ms == pytest.approx(3.5, abs=1e-9)
    assert model.node_ms(4000) == pytest.approx(b + c * 4.0, abs=0.05)
    shape = StepShape.of([(9, 1000)])
    assert model.predict(shape) == pytest.approx(3.5 + a + 9 * b + 9 * c, abs=0.1)


def test_cost_model_waits_and_keeps_unseen_directions_at_zero():
    model = StepCostModel()
    for i in range(MIN_OBSERVATIONS):
        assert not model.ready
        model.observe(StepShape.of([(17, 100)]), 20.0 + (i % 2) * 0.1, 5.0)  # rows never vary
    assert model.ready
    _, b, c = model.coefficients
    assert abs(b) < 0.5 and abs(c) < 0.5  # the ridge: no slope invented from rows that never varied
    assert model.predict(StepShape.of([(17, 100)])) == pytest.approx(25.05, abs=0.2)


def test_calibration_is_per_confidence_and_follows_the_acceptance_seen():
    cal = AcceptCalibration(forget=1.0)
    scores = (math.log(0.95), math.log(0.3), math.log(0.02))
    assert cal.gains(scores) == pytest.approx([0.95, 0.3, 0.02])  # nothing seen: the drafter's own numbers
    assert len({cal.bin(x) for x in scores}) == 3
    rng = random.Random(0)
    for _ in range(3000):  # the confident node is accepted half the time, the middle one 30%, the last never
        accepted = {1} if rng.random() < 0.5 else set()
        if rng.random() < 0.3:
            accepted.add(2)
        cal.observe(scores, accepted)
    assert cal.alpha(scores[0]) == pytest.approx(0.5 / 0.95, abs=0.03)
    assert cal.alpha(scores[1]) == pytest.approx(1.0, abs=0.05)
    assert cal.alpha(scores[2]) == pytest.approx(cal.low, abs=0.01)
    g = cal.gains(scores)
    assert g[0] == pytest.approx(0.5, abs=0.03) and g[1] == pytest.approx(0.3, abs=0.03)
    assert g == sorted(g, reverse=True) and max(g) <= 1.0


def test_gains_never_rise_along_the_tree():
    cal = AcceptCalibration(forget=1.0)
    for _ in range(100):
        cal.observe((math.log(0.9), math.log(0.5)), {2})  # the second node does better than the first
    g = cal.gains((math.log(0.9), math.log(0.5)))
    assert g[1] <= g[0]


BUDGET = 12
# A chain of BUDGET nodes scored as the drafter would: path probabilities 0.8^depth.
CHAIN = TokenTree(
    token_ids=tuple(range(10, 10 + BUDGET)),
    parents=tuple(range(BUDGET)),
    depths=tuple(range(1, BUDGET + 1)),
    scores=tuple(k * math.log(0.8) for k in range(1, BUDGET + 1)),
)


class _FixedDrafter:
    """A drafter stand-in for StepDrafter: CHAIN for every sequence."""

    def draft(self, spec, vocab_size, widths):
        return DraftResult({s.draft_id: CHAIN for s, _ in spec}, 1.0, 1.5, {s.draft_id: 0 for s, _ in spec})


def _seq(i: int, context: int) -> Sequence:
    seq = Sequence(GenerateParams(f"r{i}", tuple(range(context)), SamplingConfig(), 8, frozenset(), True, 12))
    seq.committed = list(range(context))
    seq.root = 7
    return seq


def _trained_step_drafter(tree_cut: str, row_ms: float, per_1k_context_ms: float) -> StepDrafter:
    """A StepDrafter whose cost fit has seen steps costing 5 + row_ms·rows + per_1k·row_context ms and whose
    calibration has seen the drafter's chain accepted exactly as often as it says."""
    steps = StepDrafter(_FixedDrafter(), 4096, VerifierConfig(tree_cut=tree_cut))
    rng = random.Random(3)
    for _ in range(64):
        rows, context = rng.randint(2, 13), rng.randint(16, 4096)
        ms = 5.0 + row_ms * rows + per_1k_context_ms * rows * context / 1000
        chain = CHAIN.prefix(rows - 1)
        depth = 0  # each next node accepted with probability 0.8: node k with 0.8^k, as its score says
        while depth < chain.n and rng.random() < 0.8:
            depth += 1
        steps.observe([(rows, context)], False, 6.0, ms, [(chain, tuple(range(depth + 1)))])
    return steps


def _drafted(steps: StepDrafter, seq: Sequence) -> TokenTree:
    """The tree one Draft call of `steps` gives `seq` alone."""
    return steps.draft([seq], [], 1).trees[seq.draft_id].tree


def test_step_drafter_cuts_long_contexts_harder_when_rows_cost():
    steps = _trained_step_drafter("cost", row_ms=0.2, per_1k_context_ms=0.4)
    short, long = _seq(0, 64), _seq(1, 4000)
    steps.draft([short], [], 1)
    steps.draft([long], [], 1)
    steps.tree_cut.cuts = 0  # not an exploration step below
    short_tree = _drafted(steps, short)
    long_tree = _drafted(steps, long)
    assert 1 <= long_tree.n < short_tree.n <= BUDGET
    assert short_tree == CHAIN.prefix(short_tree.n) and long_tree == CHAIN.prefix(long_tree.n)


def test_free_rows_and_fixed_cut_keep_the_whole_tree():
    for steps in (_trained_step_drafter("cost", 0.0, 0.0), _trained_step_drafter("fixed", 0.5, 0.5)):
        seq = _seq(0, 4000)
        steps.tree_cut.cuts = 1
        assert _drafted(steps, seq) == CHAIN


def test_exploration_steps_verify_whole_trees_once_the_fit_is_ready():
    """Every EXPLORE_EVERY-th cut step keeps the whole tree (more rows than the cut keeps, no acceptance given
    away); the steps between are cut by cost, and before the fit is ready the cut is random."""
    from ddtree.tree.cut import EXPLORE_EVERY

    steps = _trained_step_drafter("cost", row_ms=0.2, per_1k_context_ms=0.4)
    sizes = []
    for _ in range(2 * EXPLORE_EVERY):
        tree = _drafted(steps, _seq(0, 4000))
        sizes.append((steps.tree_cut.cuts % EXPLORE_EVERY == 0, tree.n))
    explored = [n for whole, n in sizes if whole]
    cut = [n for whole, n in sizes if not whole]
    assert explored == [BUDGET, BUDGET]
    assert max(cut) < BUDGET  # rows cost at 4000 tokens: the cut keeps fewer nodes
    assert len(set(cut)) == 1  # the same tree and fit give the same cut: nothing random once ready

    fresh = StepDrafter(_FixedDrafter(), 4096, VerifierConfig(tree_cut="cost"))  # no fit yet: random sizes
    seen = set()
    for _ in range(12):
        tree = _drafted(fresh, _seq(0, 4000))
        seen.add(tree.n)
        assert tree == CHAIN.prefix(tree.n)
    assert len(seen) > 2

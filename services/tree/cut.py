"""The verifier's cut of one step's drafted trees: how much of each tree the step verifies.

Two rules, in order, on the trees of the sequences of one Draft call:
1. `--max-tree-tokens` (budget.py): the trees, root + nodes each, fit the cap: the best-scoring nodes over
   the batch when every tree carries the drafter's scores (`allocate_nodes`), else an equal share
   (`tree_budget`); uncapped (0): unchanged.
2. `--tree-cut cost`: a tree with scores keeps the nodes whose expected tokens per ms are not far below the
   step's (`cost_cut`, CUT_MARGIN), from the step's cost fit and the drafter's calibrated node probabilities
   as measured on this verifier (step_cost.py; `observe` after every step). Until the fit is ready the cut is
   random (the fit must see steps of varied rows), and every EXPLORE_EVERY-th cut verifies whole trees.
   Trees without scores are verified whole and counted in the step's base cost.

Only prefixes are cut (a prefix of a best-first tree is its best smaller tree): which tokens are accepted
among the nodes kept never changes.
"""

from __future__ import annotations

import random

from ddtree.contract.token_tree import EMPTY_TREE, TokenTree
from ddtree.telemetry.logging import get_logger

from .budget import allocate_nodes, cost_cut, tree_budget
from .step_cost import AcceptCalibration, StepCostModel, StepShape

# Every this many cut steps verifies the whole trees, so that the cost fit keeps seeing steps of more rows
# than the cut keeps (rows that never vary cannot be priced); whole trees give away no acceptance.
EXPLORE_EVERY = 8
# A node is cut only when its expected tokens per ms are under CUT_MARGIN x the step's (budget.cost_cut).
# Both estimates are noisy, and a node cut by mistake costs acceptance where one kept by mistake costs only a
# row, so the cut errs on the side of keeping.
CUT_MARGIN = 0.5
LOG_EVERY = 64  # cut steps between two `tree_cut_model` log lines

log = get_logger("ddtree.verifier.drafting.step_drafter")


class TreeCut:
    """The cut policy of one verifier: its cap, its mode and the estimates the cost cut learns."""

    def __init__(self, max_tree_tokens: int, by_cost: bool):
        self.max_tree_tokens = max_tree_tokens
        self.by_cost = by_cost
        self.cost = StepCostModel()
        self.calibration = AcceptCalibration()
        self.cuts = 0  # steps cut by cost so far (every EXPLORE_EVERY-th verifies whole trees)
        self._explore = random.Random(0)

    def cut(
        self,
        trees: list[TokenTree | None],  # per sequence of the Draft call: its tree, None = it got none
        contexts: list[int],  # per sequence: its context length
        others: list[tuple[int, int]],  # (rows, context) of the step's other work items
        decoding: int,  # the step's decoding sequences (a token each at least)
    ) -> list[TokenTree | None]:
        """The trees as the step verifies them (None stays None)."""
        trees = self._fit(trees)
        if self.by_cost and any(t is not None for t in trees):
            trees = self._cost_cut(trees, contexts, others, decoding)
        return trees

    def _fit(self, trees: list[TokenTree | None]) -> list[TokenTree | None]:
        cap = self.max_tree_tokens
        if cap <= 0:
            return trees
        drafted = [t if t is not None else EMPTY_TREE for t in trees]
        if all(t.scores or t.n == 0 for t in drafted):
            kept = allocate_nodes([t.scores for t in drafted], cap)
        else:
            kept = [tree_budget(t.n, len(drafted), cap) for t in drafted]
        return [None if t is None else t.prefix(k) for t, k in zip(trees, kept)]

    def _cost_cut(
        self, trees: list[TokenTree | None], contexts: list[int], others: list[tuple[int, int]], decoding: int
    ) -> list[TokenTree | None]:
        cut = [i for i, t in enumerate(trees) if t is not None and len(t.scores) > 1]
        if not cut:
            return trees
        whole = [i for i in range(len(trees)) if i not in set(cut)]
        fixed = others + [(1 + (trees[i] or EMPTY_TREE).n, contexts[i]) for i in whole]
        fixed += [(1, contexts[i]) for i in cut]  # the roots
        self.cuts += 1
        if self.cuts % LOG_EVERY == 1:
            self._log_model()
        if not self.cost.ready:  # no fit yet: random sizes, so that the first steps vary in rows
            kept = [self._explore.randint(1, trees[i].n) for i in cut]
        elif self.cuts % EXPLORE_EVERY == 0:  # whole trees: the fit sees more rows than the cut keeps
            kept = [trees[i].n for i in cut]
        else:
            kept = cost_cut(
                [self.calibration.gains(trees[i].scores) for i in cut],
                [self.cost.node_ms(contexts[i]) for i in cut],
                float(decoding),
                self.cost.predict(StepShape.of(fixed)),
                CUT_MARGIN,
            )
        out = list(trees)
        for i, k in zip(cut, kept):
            out[i] = trees[i].prefix(k)
        return out

    def observe(
        self,
        items: list[tuple[int, int]],
        prefill: bool,
        draft_ms: float,
        verify_ms: float,
        verified: list[tuple[TokenTree, tuple[int, ...]]],
    ) -> bool:
        """After a step (see StepDrafter.observe); True when the cost fit took it (its coefficients changed).
        Only speculative steps without prefill are fitted (step_cost.py says why)."""
        if not self.by_cost:
            return False
        fitted = bool(items and verified and not prefill)
        if fitted:
            self.cost.observe(StepShape.of(items), verify_ms, draft_ms)
        for tree, accepted in verified:
            if tree.scores:
                self.calibration.observe(tree.scores, set(accepted[1:]))
        return fitted

    def _log_model(self) -> None:
        """The cut's current estimates, as a `tree_cut_model` log line (every LOG_EVERY cuts)."""
        a, b, c = self.cost.coefficients
        log.info(
            "tree_cut_model",
            verify_ms=round(a, 3),
            row_ms=round(b, 4),
            row_ms_per_1k_context=round(c, 4),
            draft_ms=round(self.cost.draft_ms, 3),
            alpha_by_score={f"{x:g}": round(self.calibration.alpha(x), 3) for x in (-0.05, -0.4, -1.2, -2.5, -5.0)},
            observations=self.cost.observations,
        )

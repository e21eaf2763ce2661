"""The Draft stage of a verifier step (scheduler.py): one Draft call for the step's speculative
sequences, returned as each one's tree for the verify (`StepDrafts`).

- A grammar-constrained sequence under `--grammar-tree table` asks the drafter for a top-K table, and its
  tree is built here from it (ddtree.tree, grammar_build.py).
- Under `--max-tree-tokens` the trees are cut after drafting to fit the cap over the whole call
  (tree_budget.py): the best-scoring nodes over the batch, else an equal share.
- Under `--tree-cut cost` (the default) they are then cut to the nodes whose expected tokens per ms are
  not far below the step's (tree_budget.cost_cut, CUT_MARGIN), from the step's cost and the drafter's calibrated node
  probabilities as measured on this verifier (step_cost.py; `observe` after every step). Until the cost
  fit has MIN_OBSERVATIONS decode steps each tree is cut at a random size instead, and every
  EXPLORE_EVERY-th step after verifies the whole trees, so that the fit sees steps of different rows (the
  same tokens either way).
- A failed call decodes its sequences with AR from then on (the same tokens); a sequence whose context
  the drafter no longer holds (released, lease expired, drafter restarted: `DraftResult.unknown`) takes one
  AR step and sends its context again (reset=True) at the next, up to MAX_CONTEXT_RESENDS times; a
  sequence the drafter gave no tree takes an AR step (EMPTY_TREE).
"""

from __future__ import annotations

import dataclasses
import random

import grpc

from ddtree.config import VerifierConfig
from ddtree.contract.token_tree import EMPTY_TREE, TokenTree
from ddtree.telemetry.logging import get_logger
from ddtree.tree import (
    AcceptCalibration,
    StepCostModel,
    StepShape,
    allocate_nodes,
    build_grammar_tree,
    cost_cut,
    grammar_table_width,
    tree_budget,
)  # fmt: skip
from ddtree.verifier import metrics
from ddtree.verifier.drafter_client import DraftResult
from ddtree.verifier.sequence import DraftedTree, Sequence

# Every this many cut steps verifies the whole trees, so that the cost fit keeps seeing steps of more rows
# than the cut keeps (rows that never vary cannot be priced); whole trees give away no acceptance.
EXPLORE_EVERY = 8
# A node is cut only when its expected tokens per ms are under CUT_MARGIN x the step's (tree_budget.cost_cut).
# Both estimates are noisy, and a node cut by mistake costs acceptance where one kept by mistake costs only a
# row, so the cut errs on the side of keeping.
CUT_MARGIN = 0.5
# A sequence's context is sent again at most this many times; a drafter that keeps losing it (leases
# shorter than a step, a replica that restarts over and over) leaves the sequence to AR.
MAX_CONTEXT_RESENDS = 8

log = get_logger("ddtree.verifier.step_drafter")


@dataclasses.dataclass(frozen=True)
class StepDrafts:
    """One Draft call's result, by draft id."""

    trees: dict[str, DraftedTree]  # each drafted sequence's tree (EMPTY_TREE when the drafter gave none)
    lost: frozenset[str] = frozenset()  # the drafter lost these sequences' state: they continue with AR
    resend: frozenset[str] = frozenset()  # their context is gone from the drafter: an AR step, then resent


class StepDrafter:
    def __init__(self, drafter, vocab_size: int, config: VerifierConfig):
        """drafter: a DrafterPool (or one DrafterClient), or None for AR only (nothing to draft)."""
        self.drafter = drafter
        self.vocab_size = vocab_size
        self.config = config
        self.cost = StepCostModel()
        self.calibration = AcceptCalibration()
        self._cuts = 0  # steps cut by cost so far (every EXPLORE_EVERY-th is random)
        self._explore = random.Random(0)

    def draft(self, seqs: list[Sequence], others: list[tuple[int, int]] = (), decoding: int = 0) -> StepDrafts:
        """One Draft call for seqs (the speculative ones of this step): each one's tree (EMPTY_TREE if the
        drafter gave none: an AR step) with what its step record needs.
        others: (rows, context) of the step's other work items (AR decodes, prefill chunks); decoding: the
        step's decoding sequences, speculative or not (a token each at least): for `--tree-cut cost`."""
        if not seqs:
            return StepDrafts({})
        # Full budgets: under --max-tree-tokens the trees are cut to fit after drafting (_fit_trees).
        spec = [(s, s.params.budget) for s in seqs]
        table_vocab = self._table_vocab()
        widths = {  # --grammar-tree table: a grammar's tree is built here from the drafter's table (grammar_tree.py)
            s.draft_id: grammar_table_width(s.params.chain, table_vocab)
            for s in seqs
            if s.grammar is not None and self.config.grammar_tree == "table"
        }
        try:
            result: DraftResult | None = self.drafter.draft(spec, self.vocab_size, widths)
            failed, unknown = result.failed, getattr(result, "unknown", frozenset())
        except grpc.RpcError as err:
            log.error("draft_failed", code=str(err.code()), details=err.details(), sequences=len(spec))
            result, failed, unknown = None, frozenset(s.draft_id for s in seqs), frozenset()
        resend = set()
        for seq in seqs:
            if seq.draft_id not in unknown or seq.draft_id in failed:
                continue
            if seq.context_resends >= MAX_CONTEXT_RESENDS:
                failed |= {seq.draft_id}
                continue
            resend.add(seq.draft_id)
            metrics.DRAFT_CONTEXTS_RESENT.inc()
            log.warning("draft_context_resent", request_id=seq.request_id, resends=seq.context_resends + 1)
        trees = self._fit_trees(seqs, self._grammar_trees(seqs, result)) if result is not None else {}
        if self.config.tree_cut == "cost" and trees:
            trees = self._cost_cut(seqs, trees, list(others), max(decoding, len(seqs)))
        drafted = {}
        for seq in seqs:
            if seq.draft_id in resend:
                continue  # an AR step; its context goes again at the next
            if seq.draft_id in failed:
                # The drafter's state for this sequence is lost or unknown: it finishes with AR
                # decoding, which yields exactly the same tokens.
                log.warning("draft_fallback_ar", request_id=seq.request_id)
                continue
            tree = trees.get(seq.draft_id)
            drafted[seq.draft_id] = DraftedTree(
                tree if tree is not None else EMPTY_TREE,
                result.draft_ms if tree else 0.0,
                max(result.rpc_ms - result.draft_ms, 0.0),
                result.feature_bytes.get(seq.draft_id, 0),
            )
        return StepDrafts(drafted, frozenset(failed), frozenset(resend))

    def _table_vocab(self) -> int:
        """The vocabulary a table width is bounded by: the smaller of the target's and the drafter's
        (DrafterInfo.vocab_size; the drafter answers a wider table_width with INVALID_ARGUMENT for the whole
        call, and every sequence of it would fall back to AR)."""
        drafter_vocab = getattr(getattr(self.drafter, "info", None), "vocab_size", 0)
        return min(self.vocab_size, drafter_vocab) if drafter_vocab > 0 else self.vocab_size

    def _grammar_trees(self, seqs: list[Sequence], result: DraftResult) -> dict[str, TokenTree]:
        """The drafted trees, plus the trees built from the tables the grammar-constrained sequences asked
        for (a build that fails is logged and gives no tree: an AR step, the same tokens)."""
        trees = dict(result.trees)
        for seq in seqs:
            table = result.tables.get(seq.draft_id)
            if table is None or seq.grammar is None:
                continue
            try:
                trees[seq.draft_id] = build_grammar_tree(seq.grammar, table, seq.params.budget)
            except Exception as err:
                log.exception("grammar_tree_failed", request_id=seq.request_id, error=str(err))
        return trees

    def _fit_trees(self, seqs: list[Sequence], trees: dict[str, TokenTree]) -> dict[str, TokenTree]:
        """The drafted trees cut to fit --max-tree-tokens over the sequences of one Draft call (tree_budget.py):
        the best-scoring nodes over the batch when every tree carries the drafter's scores, else an equal
        share. Uncapped (0): unchanged."""
        cap = self.config.max_tree_tokens
        if cap <= 0:
            return trees
        drafted = [trees.get(s.draft_id, EMPTY_TREE) for s in seqs]
        if all(t.scores or t.n == 0 for t in drafted):
            kept = allocate_nodes([t.scores for t in drafted], cap)
        else:
            kept = [tree_budget(t.n, len(seqs), cap) for t in drafted]
        return {s.draft_id: t.prefix(k) for s, t, k in zip(seqs, drafted, kept) if s.draft_id in trees}

    def _cost_cut(
        self, seqs: list[Sequence], trees: dict[str, TokenTree], others: list[tuple[int, int]], decoding: int
    ) -> dict[str, TokenTree]:
        """The trees with scores cut by tree_budget.cost_cut (a random cut while exploring); trees without
        scores are verified whole and counted in the step's base cost."""
        cut = [s for s in seqs if s.draft_id in trees and len(trees[s.draft_id].scores) > 1]
        if not cut:
            return trees
        cut_ids = {s.draft_id for s in cut}
        fixed = others + [
            (1 + trees.get(s.draft_id, EMPTY_TREE).n, s.context_len) for s in seqs if s.draft_id not in cut_ids
        ]
        fixed += [(1, s.context_len) for s in cut]  # the roots
        self._cuts += 1
        if self._cuts % 64 == 1:
            self._log_model()
        if not self.cost.ready:  # no fit yet: random sizes, so that the first steps vary in rows
            kept = [self._explore.randint(1, trees[s.draft_id].n) for s in cut]
        elif self._cuts % EXPLORE_EVERY == 0:  # whole trees: the fit sees more rows than the cut keeps
            kept = [trees[s.draft_id].n for s in cut]
        else:
            kept = cost_cut(
                [self.calibration.gains(trees[s.draft_id].scores) for s in cut],
                [self.cost.node_ms(s.context_len) for s in cut],
                float(decoding),
                self.cost.predict(StepShape.of(fixed)),
                CUT_MARGIN,
            )
        return trees | {s.draft_id: trees[s.draft_id].prefix(k) for s, k in zip(cut, kept)}

    def _log_model(self) -> None:
        """The cut's current estimates, as a `tree_cut_model` log line (every 64 cuts)."""
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

    def observe(
        self,
        items: list[tuple[int, int]],
        prefill: bool,
        draft_ms: float,
        verify_ms: float,
        verified: list[tuple[TokenTree, tuple[int, ...]]],
    ) -> None:
        """After a step: items (rows, context) of its forward, whether it held prefill chunks, the times of
        its Draft call and of its verify, and per speculative sequence (tree verified, accepted nodes with
        the root first).
        Only speculative steps without prefill are fitted (step_cost.py says why)."""
        if self.config.tree_cut != "cost":
            return
        if items and verified and not prefill:
            self.cost.observe(StepShape.of(items), verify_ms, draft_ms)
            a, b, c = self.cost.coefficients
            for term, value in (("verify_ms", a), ("row_ms", b), ("row_ms_per_1k_context", c)):
                metrics.TREE_CUT.labels(term=term).set(value)
            metrics.TREE_CUT.labels(term="draft_ms").set(self.cost.draft_ms)
        for tree, accepted in verified:
            if tree.scores:
                self.calibration.observe(tree.scores, set(accepted[1:]))

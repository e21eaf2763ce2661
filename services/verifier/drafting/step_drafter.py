"""The Draft stage of a verifier step (scheduler.py): one Draft call for the step's speculative
sequences, returned as each one's tree for the verify (`StepDrafts`).

- A grammar-constrained sequence under `--grammar-tree table` asks the drafter for a top-K table, and its
  tree is built here from it (ddtree.tree, grammar_build.py).
- The trees are then cut by the verifier's tree policy (ddtree.tree.cut.TreeCut): to fit
  `--max-tree-tokens` over the whole call, then under `--tree-cut cost` (the default) to the nodes worth
  their rows, from the step's cost and the drafter's calibrated node probabilities as measured on this
  verifier (`observe` after every step feeds them).
- A failed call decodes its sequences with AR from then on (the same tokens); a sequence whose context
  the drafter no longer holds (released, lease expired, drafter restarted: `DraftResult.unknown`) takes one
  AR step and sends its context again (reset=True) at the next, up to MAX_CONTEXT_RESENDS times; a
  sequence the drafter gave no tree takes an AR step (EMPTY_TREE).
"""

from __future__ import annotations

import dataclasses

import grpc

from ddtree.config import VerifierConfig
from ddtree.contract.token_tree import EMPTY_TREE, TokenTree
from ddtree.telemetry.logging import get_logger
from ddtree.tree import TreeCut, build_grammar_tree, grammar_table_width
from ddtree.verifier import metrics
from ddtree.verifier.drafting.drafter_client import DraftResult
from ddtree.verifier.sequence import DraftedTree, Sequence

# A sequence's context is sent again at most this many times; a drafter that keeps losing it (leases
# shorter than a step, a replica that restarts over and over) leaves the sequence to AR.
MAX_CONTEXT_RESENDS = 8

log = get_logger("ddtree.verifier.drafting.step_drafter")


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
        self.tree_cut = TreeCut(config.max_tree_tokens, config.tree_cut == "cost")  # ddtree.tree.cut

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
        widths = {  # --grammar-tree table: a grammar's tree is built here from the drafter's table (ddtree.tree)
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
        trees = {}
        if result is not None:  # cut to fit --max-tree-tokens, then by cost (ddtree.tree.cut)
            built = self._grammar_trees(seqs, result)
            kept = self.tree_cut.cut(
                [built.get(s.draft_id) for s in seqs], [s.context_len for s in seqs], list(others),
                max(decoding, len(seqs)),
            )  # fmt: skip
            trees = {s.draft_id: t for s, t in zip(seqs, kept) if t is not None}
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
        Only speculative steps without prefill are fitted (ddtree.tree.step_cost says why)."""
        if self.tree_cut.observe(items, prefill, draft_ms, verify_ms, verified):
            cost = self.tree_cut.cost
            for term, value in zip(("verify_ms", "row_ms", "row_ms_per_1k_context"), cost.coefficients):
                metrics.TREE_CUT.labels(term=term).set(value)
            metrics.TREE_CUT.labels(term="draft_ms").set(cost.draft_ms)

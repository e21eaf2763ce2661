"""The Draft stage of a verifier step (scheduler.py, step 3): one Draft call for the step's speculative
sequences, and each one's tree for the verify, in `Sequence.draft`.

- A grammar-constrained sequence under `--grammar-tree table` asks the drafter for a top-K table, and its
  tree is built here from it (grammar_tree.py).
- Under `--max-tree-tokens` the trees are cut after drafting to fit the cap over the whole call
  (tree_budget.py): the best-scoring nodes over the batch, else an equal share.
- A failed call, or a sequence whose drafter state is lost, decodes with AR from then on (the same
  tokens); a sequence the drafter gave no tree takes an AR step (EMPTY_TREE).
"""

from __future__ import annotations

import grpc

from ddtree.config import VerifierConfig
from ddtree.contract.token_tree import EMPTY_TREE, TokenTree
from ddtree.telemetry.logging import get_logger
from ddtree.verifier.drafter_client import DraftResult
from ddtree.verifier.grammar_tree import build_grammar_tree, grammar_table_width
from ddtree.verifier.sequence import DraftedTree, Sequence
from ddtree.verifier.tree_budget import allocate_nodes, tree_budget

log = get_logger("ddtree.verifier.step_drafter")


class StepDrafter:
    def __init__(self, drafter, vocab_size: int, config: VerifierConfig):
        """drafter: a DrafterPool (or one DrafterClient), or None for AR only (nothing to draft)."""
        self.drafter = drafter
        self.vocab_size = vocab_size
        self.config = config

    def draft(self, seqs: list[Sequence]) -> None:
        """One Draft call for seqs (the speculative ones of this step); each gets its tree (EMPTY_TREE if
        the drafter gave none: an AR step) and what its step record needs, in `Sequence.draft`."""
        if not seqs:
            return
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
            failed = result.failed
        except grpc.RpcError as err:
            log.error("draft_failed", code=str(err.code()), details=err.details(), sequences=len(spec))
            result, failed = None, frozenset(s.draft_id for s in seqs)
        trees = self._fit_trees(seqs, self._grammar_trees(seqs, result)) if result is not None else {}
        for seq in seqs:
            if seq.draft_id in failed:
                # The drafter's state for this sequence is lost or unknown: it finishes with AR
                # decoding, which yields exactly the same tokens.
                log.warning("draft_fallback_ar", request_id=seq.request_id)
                seq.use_spec = False
                seq.pending_commit = None
                seq.draft = None
                continue
            tree = trees.get(seq.draft_id)
            seq.draft = DraftedTree(
                tree if tree is not None else EMPTY_TREE,
                result.draft_ms if tree else 0.0,
                max(result.rpc_ms - result.draft_ms, 0.0),
                result.feature_bytes.get(seq.draft_id, 0),
            )

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

"""A step's work items: what each adds to the forward, what it asks of the LM head, how it commits.

- `VerifyItem`: a decoding sequence verifies its tree (the empty tree = one AR step). Its rows are the
  root and the tree's nodes at positions start + depth (siblings share one), each seeing the committed
  prefix and its ancestors only (tree mask).
- `PrefillItem`: prompt[start:end] of a prefilling sequence, causal, at absolute positions. The last
  chunk's last row chooses the first token; a prompt_logprobs request scores every row.

The batch (batch.py) and the scheduler call these methods and never ask which kind an item is.
"""

from __future__ import annotations

import dataclasses

import torch

from ddtree.contract.token_tree import TokenTree
from ddtree.verifier.constraints.grammar import GrammarStep
from ddtree.verifier.sequence import DraftedTree, Sequence
from ddtree.verifier.step.commit import ItemOutput, commit_prefill, commit_verify
from ddtree.verifier.step.step_outcome import StepOutcome
from ddtree.verifier.step.target import ItemHead
from ddtree.verifier.step.tree_mask import tree_input_ids, tree_mask, tree_positions


@dataclasses.dataclass(frozen=True)
class VerifyItem:
    seq: Sequence
    tree: TokenTree  # empty tree = one AR step
    drafted: DraftedTree | None = None  # what this step's Draft call reported (None: not drafted)
    speculating: bool = False  # the drafter holds this sequence's context after this step's Draft call
    lost: bool = False  # the drafter lost this sequence's context: it continues with AR (the same tokens)
    resend: bool = False  # the drafter lost its context: an AR step, then its context again (reset=True)
    grammar: GrammarStep | None = None  # a grammar's step (with_grammar): its rows' masks, for the commit

    @property
    def rows(self) -> int:
        return self.tree.n + 1

    @property
    def context(self) -> int:
        """Committed tokens before the item's rows."""
        return self.seq.context_len

    @property
    def verified_tree(self) -> TokenTree | None:
        return self.tree

    def forward_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(input ids [rows], positions [rows], mask among the new rows [rows, rows] or None = causal)."""
        tree = self.tree
        return tree_input_ids(tree, self.seq.root), tree_positions(tree, self.context), tree_mask(tree)

    def logit_rows(self) -> int:
        """How many of its rows (the last ones) the LM head reads: every node of the tree."""
        return self.rows

    def head(self) -> ItemHead:
        """Greedy trees need only the rows their accept walk reads; sampled ones, masked stop ids, logprobs
        and grammars need full logits (Sequence.wants_logits)."""
        greedy = not self.seq.wants_logits
        return ItemHead(rows=self.rows, walk=self.tree if greedy else None, sampled=not greedy)

    def with_grammar(self) -> VerifyItem:
        """The item a grammar-constrained sequence verifies: invalid nodes pruned, its rows' masks carried
        (grammar.py)."""
        if self.seq.grammar is None:
            return self
        step = self.seq.grammar.prepare(self.tree)
        return dataclasses.replace(self, tree=step.tree, grammar=step)

    def commit(self, out: ItemOutput, window: int) -> StepOutcome:
        return commit_verify(self, out, window)


@dataclasses.dataclass(frozen=True)
class PrefillItem:
    seq: Sequence
    start: int  # prompt[start:end] is this chunk
    end: int
    grammar: GrammarStep | None = None  # the last chunk of a grammar's sequence: the first token's mask

    @property
    def rows(self) -> int:
        return self.end - self.start

    @property
    def context(self) -> int:
        return self.start

    @property
    def verified_tree(self) -> TokenTree | None:
        return None

    @property
    def is_last(self) -> bool:
        return self.end == self.seq.prompt_len

    @property
    def scores_prompt(self) -> bool:
        """A prompt_logprobs request: the LM head runs on every row (row p scores prompt token p + 1)."""
        return self.seq.params.prompt_logprobs is not None

    def forward_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        ids = torch.tensor(self.seq.params.input_ids[self.start : self.end], dtype=torch.int64)
        return ids, torch.arange(self.start, self.end, dtype=torch.int64), None

    def logit_rows(self) -> int:
        """Every row for prompt logprobs, the last row of the last chunk, else none."""
        return self.rows if self.scores_prompt else int(self.is_last)

    def head(self) -> ItemHead:
        if self.scores_prompt:  # full logits of every row, at TP N too (logprobs.prompt_logprobs)
            return ItemHead(rows=self.rows, walk=None, sampled=True)
        return ItemHead(rows=int(self.is_last), walk=None, sampled=self.seq.wants_logits)

    def with_grammar(self) -> PrefillItem:
        if self.is_last and self.seq.grammar is not None:
            return dataclasses.replace(self, grammar=self.seq.grammar.prepare())  # the first token's mask
        return self

    def commit(self, out: ItemOutput, window: int) -> StepOutcome:
        return commit_prefill(self, out, window)


WorkItem = VerifyItem | PrefillItem

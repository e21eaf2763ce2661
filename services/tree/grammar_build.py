"""The draft tree of a grammar-constrained sequence, built on the verifier from the drafter's top-K table.

Pruning the drafter's own tree (verifier/constraints/grammar.py `prepare` alone, verifier setting `grammar_tree prune`) keeps
only the grammar-valid nodes of a tree chosen without the grammar: most of the budget goes to tokens the
grammar forbids, and a step commits about one token. With `grammar_tree table` (the default) the
scheduler asks the drafter for its per-depth top-K table (`table_width`) instead, and builds the tree
here with the same best-first build (best_first.py `build_tree`) under the predicate "this
token is allowed after its parent's path": the budget goes to the best grammar-valid prefixes.

The parent's mask is computed lazily, when its first child candidate pops, from a fork of the parent's
matcher (`LLMatcher.deep_copy`, about a microsecond) that consumes the parent's token: every node is
consumed at most once per build, nodes whose children never come up get no mask, and the sequence's own
matcher is never moved. A parser limit hit while building (the fork fails to consume the node's token or to
compute its mask) gives that node a mask that allows nothing: it gets no children, and its row is a dead end
only if the accept walk reaches it (grammar.py, dead ends), as plain constrained AR would meet the same limit
after the same tokens. Stop tokens (and llguidance's eos) are leaves (`LEAF`: no child candidate is even
pushed under them). The masks computed here are handed to `prepare` (`offer`), which walks the tree as before
(it keeps every node) but computes only the masks of the nodes whose children never came up: at most budget + 1
masks a step, as with pruning, so `grammar_limits` bounds it the same. The table was checked where the Draft
RPC returned it (drafter_client.py): the build does not check it again (`build_checked_tree`).

Which nodes are proposed changes, nothing else: the verifier's masked choice at every row is still the
only judge, so the output is exactly constrained AR (greedy token for token; sampled in distribution).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from ddtree.contract.token_tree import TokenTree

from .best_first import LEAF, MAX_TABLE_WIDTH, TokenTable, build_checked_tree


@dataclasses.dataclass(frozen=True)
class BuiltTree:
    """What the table build computed for this step's tree, for the grammar's `prepare` to reuse: by node
    (0 = the root), the mask of its row (all False where its path met a parser limit: `failed`)."""

    tree: TokenTree
    masks: dict[int, np.ndarray]
    failed: frozenset[int] = frozenset()


class SequenceGrammar(Protocol):
    """What the build needs of a sequence's grammar state (ddtree.verifier.constraints.grammar.SequenceGrammar)."""

    matcher: object  # llguidance LLMatcher at the sequence's current state: forked, never moved

    @property
    def stops(self) -> frozenset[int]: ...

    def mask_of(self, matcher=None) -> np.ndarray: ...

    def offer(self, built: BuiltTree) -> None: ...


# The table a grammar build asks for: the widest the Draft RPC gives. A grammar often allows a handful of tokens
# at a position (a quote, a digit, a key) and the drafter ranks those anywhere in its top 256, so tau under a
# grammar grows with K up to the widest table (docs/performance.md: tau by K on the demo pair,
# scripts/bench/bench_grammar.py). Its cost: 15 rows x 256 x 8 bytes = 30 KB a sequence on the wire, decoded and
# checked once where the RPC returns it (the build does not check it again), and a build that pops at most about
# (budget + 1) x K candidates.
GRAMMAR_TABLE_WIDTH = MAX_TABLE_WIDTH


def grammar_table_width(chain: bool, vocab_size: int) -> int:
    """The table width K a grammar-constrained sequence asks for: 1 for a chain (a chain is the tree of a
    width-1 table), else GRAMMAR_TABLE_WIDTH, at most `vocab_size` (the smaller of the target's and the
    drafter's vocabularies: the drafter refuses a wider table, and with it the whole Draft call)."""
    return 1 if chain else max(1, min(GRAMMAR_TABLE_WIDTH, vocab_size))


class GrammarPaths:
    """`allowed(parent, token)` for build_tree: may token follow the parent node's path under the grammar?

    It mirrors the tree as build_tree grows it (build_tree's call contract: one call per popped candidate,
    and the k-th truthy answer becomes node k; a LEAF answer, a stop token, is never a parent), keeping per
    node its token, its parent, and once its children come up its matcher fork and its children's mask (all
    False where the fork met a parser limit: `failed`)."""

    def __init__(self, grammar: SequenceGrammar):
        self.grammar = grammar
        self.tokens: list[int] = [-1]  # by node; node 0 is the root (its token is already consumed)
        self.parents: list[int] = [-1]
        self.forks: dict[int, object] = {}  # node -> its fork (the root's matcher is the sequence's: only copied)
        self.masks: dict[int, np.ndarray] = {}  # node -> the mask of its row (allowed children)
        self.failed: set[int] = set()  # nodes whose fork met a parser limit (their mask allows nothing)

    def __call__(self, parent: int, token: int) -> int:
        mask = self._children(parent)
        if token >= mask.shape[0] or not mask[token]:
            return False
        self.tokens.append(token)
        self.parents.append(parent)
        return LEAF if token in self.grammar.stops else True  # a stop token ends the answer

    def _children(self, node: int) -> np.ndarray:
        if node in self.masks:
            return self.masks[node]
        if node == 0:
            mask = self.grammar.mask_of()  # the sequence's matcher: computed, never moved
        else:
            parent = self.parents[node]  # its mask exists and allows this node, so its fork does too
            fork = (self.grammar.matcher if parent == 0 else self.forks[parent]).deep_copy()
            ok = fork.consume_token(self.tokens[node]) and not fork.is_error()
            mask = self.grammar.mask_of(fork) if ok else np.zeros_like(self._children(0))  # all False on an error
            if ok and not fork.is_error():
                self.forks[node] = fork
            else:  # a parser limit (an error state is sticky): this path ends here
                self.failed.add(node)
        self.masks[node] = mask
        return mask


def build_grammar_tree(grammar: SequenceGrammar, table: TokenTable, budget: int) -> TokenTree:
    """The best-first tree of `budget` grammar-valid prefixes of `table` (validated: TokenTable.validate) after
    the sequence's current state (the root consumed); its masks are offered to this step's `prepare`."""
    paths = GrammarPaths(grammar)
    tree = build_checked_tree(table, budget, paths)
    grammar.offer(BuiltTree(tree, paths.masks, frozenset(paths.failed)))
    return tree

"""The draft tree of a grammar-constrained sequence, built on the verifier from the drafter's top-K table.

Pruning the drafter's own tree (grammar.py `prepare` alone, verifier setting `grammar_tree prune`) keeps
only the grammar-valid nodes of a tree chosen without the grammar: most of the budget goes to tokens the
grammar forbids, and a step commits about one token. With `grammar_tree table` (the default) the
scheduler asks the drafter for its per-depth top-K table (`table_width`) instead, and builds the tree
here with the same best-first build (`ddtree.contract.tree_build.build_tree`) under the predicate "this
token is allowed after its parent's path": the budget goes to the best grammar-valid prefixes.

The parent's mask is computed lazily, when its first child candidate pops, from a fork of the parent's
matcher (`LLMatcher.deep_copy`, about a microsecond) that consumes the parent's token: every node is
consumed at most once per build, nodes whose children never come up get no mask, and the sequence's own
matcher is never moved (a parser limit hit while building leaves it as it was: that node gets no
children, and `prepare`, not offered its mask, meets the same limit on the sequence's matcher and ends
the sequence as a dead end, as for a pruned tree). Stop tokens (and llguidance's eos) are leaves. The
masks computed here are handed to `prepare` (`offer_masks`), which walks the tree as before (it keeps
every node) but computes only the masks of the nodes whose children never came up: at most budget + 1
masks a step, as with pruning, so `grammar_limits` bounds it the same.

Which nodes are proposed changes, nothing else: the verifier's masked choice at every row is still the
only judge, so the output is exactly constrained AR (greedy token for token; sampled in distribution).
"""

from __future__ import annotations

import numpy as np

from ddtree.contract.token_tree import TokenTree
from ddtree.contract.tree_build import MAX_TABLE_WIDTH, TokenTable, build_tree
from ddtree.verifier.grammar import SequenceGrammar

# The table a grammar build asks for: the widest the Draft RPC gives. A grammar often allows a handful of tokens
# at a position (a quote, a digit, a key) and the drafter ranks those anywhere in its top 256: measured on the
# demo pair (scripts/bench_grammar.py's prompts, temperature 0), tau at budget 8 is 1.10 / 1.23 / 1.46 / 1.72
# with K = 8 / 32 / 64 / 256, at budget 32 1.32 / 1.59 / 1.85 with K = 32 / 64 / 256. Its cost: 15 rows x 256 x
# 8 bytes = 30 KB a sequence on the wire, about 0.6 ms to decode and check, and a build that pops at most about
# (budget + 1) x K candidates (0.7 ms at budget 8, 1 ms at budget 32 on a 2-core CPU, masks included).
GRAMMAR_TABLE_WIDTH = MAX_TABLE_WIDTH


def grammar_table_width(chain: bool, vocab_size: int) -> int:
    """The table width K a grammar-constrained sequence asks for: 1 for a chain (a chain is the tree of a
    width-1 table), else GRAMMAR_TABLE_WIDTH, at most the vocabulary."""
    return 1 if chain else max(1, min(GRAMMAR_TABLE_WIDTH, vocab_size))


class GrammarPaths:
    """`allowed(parent, token)` for build_tree: may token follow the parent node's path under the grammar?

    It mirrors the tree as build_tree grows it (build_tree's call contract: one call per popped candidate,
    and the k-th True answer becomes node k), keeping per node its token, its parent, and once its
    children come up its matcher fork and its children's mask (None: a leaf, a stop token or a consume
    the grammar refused)."""

    def __init__(self, grammar: SequenceGrammar):
        self.grammar = grammar
        self.tokens: list[int] = [-1]  # by node; node 0 is the root (its token is already consumed)
        self.parents: list[int] = [-1]
        self._matchers = {0: grammar.matcher}  # the root's is the sequence's own: only copied, never moved
        self.masks: dict[int, np.ndarray | None] = {}  # node -> the mask of its row (allowed children)
        # Nodes whose mask put their fork in an error state (a parser limit): allowing nothing here, but
        # not offered to prepare, which computes them on the sequence's matcher and ends the sequence as
        # it does for a pruned tree.
        self.failed: set[int] = set()

    def __call__(self, parent: int, token: int) -> bool:
        mask = self._children(parent)
        ok = mask is not None and token < mask.shape[0] and bool(mask[token])
        if ok:
            self.tokens.append(token)
            self.parents.append(parent)
        return ok

    def _children(self, node: int) -> np.ndarray | None:
        if node in self.masks:
            return self.masks[node]
        mask = None
        if node == 0:
            mask = self.grammar.mask_of()
        elif self.tokens[node] not in self.grammar.stops:  # a stop token ends the answer: a leaf
            fork = self._matchers[self.parents[node]].deep_copy()  # the parent's mask exists, so its fork does
            if fork.consume_token(self.tokens[node]) and not fork.is_error():
                self._matchers[node] = fork
                mask = self.grammar.mask_of(fork)
                if fork.is_error():
                    self.failed.add(node)
        self.masks[node] = mask
        return mask


def build_grammar_tree(grammar: SequenceGrammar, table: TokenTable, budget: int) -> TokenTree:
    """The best-first tree of `budget` grammar-valid prefixes of `table` after the sequence's current state
    (the root consumed); its masks are offered to this step's `prepare`."""
    paths = GrammarPaths(grammar)
    tree = build_tree(table.logprobs, table.token_ids, budget, paths)
    usable = {node: mask for node, mask in paths.masks.items() if mask is not None and node not in paths.failed}
    grammar.offer_masks(tree, usable)
    return tree

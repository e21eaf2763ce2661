"""Structured outputs on trees: a request's grammar follows every path of its draft tree.

A sequence with a grammar (`GenerateRequest.grammar`, an llguidance grammar the gateway compiled from a
JSON schema, regex, choice, Lark grammar or forced tool call) holds one `llguidance.LLMatcher` whose
state is the grammar after every emitted token (the root included). Each step, before the forward:

- `prepare(tree)`: walk the tree depth-first from the root; node v (token t, parent p) stays only if t
  is allowed in p's state, else v and its subtree are pruned (no accepted path can hold a token the
  target may not choose, so pruning never changes the output, only the rows verified). For a kept node
  the matcher consumes t, the mask of v's children is computed, and the matcher rolls back one token.
  The masks of the rows [root, kept nodes] are kept for the commit.
- the commit (`commit._choices`) sets the logits of disallowed tokens to -inf per row before the argmax
  or the sample, so every target choice is the constrained AR choice given that node's path: the walk
  accepts exactly constrained AR's tokens (greedy) and samples from the masked distribution (T > 0).
- `advance(tokens)`: the emitted tokens (accepted nodes + bonus) move the matcher on.

The tree itself (verifier setting `grammar_tree`): `table` (the default) asks the drafter for its top-K
table and builds the tree of grammar-valid prefixes only (grammar_tree.py), whose masks `prepare` reuses
(`offer_masks`), so the walk keeps every node; `prune` takes the drafter's own tree and prunes it here.

Stop ids: allowed in a row exactly when the grammar accepts there (llguidance's own eos likewise); a
finished grammar allows nothing else, so the answer stops at the grammar's end. A stop node of the tree
(or llguidance's eos) is kept when allowed but neither consumed nor descended (the answer ends there).

Dead ends: a matcher in an error state (a parser limit hit, `grammar_limits`, or a token it refused)
allows nothing: its rows' masks are all False (llguidance itself would allow its eos, which would end
the answer as if the grammar were done). A row that allows nothing (that, or a finished grammar whose
stop ids min_tokens masks) is a dead end: the commit chooses `DEAD_END` there and the scheduler ends
that sequence alone ("stop" when the grammar accepts, else an error naming llguidance's reason).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ddtree.contract.token_tree import EMPTY_TREE, TokenTree

DEAD_END = -1  # the choice of a row whose mask allows no token (never a tree token: ids are >= 0)


def grammar_limits():
    """llguidance's parser limits for one matcher, tighter than its defaults so that a hostile grammar
    cannot hold the scheduler thread: one mask costs about 7 ms at most (lexer fuel ~14k/ms: 100k,
    default 200k; Earley items ~20k/ms: 20k, default 50k), a grammar row branches at most 1000 ways
    (default 2000); a step computes one mask per kept tree node plus the root, so a sequence's masks
    take at most about (budget + 1) x 7 ms a step. The 20 JSON schemas of tests/test_structured_outputs.py
    run well inside them. A grammar past a limit puts its matcher in an error state: a dead end of that
    sequence only. Construction limits (initial fuel, lexer states, grammar size) stay llguidance's:
    a matcher is built on the RPC thread. verbose_errors off: messages without the parser's state."""
    import llguidance

    return llguidance.LLParserLimits(
        step_lexer_fuel=100_000, step_max_items=20_000, max_items_in_row=1000, verbose_errors=False
    )


def new_matcher(tokenizer, grammar: str):
    """An `llguidance.LLMatcher` of `grammar` under `grammar_limits`; check `is_error()` (never raises
    for a bad grammar)."""
    import llguidance

    return llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=grammar_limits())


def matcher_error(matcher) -> str:
    """llguidance's reason for an error state (without the marker of its non-verbose state dump)."""
    return matcher.get_error().replace("<non-verbose/>", "").strip() or "unknown error"


class SequenceGrammar:
    """The grammar state of one sequence, and this step's masks (rows: root, then the kept nodes)."""

    def __init__(self, matcher, stop_ids: frozenset[int], eos_ids: tuple[int, ...] = ()):
        self.matcher = matcher
        self.stop_ids = sorted(stop_ids)
        # Tokens that end the answer: the matcher never consumes them (llguidance's eos does not roll back).
        self._stops = stop_ids | frozenset(eos_ids)
        self.masks: torch.Tensor | None = None  # bool [rows, tokenizer vocab]
        # This step's tree as grammar_tree.py built it and the masks it computed by node (the rows prepare needs).
        self._offered: tuple[TokenTree, dict[int, np.ndarray]] | None = None
        # Totals for measuring: masks computed, their seconds, tree nodes drafted and kept.
        self.mask_count = 0
        self.mask_s = 0.0
        self.drafted_nodes = 0
        self.kept_nodes = 0

    @property
    def stops(self) -> frozenset[int]:
        """The tokens that end the answer (stop ids and llguidance's eos): a tree's stop node is a leaf."""
        return self._stops

    def mask_of(self, matcher=None) -> np.ndarray:
        """bool [tokenizer vocab]: the tokens allowed after `matcher`'s state (default: the sequence's)."""
        matcher = self.matcher if matcher is None else matcher
        t0 = time.perf_counter()
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little").astype(bool)
        if matcher.is_error():  # llguidance would allow its eos there: nothing is allowed
            allowed[:] = False
        elif self.stop_ids:
            ids = [i for i in self.stop_ids if i < allowed.shape[0]]
            allowed[ids] = matcher.is_accepting()
        self.mask_s += time.perf_counter() - t0
        self.mask_count += 1
        return allowed

    def offer_masks(self, tree: TokenTree, masks: dict[int, np.ndarray]) -> None:
        """Masks already computed for this step's tree (node -> its row's mask, from the sequence's current
        state along the node's path): `prepare` of this tree, or of a prefix of it, takes them instead of
        computing them again."""
        self._offered = (tree, masks)

    def _known_masks(self, tree: TokenTree) -> dict[int, np.ndarray]:
        offered, self._offered = self._offered, None
        if offered is None or tree.n > offered[0].n or tree != offered[0].prefix(tree.n):
            return {}
        return offered[1]

    def prepare(self, tree: TokenTree = EMPTY_TREE) -> TokenTree:
        """The tree with grammar-invalid nodes (and their subtrees) pruned; sets this step's masks. A matcher
        in an error state (before or during the walk) gives no tree and a root that allows nothing."""
        known = self._known_masks(tree)
        children: list[list[int]] = [[] for _ in range(tree.n + 1)]
        for i, parent in enumerate(tree.parents, start=1):
            children[parent].append(i)
        masks = {0: known[0] if 0 in known else self.mask_of()}
        if self.matcher.is_error():
            return self._dead(masks[0], tree)
        stack = [(0, 0)]  # (node, next child position); the matcher holds the path to the top node
        while stack:
            node, at = stack[-1]
            if at == len(children[node]):
                stack.pop()
                if node:
                    self.matcher.rollback(1)
                continue
            stack[-1] = (node, at + 1)
            child = children[node][at]
            tok = tree.token_ids[child - 1]
            parent_mask = masks[node]
            if tok >= parent_mask.shape[0] or not parent_mask[tok]:
                continue
            if tok in self._stops:
                masks[child] = parent_mask  # never read past: the answer ends at a stop token
                continue
            if not self.matcher.consume_token(tok) or self.matcher.is_error():  # a parser limit, say
                return self._dead(masks[0], tree)
            masks[child] = known[child] if child in known else self.mask_of()
            stack.append((child, 0))
        kept = sorted(k for k in masks if k)
        self.drafted_nodes += tree.n
        self.kept_nodes += len(kept)
        self.masks = torch.from_numpy(np.stack([masks[0]] + [masks[k] for k in kept]))
        if len(kept) == tree.n:
            return tree
        index = {old: new for new, old in enumerate(kept, start=1)}
        return TokenTree(
            tuple(tree.token_ids[k - 1] for k in kept),
            tuple(index.get(tree.parents[k - 1], 0) for k in kept),
            tuple(tree.depths[k - 1] for k in kept),
            tuple(tree.scores[k - 1] for k in kept) if tree.scores else (),
        )

    def _dead(self, root_mask: np.ndarray, tree: TokenTree) -> TokenTree:
        """The step of a matcher in an error state: no tree, a root row that allows nothing."""
        self.drafted_nodes += tree.n
        self.masks = torch.zeros((1, root_mask.shape[0]), dtype=torch.bool)
        return EMPTY_TREE

    def dead_end_reason(self) -> str:
        """Why a row allowed no token, for the client."""
        if self.matcher.is_error():
            return f"llguidance: {matcher_error(self.matcher)}"
        return "llguidance: the grammar allows no token here"

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [rows, V] with this step's disallowed tokens at -inf (ids past the tokenizer's vocab too)."""
        assert self.masks is not None and self.masks.shape[0] == logits.shape[0], "prepare() the step first"
        vocab = logits.shape[-1]
        allowed = torch.zeros(logits.shape, dtype=torch.bool)
        width = min(vocab, self.masks.shape[1])
        allowed[:, :width] = self.masks[:, :width]
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def advance(self, tokens: list[int]) -> None:
        """The matcher after the emitted tokens (up to a stop token, which ends the answer)."""
        self.masks = None
        self._offered = None
        for tok in tokens:
            if tok in self._stops:
                return
            if not self.matcher.consume_token(tok):  # the next step's masks allow nothing: a dead end there
                return

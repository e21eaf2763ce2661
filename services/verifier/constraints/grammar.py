"""Structured outputs on trees: a request's grammar follows every path of its draft tree.

A sequence with a grammar (`GenerateRequest.grammar`, an llguidance grammar the gateway compiled from a
JSON schema, regex, choice, Lark grammar or forced tool call) holds one `llguidance.LLMatcher` whose
state is the grammar after every emitted token (the root included). Each step, before the forward:

- `prepare(tree)`: walk the tree depth-first from the root; node v (token t, parent p) stays only if t
  is allowed in p's state, else v and its subtree are pruned (no accepted path can hold a token the
  target may not choose, so pruning never changes the output, only the rows verified). For a kept node
  the walk consumes t, the mask of v's children is computed, and the walk rolls back one token. The walk
  runs on a copy of the sequence's matcher (`deep_copy`), never on the sequence's own: a parser limit met
  on a draft path puts only the copy in an error state (below). It returns a `GrammarStep`: the kept
  tree and the masks of the rows [root, kept nodes], which the work item carries to its commit.
- the commit (`commit._choices`, `mask_logits`) sets the logits of disallowed tokens to -inf per row before the argmax
  or the sample, so every target choice is the constrained AR choice given that node's path: the walk
  accepts exactly constrained AR's tokens (greedy) and samples from the masked distribution (T > 0).
- `advance(tokens, step)`: the emitted tokens (accepted nodes + bonus) move the sequence's matcher on: the
  only place its state moves (apply.py calls it with the step's `GrammarStep`, from the outcome).

The tree itself (verifier setting `grammar_tree`): `table` (the default) asks the drafter for its top-K
table and builds the tree of grammar-valid prefixes only (ddtree.tree.grammar_build), whose masks `prepare` reuses
(`offer`), so the walk keeps every node; `prune` takes the drafter's own tree and prunes it here.

Stop ids: allowed in a row exactly when the grammar accepts there (llguidance's own eos likewise); a
finished grammar allows nothing else, so the answer stops at the grammar's end. A stop node of the tree
(or llguidance's eos) is kept when allowed but neither consumed nor descended (the answer ends there).

Dead ends: a matcher in an error state (a parser limit hit, `grammar_limits`, or a token it refused)
allows nothing: its rows' masks are all False (llguidance itself would allow its eos, which would end
the answer as if the grammar were done). A row that allows nothing (that, or a finished grammar whose
stop ids min_tokens masks) is a dead end: the commit marks the outcome (`StepOutcome.dead_end`) where
the accept walk ends on such a row, and apply.py ends that sequence alone ("stop" when the grammar
accepts, else an error naming llguidance's reason). A
parser limit met on a draft path (a node whose token or mask puts the walk's copy, or the build's fork,
in an error state) costs that node's row only: it allows nothing, and it is a dead end only where the
accept walk reaches it, exactly where plain constrained AR decoding would meet the same limit (a limit is
a function of the matcher's state, so the sequence's matcher meets it after the same tokens: `advance`
then computes the next mask at once, so that the matcher's error is what the dead end reads). A step
whose root allows nothing (the sequence's own matcher, after the emitted tokens, is stuck) verifies no tree.
"""

from __future__ import annotations

import dataclasses
import time

import llguidance
import numpy as np
import torch

from ddtree.contract.token_tree import EMPTY_TREE, TokenTree
from ddtree.tree.grammar_build import BuiltTree


def grammar_limits():
    """llguidance's parser limits for one matcher, tighter than its defaults so that a hostile grammar
    cannot hold the scheduler thread: lexer fuel 100k a mask (default 200k), Earley items 20k (default
    50k), a grammar row branches at most 1000 ways (default 2000), which bounds the time of one mask
    (docs/performance.md has the bound as measured); a step computes one mask per kept tree node plus the root
    (the table build and `prepare` together: a mask the build computed is not computed again) and consumes one
    token per kept node (on a copy of the matcher), so a sequence's masks take at most about (budget + 1)
    such bounds a step.
    The 20 JSON schemas of tests/verifier/test_structured_outputs.py run well inside them. A grammar past a limit
    puts its matcher in an error state: on a draft path, a row that allows nothing (a dead end only where
    the accept walk reaches it); after the emitted tokens, a dead end of that sequence only. Construction
    limits (initial fuel, lexer states, grammar size) stay llguidance's:
    a matcher is built on the RPC thread. verbose_errors off: messages without the parser's state."""
    return llguidance.LLParserLimits(
        step_lexer_fuel=100_000, step_max_items=20_000, max_items_in_row=1000, verbose_errors=False
    )


def new_matcher(tokenizer, grammar: str):
    """An `llguidance.LLMatcher` of `grammar` under `grammar_limits`; check `is_error()` (never raises
    for a bad grammar)."""
    return llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=grammar_limits())


def matcher_error(matcher) -> str:
    """llguidance's reason for an error state (without the marker of its non-verbose state dump)."""
    return matcher.get_error().replace("<non-verbose/>", "").strip() or "unknown error"


class _Walk:
    """A copy of the sequence's matcher that walks a tree depth first: `down` consumes a child's token, `up`
    rolls it back. A parser limit puts it in an error state that rollback does not undo: `restart` goes on
    from a copy of it taken at the parent before its first child was consumed (one copy per node walked
    under, the root's being the sequence's own matcher, which the walk never moves)."""

    def __init__(self, matcher):
        self.matcher = matcher.deep_copy()
        self._at: dict[int, object] = {0: matcher}  # node -> the matcher at its path, untouched

    def down(self, node: int, token: int) -> bool:
        """Consume token under node (the walk is at node's path); False where the matcher refuses it."""
        if node not in self._at:
            self._at[node] = self.matcher.deep_copy()
        return self.matcher.consume_token(token) and not self.matcher.is_error()

    def up(self, node: int) -> None:
        """Back from node (its subtree walked) to its parent's path."""
        if node:
            self._at.pop(node, None)
            self.matcher.rollback(1)

    def restart(self, node: int) -> None:
        """The walk at node's path again, after a child's token put the matcher in an error state."""
        self.matcher = self._at[node].deep_copy()


@dataclasses.dataclass(frozen=True)
class GrammarStep:
    """One step's grammar for one sequence, as `prepare` computed it: a value the work item carries to its
    commit (the masks) and the outcome to `advance` (the walked matcher, the limit)."""

    tree: TokenTree  # the tree kept (grammar-invalid nodes and their subtrees pruned)
    masks: torch.Tensor  # bool [rows, tokenizer vocab]: root, then the kept nodes in order
    # The walk's copy of the sequence's matcher, back at the sequence's state, with what llguidance cached
    # while walking (its caches are per matcher): `advance` goes on from it. None: the sequence's own.
    matcher: object | None = None
    limit_met: bool = False  # a parser limit was met on a kept node's path: `advance` computes the next mask


def mask_logits(masks: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, V] with the disallowed tokens of masks [rows, tokenizer vocab] at -inf (ids past the
    tokenizer's vocab too)."""
    vocab = logits.shape[-1]
    allowed = torch.zeros(logits.shape, dtype=torch.bool)
    width = min(vocab, masks.shape[1])
    allowed[:, :width] = masks[:, :width]
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


class SequenceGrammar:
    """The grammar state of one sequence: its matcher after the emitted tokens (steps: `GrammarStep`)."""

    def __init__(self, matcher, stop_ids: frozenset[int], eos_ids: tuple[int, ...] = ()):
        self.matcher = matcher
        self.stop_ids = sorted(stop_ids)
        # Tokens that end the answer: the matcher never consumes them (llguidance's eos does not roll back).
        self._stops = stop_ids | frozenset(eos_ids)
        # The mask after the sequence's matcher (this step's root row), computed once until `advance` moves it.
        self._root: np.ndarray | None = None
        self._offered: BuiltTree | None = None  # this step's tree as ddtree.tree.grammar_build built it
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
        """bool [tokenizer vocab]: the tokens allowed after `matcher`'s state (default: the sequence's, computed
        once per state: do not write to it). A matcher in an error state allows nothing."""
        if matcher is None:
            if self._root is None:
                self._root = self._compute(self.matcher)
            return self._root
        return self._compute(matcher)

    def _compute(self, matcher) -> np.ndarray:
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

    def offer(self, built: BuiltTree) -> None:
        """What the table build computed for this step's tree (masks from the sequence's current state along
        each node's path): `prepare` of this tree, or of a prefix of it, reuses them."""
        self._offered = built

    def _known(self, tree: TokenTree) -> BuiltTree | None:
        offered, self._offered = self._offered, None
        if offered is None or tree.n > offered.tree.n or tree != offered.tree.prefix(tree.n):
            return None
        return offered

    def prepare(self, tree: TokenTree = EMPTY_TREE) -> GrammarStep:
        """This step's `GrammarStep`: the tree with grammar-invalid nodes (and their subtrees) pruned, and its
        rows' masks. The sequence's matcher in an error state (it allows nothing after the emitted tokens)
        gives no tree and a root that allows nothing; a parser limit met on a node's path gives that node's
        row no allowed token (a dead end only if the accept walk reaches it). The tree is walked on a copy of
        the sequence's matcher (_Walk), which the step carries (`advance` goes on from it); the sequence's
        own matcher is not touched."""
        built = self._known(tree)
        known = built.masks if built is not None else {}
        root = known[0] if 0 in known else self.mask_of()
        if self.matcher.is_error():
            return self._dead(root, tree)
        if not tree.n:  # an AR step: the root's row only
            return GrammarStep(tree, torch.from_numpy(root[None].copy()))
        children: list[list[int]] = [[] for _ in range(tree.n + 1)]
        for i, parent in enumerate(tree.parents, start=1):
            children[parent].append(i)
        rows = {0: root}  # node -> its row's mask, for the kept nodes
        failed = set(built.failed) if built is not None else set()  # kept nodes whose path met a parser limit
        walk = _Walk(self.matcher)
        stack = [(0, 0)]  # (node, next child position); the walk is at the top node's path
        while stack:
            node, at = stack[-1]
            if at == len(children[node]):
                stack.pop()
                walk.up(node)
                continue
            stack[-1] = (node, at + 1)
            child = children[node][at]
            tok = tree.token_ids[child - 1]
            allowed = rows[node]
            if tok >= allowed.shape[0] or not allowed[tok]:
                continue
            if tok in self._stops or child in failed or (child in known and not children[child]):
                # a stop token (its row is never read past: the answer ends there), a node the build found
                # limited, or a built leaf: its row is known and nothing is walked under it
                rows[child] = allowed if tok in self._stops else known[child]
                continue
            if walk.down(node, tok):
                rows[child] = known[child] if child in known else self.mask_of(walk.matcher)
                if not walk.matcher.is_error():
                    stack.append((child, 0))
                    continue
            rows[child] = np.zeros_like(root)  # a parser limit on this path (an error state is sticky)
            failed.add(child)
            walk.restart(node)
        kept = sorted(k for k in rows if k)
        self.drafted_nodes += tree.n
        self.kept_nodes += len(kept)
        masks = torch.from_numpy(np.stack([root] + [rows[k] for k in kept]))
        limit_met = bool(failed.intersection(kept))
        if len(kept) < tree.n:
            index = {old: new for new, old in enumerate(kept, start=1)}
            tree = TokenTree(
                tuple(tree.token_ids[k - 1] for k in kept),
                tuple(index.get(tree.parents[k - 1], 0) for k in kept),
                tuple(tree.depths[k - 1] for k in kept),
                tuple(tree.scores[k - 1] for k in kept) if tree.scores else (),
            )
        return GrammarStep(tree, masks, walk.matcher, limit_met)

    def _dead(self, root_mask: np.ndarray, tree: TokenTree) -> GrammarStep:
        """The step of a matcher in an error state: no tree, a root row that allows nothing."""
        self.drafted_nodes += tree.n
        return GrammarStep(EMPTY_TREE, torch.zeros((1, root_mask.shape[0]), dtype=torch.bool))

    def dead_end_reason(self) -> str:
        """Why a row allowed no token, for the client."""
        if self.matcher.is_error():
            return f"llguidance: {matcher_error(self.matcher)}"
        return "llguidance: the grammar allows no token here"

    def advance(self, tokens: list[int], step: GrammarStep | None = None) -> None:
        """The matcher after the emitted tokens (up to a stop token, which ends the answer), going on from
        the step's walked matcher (the same state) when it has one. After a step whose walk met a parser
        limit on a kept node's path, the next mask is computed now (the next step takes it): where the
        emitted tokens end at that node (its row allowed nothing, a dead end), the matcher meets the same
        limit here, so the dead end reads its error, as plain decoding's next step would."""
        self._offered = None
        self._root = None
        if step is not None and step.matcher is not None:
            self.matcher = step.matcher
        limit_met = step is not None and step.limit_met
        for tok in tokens:
            if tok in self._stops:
                return
            if not self.matcher.consume_token(tok):  # the next step's masks allow nothing: a dead end there
                break
        if limit_met:
            self.mask_of()

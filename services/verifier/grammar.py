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

Stop ids: allowed in a row exactly when the grammar accepts there (llguidance's own eos likewise); a
finished grammar allows nothing else, so the answer stops at the grammar's end. A stop node of the tree
(or llguidance's eos) is kept when allowed but neither consumed nor descended (the answer ends there).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ddtree.contract.token_tree import EMPTY_TREE, TokenTree


class SequenceGrammar:
    """The grammar state of one sequence, and this step's masks (rows: root, then the kept nodes)."""

    def __init__(self, matcher, stop_ids: frozenset[int], eos_ids: tuple[int, ...] = ()):
        self.matcher = matcher
        self.stop_ids = sorted(stop_ids)
        # Tokens that end the answer: the matcher never consumes them (llguidance's eos does not roll back).
        self._stops = stop_ids | frozenset(eos_ids)
        self.masks: torch.Tensor | None = None  # bool [rows, tokenizer vocab]
        # Totals for measuring: masks computed, their seconds, tree nodes drafted and kept.
        self.mask_count = 0
        self.mask_s = 0.0
        self.drafted_nodes = 0
        self.kept_nodes = 0

    def _mask(self) -> np.ndarray:
        t0 = time.perf_counter()
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little").astype(bool)
        if self.stop_ids:
            ids = [i for i in self.stop_ids if i < allowed.shape[0]]
            allowed[ids] = self.matcher.is_accepting()
        self.mask_s += time.perf_counter() - t0
        self.mask_count += 1
        return allowed

    def prepare(self, tree: TokenTree = EMPTY_TREE) -> TokenTree:
        """The tree with grammar-invalid nodes (and their subtrees) pruned; sets this step's masks."""
        children: list[list[int]] = [[] for _ in range(tree.n + 1)]
        for i, parent in enumerate(tree.parents, start=1):
            children[parent].append(i)
        masks = {0: self._mask()}
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
            if not self.matcher.consume_token(tok):
                raise RuntimeError(f"grammar matcher refused an allowed token {tok}: {self.matcher.get_error()}")
            masks[child] = self._mask()
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
        for tok in tokens:
            if tok in self._stops:
                return
            if not self.matcher.consume_token(tok):
                raise RuntimeError(f"grammar matcher refused emitted token {tok}: {self.matcher.get_error()}")

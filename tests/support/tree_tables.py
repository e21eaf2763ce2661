"""Random draft tables and brute-force references for tree builds (tests of tree/best_first.py and tree/grammar_build.py)."""

from __future__ import annotations

import itertools

import torch

from ddtree.contract.token_tree import TokenTree
from ddtree.tree.best_first import topk_logprobs


def random_table(depth: int, width: int, vocab: int, seed: int, quantize: float | None = None):
    """A [D, K] table as the drafter would give it: top-K of log_softmax, sorted, distinct ids."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(depth, vocab, generator=g) * 2
    if quantize:  # coarse logits -> many exact score ties
        logits = (logits / quantize).round() * quantize
    return topk_logprobs(logits, width)


def brute_force(lp: torch.Tensor, ids: torch.Tensor, budget: int):
    """All rank-tuple prefixes, scored by the left-to-right sum of per-depth log-probs, sorted by
    (-score, ranks), first `budget`. Returns [(ranks, tokens, score)]."""
    depth, width = lp.shape
    table, tok = lp.tolist(), ids.tolist()
    out = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(width), repeat=d):
            score = 0.0
            for j, r in enumerate(ranks):
                score += table[j][r]
            out.append((ranks, tuple(tok[j][r] for j, r in enumerate(ranks)), score))
    out.sort(key=lambda x: (-x[2], x[0]))
    return out[:budget]


def node_paths(tree: TokenTree) -> list[tuple[int, ...]]:
    """Token path root..node (excluding root) for nodes 1..n."""
    paths: list[tuple[int, ...]] = [()]
    for tok, parent in zip(tree.token_ids, tree.parents):
        paths.append(paths[parent] + (tok,))
    return paths[1:]

"""The drafter's entry point: the trees (or top-K tables) of every sequence of one Draft call.

On an accelerator the trees are built with tensor ops, all sequences at once (device_build.py: one host read
of the finished trees); on the CPU by the heap (best_first.py: the same trees, node for node and score for
score; there its few Python steps cost less than the tensor build's ops). Chains (width 1) and wider trees
are built as two batches.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree.contract.token_tree import TokenTree

from .best_first import TokenTable, build_tree
from .device_build import build_trees


def drafted_trees(
    logprobs: Tensor,  # fp32 [S, D, K], each row sorted descending (topk_logprobs)
    token_ids: Tensor,  # int64 [S, D, K]
    widths: list[int],  # [S] the columns sequence s uses (its k <= K)
    budgets: list[int],  # [S] nodes of its tree
    tables: list[bool],  # [S] True: it asked for its table, not a tree
    chains: list[bool],  # [S] a chain (width 1)
    on_device: bool,  # build the trees with tensor ops where the tensors are
) -> list[TokenTree | TokenTable]:
    S = logprobs.shape[0]
    out: list[TokenTree | TokenTable | None] = [None] * S
    if on_device:
        for chain in (False, True):
            rows = [s for s in range(S) if not tables[s] and chains[s] == chain]
            if rows:
                k = 1 if chain else max(widths[s] for s in rows)
                idx = torch.tensor(rows, device=logprobs.device)
                built = build_trees(logprobs[idx, :, :k], token_ids[idx, :, :k], [budgets[s] for s in rows])
                for s, tree in zip(rows, built):
                    out[s] = tree
    if all(o is not None for o in out):
        return out
    logprobs, token_ids = logprobs.cpu(), token_ids.cpu()  # tables, and the trees built on the host
    for s in range(S):
        k = widths[s]
        if tables[s]:
            out[s] = TokenTable(logprobs[s, :, :k].contiguous(), token_ids[s, :, :k].contiguous())
        elif out[s] is None:
            out[s] = build_tree(logprobs[s, :, :k], token_ids[s, :, :k], budgets[s])
    return out

"""Target-side inputs for verifying one DDTree token tree (docs/design.md §3.3).

The tree is flattened to T = n + 1 rows: row 0 is the root (the last emitted token, not yet in
the target KV cache), rows 1..n are the nodes in pop order. Pure functions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree.contract.token_tree import TokenTree


def tree_mask(tree: TokenTree) -> Tensor:
    """Ancestor-or-self visibility within the tree: BoolTensor [n+1, n+1].

    mask[i, j] is True iff node j is node i or one of its ancestors; the root (row/col 0) is an
    ancestor of every node, and the root row sees only itself. All committed context (the target KV
    cache before the root) is visible to every row as well; that part is not represented here.

    Built level by level: every row marks itself, then its parent, its grandparent, ... (the root is
    its own parent here, so rows that reached it just mark it again): max depth vectorised steps.
    """
    tree.validate()
    t = tree.n + 1
    parent = torch.tensor((0,) + tuple(tree.parents), dtype=torch.int64)  # [T]
    mask = torch.eye(t, dtype=torch.bool)  # [T, T]
    rows = torch.arange(t)
    node = rows
    for _ in range(max(tree.depths, default=0)):
        node = parent[node]  # [T]: each row's ancestor one level further up
        mask[rows, node] = True
    return mask


def tree_positions(tree: TokenTree, start: int) -> Tensor:
    """Absolute positions LongTensor [n+1]: root at `start`, node i at start + depth(i).

    Siblings share a position; the accepted path has depths 0..len-1, so after compaction its KV
    entries sit exactly at the positions they were computed at.
    """
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    return torch.tensor((start,) + tuple(start + d for d in tree.depths), dtype=torch.long)


def tree_input_ids(tree: TokenTree, root_token: int) -> Tensor:
    """Input ids LongTensor [n+1]: the root token, then the node tokens in node order."""
    if root_token < 0:
        raise ValueError(f"root_token must be >= 0, got {root_token}")
    return torch.tensor((root_token,) + tuple(tree.token_ids), dtype=torch.long)

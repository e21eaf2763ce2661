"""Greedy verify computes the LM head only along the accept walk.

At temperature 0 the accept walk (accept.py) reads the target's argmax at the root, moves to the child
carrying that token, reads the argmax there, and so on: of a tree's n + 1 rows it reads only the
accepted nodes', accepted drafts + 1 of them. So the verifier takes the final-normed hidden states of
all rows from the forward and runs the LM head level by level: one matmul per tree depth over the
current node of every greedy sequence still walking (at most max depth + 1 matmuls of at most S rows,
instead of one over all S·(n+1) rows). On the CPU the LM head [rows, d] x [d, V] is a large part of a
verify step; with 8 sequences of 17 rows it is 136 rows where about S·tau are read.

The result is what accept() needs: per tree node the argmax where the walk reads it, -1 where it never
does. accept() then walks the same path (same tree, same choices), so nothing else changes.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from services.drafter.tree import TokenTree

NOT_READ = -1


def greedy_walk_choices(trees: Sequence[TokenTree], hidden: Sequence[torch.Tensor],
                        lm_head: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """trees[s] with hidden[s] [n_s + 1, d] (row 0 = root, row i = node i; final-normed) -> per sequence
    int64 [n_s + 1]: the argmax of lm_head(hidden row) at the nodes the accept walk reads, -1 elsewhere.

    lm_head: [k, d] -> [k, V] logits, applied once per tree depth to the walking sequences' current rows.
    """
    if len(trees) != len(hidden):
        raise ValueError(f"{len(trees)} trees but {len(hidden)} hidden-state blocks")
    for s, (tree, h) in enumerate(zip(trees, hidden)):
        if h.dim() != 2 or h.shape[0] != tree.n + 1:
            raise ValueError(f"hidden[{s}] has shape {tuple(h.shape)}, expected [{tree.n + 1}, d]")
    choices = [torch.full((tree.n + 1,), NOT_READ, dtype=torch.int64) for tree in trees]
    children = [tree.child_maps() for tree in trees]
    walking = {s: 0 for s in range(len(trees))}  # sequence -> its current node
    while walking:
        order = list(walking)
        rows = torch.stack([hidden[s][walking[s]] for s in order])  # [k, d]
        picked = lm_head(rows).argmax(dim=-1).tolist()  # [k]
        for s, token in zip(order, picked):
            node = walking[s]
            choices[s][node] = token
            child = children[s][node].get(token)
            if child is None:
                del walking[s]  # the walk stops here: token is the bonus
            else:
                walking[s] = child
    return choices

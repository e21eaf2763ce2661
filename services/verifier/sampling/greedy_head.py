"""Greedy verify computes the LM head only where the accept walk can read it.

At temperature 0 the accept walk (accept.py) reads the target's argmax at the root, moves to the child
carrying that token, reads the argmax there, and so on: of a tree's n + 1 rows it reads only the
accepted nodes', accepted drafts + 1 of them. So the verifier takes the final-normed hidden states of
all rows from the forward and runs the LM head on rows the walk is likely to read, in rounds.

A round takes, for every sequence still walking, the *primary chain* from its current node: the node,
its first child, that child's first child, ... down to a leaf. The tree is built best-first, so a
node's first child is the drafter's most likely continuation, and a walk that agrees with the drafter
stays on this chain. All chains of the round go through one LM-head matmul; each walk then advances
over its computed rows until it stops (the bonus) or moves to a child off the chain, where its next
round starts. Rounds = 1 + the times a walk leaves its primary chain; each row is computed at most
once.

Why chains and not one row per depth: the LM head [k, d] x [d, V] costs about a fixed weight read
(d·V floats, the same for 1 row or 8) plus a per-row part. One row per depth pays the fixed part
tau times per step (tau = tokens committed a step); a chain pays it about once, for a few rows that may go
unread. Against the full head over all S·(n + 1) rows it skips the side branches, which are most rows
of a wide tree. On the demo's CPU, chains took less LM-head time per step than one row per depth at
1 and at 8 sequences (docs/performance.md).

The result is what accept() needs: per tree node the argmax where the walk reads it, -1 where it never
does (computed but unread rows stay -1). accept() then walks the same path (same tree, same choices),
so nothing else changes.
"""

from __future__ import annotations

from collections import abc
from collections.abc import Callable

import torch

from ddtree.contract.token_tree import TokenTree

NOT_READ = -1


def primary_chain(first_child: abc.Sequence[int], node: int) -> list[int]:
    """node, its first child, that child's first child, ... to a leaf. first_child[i] = -1 at a leaf."""
    chain = [node]
    while first_child[chain[-1]] >= 0:
        chain.append(first_child[chain[-1]])
    return chain


def first_children(tree: TokenTree) -> list[int]:
    """first_child[i] = the lowest-index child of node i (the drafter's best continuation), -1 at a leaf."""
    first = [-1] * (tree.n + 1)
    for i in range(tree.n, 0, -1):  # descending, so the lowest index is written last
        first[tree.parents[i - 1]] = i
    return first


def greedy_walk_choices(
    trees: abc.Sequence[TokenTree], hidden: abc.Sequence[torch.Tensor], lm_head: Callable[[torch.Tensor], torch.Tensor]
) -> list[torch.Tensor]:
    """trees[s] with hidden[s] [n_s + 1, d] (row 0 = root, row i = node i; final-normed) -> per sequence
    int64 [n_s + 1]: the argmax of lm_head(hidden row) at the nodes the accept walk reads, -1 elsewhere.

    lm_head: [k, d] -> [k, V] logits, applied once per round to the walking sequences' primary chains.
    """
    if len(trees) != len(hidden):
        raise ValueError(f"{len(trees)} trees but {len(hidden)} hidden-state blocks")
    for s, (tree, h) in enumerate(zip(trees, hidden)):
        if h.dim() != 2 or h.shape[0] != tree.n + 1:
            raise ValueError(f"hidden[{s}] has shape {tuple(h.shape)}, expected [{tree.n + 1}, d]")
    choices = [torch.full((tree.n + 1,), NOT_READ, dtype=torch.int64) for tree in trees]
    children = [tree.child_maps() for tree in trees]
    firsts = [first_children(tree) for tree in trees]
    walking = {s: 0 for s in range(len(trees))}  # sequence -> the node where its next round starts
    while walking:
        chains = {s: primary_chain(firsts[s], node) for s, node in walking.items()}
        rows = torch.cat([hidden[s][chain] for s, chain in chains.items()])  # [k, d]
        picked = iter(lm_head(rows).argmax(dim=-1).tolist())  # [k], in chain order
        for s, chain in chains.items():
            argmax = dict(zip(chain, picked))  # this chain's computed rows
            node = walking.pop(s)
            while True:
                token = argmax[node]
                choices[s][node] = token
                child = children[s][node].get(token)
                if child is None:
                    break  # the walk stops here: token is the bonus
                if child not in argmax:
                    walking[s] = child  # left the chain: the next round starts at child
                    break
                node = child
    return choices

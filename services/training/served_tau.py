"""What a served generation would accept over a training sequence: the validation metric that predicts serving.

A training block's chain tau (drafter_loss.py) is averaged over random anchors, every position alike. A served
greedy generation does not visit every position: its first step drafts at the prompt's end, and each step's
next anchor is the position after the one it stopped at (anchor a, k drafts accepted -> next anchor a + k + 1).
So it visits the positions where the previous draft failed far more often than an average over positions does,
and where a drafter is right either everywhere in a block or nowhere (loops, boilerplate), the two disagree by
a factor of two or more (docs/demo_model.md). This module walks a generated sequence as serving would:

    accepted[j] = drafts the block at anchor lo + j gets right, along the target's greedy continuation
                  (a chain: the leading run of correct argmaxes; a tree of `budget` nodes: the best-first
                  tree's longest root path that follows the continuation, as the verifier's accept walk)
    visited     = lo, lo + accepted[0] + 1, ...   (walk); tau = mean of accepted + 1 over visited anchors

Every anchor's block is the training forward's (drafter_forward.block_hidden), which equals what the drafter
service computes for that context and root (tests/training/test_train_drafter.py), so on the target's own
greedy text this is the served tau of a chain or a tree at that budget, up to how the served run ends
(max tokens) and the verifier's cost cut of the tree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import Tensor

from ddtree.models.dflash.model import DFlashDraftModel
from ddtree.training.drafter_data import TargetBatch
from ddtree.training.drafter_forward import block_hidden, block_inputs, block_labels
from ddtree.tree.best_first import build_tree

ANCHORS_PER_FORWARD = 32  # blocks per block_hidden call: its mask is [m*B, T + m*B] per sequence


def walk(accepted_at: Callable[[int], int], count: int) -> list[int]:
    """The accept lengths (accepted + 1) of the steps a greedy generation takes over anchors 0..count-1 from
    anchor 0: a step at anchor j accepts accepted_at(j) drafts and the next one is at j + accepted_at(j) + 1.
    accepted_at is called once per visited anchor only."""
    steps, j = [], 0
    while j < count:
        k = accepted_at(j)
        steps.append(k + 1)
        j += k + 1
    return steps


def accepted_along(tree_children: list[dict[int, int]], labels: Sequence[int]) -> int:
    """Nodes of the tree's longest root path whose tokens are labels[0], labels[1], ... (the accept walk
    of verifier/sampling/accept.py when the target's choices are the labels)."""
    node, n = 0, 0
    for token in labels:
        node = tree_children[node].get(token, -1)
        if node < 0:
            break
        n += 1
    return n


def tree_accepted(logprobs: Tensor, token_ids: Tensor, labels: Tensor, budget: int) -> int:
    """Drafts the best-first tree of `budget` nodes over one block's top-k table (fp32 / int64 [B-1, k], k >=
    budget or the whole table) gets right along labels int64 [B-1]."""
    tree = build_tree(logprobs[:, :budget], token_ids[:, :budget], budget)
    return accepted_along(tree.child_maps(), labels.tolist())


def _tree_accepted_at(logprobs: Tensor, token_ids: Tensor, labels: Tensor, budget: int, j: int) -> int:
    return tree_accepted(logprobs[j], token_ids[j], labels[j], budget)


@torch.no_grad()
def block_logprobs(
    model: DFlashDraftModel,
    batch: TargetBatch,
    row: int,
    embed_w: Tensor,
    head_w: Tensor,
    window: int,
    top_k: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Sequence `row` of the batch, every anchor a in [anchor_lo, T - B]: (top-k log-probs fp32 [A, B-1, k],
    their ids int64 [A, B-1, k], labels int64 [A, B-1]) of the block at a, depth order."""
    cfg = model.config
    b = cfg.block_size
    t = batch.ids.shape[1]
    anchors = torch.arange(batch.anchor_lo, t - b + 1)[None]  # [1, A]
    ids, taps = batch.ids[row : row + 1], batch.taps[row : row + 1]
    scale = cfg.input_embedding_scale
    lps, tops = [], []
    for lo in range(0, anchors.shape[1], ANCHORS_PER_FORWARD):
        part = anchors[:, lo : lo + ANCHORS_PER_FORWARD]
        embeds = embed_w[block_inputs(ids, part, b, cfg.mask_token_id).to(embed_w.device)]
        hidden = block_hidden(model, taps, embeds * scale if scale != 1.0 else embeds, part.to(model.device), window)
        rows = hidden[0][:, cfg.prediction_slots]  # [m, B-1, H]
        logits = model.compute_logits(rows.reshape(-1, rows.shape[-1]), head_w)
        lp, top = torch.topk(torch.log_softmax(logits, dim=-1), top_k, dim=-1)
        lps.append(lp.view(*rows.shape[:2], top_k).cpu())
        tops.append(top.view(*rows.shape[:2], top_k).cpu())
    labels = block_labels(batch.greedy[row : row + 1], anchors, b)[0]
    return torch.cat(lps), torch.cat(tops), labels


def walk_steps(logprobs: Tensor, token_ids: Tensor, labels: Tensor, budgets: Sequence[int]) -> dict[str, list[int]]:
    """One sequence's walked steps from its blocks' top-k tables (block_logprobs, k >= max(budgets)):
    {"walk_chain_tau": accept lengths of the chain's walk, "walk_tau_b{N}": of the tree walk at budget N}."""
    count = labels.shape[0]
    chain = (token_ids[:, :, 0] == labels).long().cumprod(dim=1).sum(dim=1).tolist()  # [A]
    steps = {"walk_chain_tau": walk(chain.__getitem__, count)}
    for n in budgets:
        steps[f"walk_tau_b{n}"] = walk(partial(_tree_accepted_at, logprobs, token_ids, labels, n), count)
    return steps


def served_tau(
    model: DFlashDraftModel,
    batches: Sequence[TargetBatch],
    embed_w: Tensor,
    head_w: Tensor,
    window: int,
    budgets: Sequence[int] = (16,),
) -> dict[str, float]:
    """{"walk_chain_tau": ..., "walk_tau_b{N}": ... per budget}: tau pooled over the visited anchors of every
    sequence (as a served run pools its steps). Trees are built only where the walk goes."""
    top_k = max([1, *budgets])
    pooled: dict[str, list[int]] = {"walk_chain_tau": [], **{f"walk_tau_b{n}": [] for n in budgets}}
    for batch in batches:
        for row in range(batch.ids.shape[0]):
            lp, top, labels = block_logprobs(model, batch, row, embed_w, head_w, window, top_k)
            for key, steps in walk_steps(lp, top, labels, budgets).items():
                pooled[key] += steps
    return pooled_tau(pooled)


def pooled_tau(pooled: dict[str, list[int]]) -> dict[str, float]:
    """Mean accept length of each key's pooled steps (0.0 for none)."""
    return {k: sum(v) / len(v) if v else 0.0 for k, v in pooled.items()}

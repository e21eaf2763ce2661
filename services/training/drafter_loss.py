"""The DFlash block loss: cross-entropy at block slots 1..B-1, weighted down with depth.

Slot k (depth k) of a block can only be accepted if slots 1..k-1 were, so an error at depth 1 costs
every deeper token while an error at depth B-1 costs one. DFlash therefore weights the per-slot
cross-entropy with an exponential decay over block positions,

    w_k = exp(-(k - 1) / gamma),   k = 1..B-1,   loss = sum_k w_k CE_k / sum_k w_k  (mean over blocks),

with gamma growing with the block size (DFlash uses 7 for B = 16, 5 for B = 10 and 4 for B = 8; see
`default_gamma`). gamma <= 0 means uniform weights.

Distillation (JetSpec, `--loss kl`): instead of the target's argmax, each depth matches the target's own
distribution at that position by forward KL at temperature tau (Hinton's tau^2 scaling),

    KL_k = tau^2 sum_v p_tau(v) (log p_tau(v) - log q_tau(v)),   p_tau = softmax(target logits / tau),

over the target's top-K logits (p renormalised over them; K = the vocabulary makes it exact), q the
drafter's full softmax at that slot. Weighted like the CE (uniform unless --gamma is given).

The logits use the TARGET's lm_head (the drafter has none). For large vocabularies the rows are
processed in chunks under activation checkpointing, so the [rows, V] logits are never all alive.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ddtree.models.dflash.model import DFlashDraftModel


def default_gamma(block_size: int) -> float:
    """DFlash's decay constant for a block size: 7 (B >= 16), 5 (B >= 10), else 4."""
    return 7.0 if block_size >= 16 else 5.0 if block_size >= 10 else 4.0


def depth_weights(block_size: int, gamma: float) -> Tensor:
    """fp32 [B-1]: w_k = exp(-(k-1)/gamma) for k = 1..B-1 (all ones when gamma <= 0)."""
    k = torch.arange(block_size - 1, dtype=torch.float32)
    return torch.ones_like(k) if gamma <= 0 else torch.exp(-k / gamma)


@dataclass(frozen=True)
class BlockLoss:
    loss: Tensor  # scalar, differentiable: weighted CE averaged over blocks
    ce_per_depth: Tensor  # fp32 [B-1] mean CE at each depth (detached)
    acc_per_depth: Tensor  # fp32 [B-1] top-1 accuracy at each depth
    chain_tau: float  # 1 + mean number of leading correct slots: tau of a greedy chain draft
    blocks: int

    def metrics(self) -> dict:
        return {
            "loss": float(self.loss.detach()),
            "acc1": float(self.acc_per_depth[0]),
            "chain_tau": self.chain_tau,
            "acc": [round(float(a), 4) for a in self.acc_per_depth],
            "ce": [round(float(c), 4) for c in self.ce_per_depth],
        }


def _chunk_ce(model: DFlashDraftModel, hidden: Tensor, lm_head_weight: Tensor, labels: Tensor):
    logits = model.compute_logits(hidden, lm_head_weight)  # [n, V] fp32
    return F.cross_entropy(logits, labels, reduction="none"), logits.argmax(-1)


def block_loss(
    model: DFlashDraftModel,
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    weights: Tensor,
    chunk_rows: int = 8192,
) -> BlockLoss:
    """hidden [S, m, B, H] (block_hidden), labels int64 [S, m, B-1], weights fp32 [B-1]."""
    s, m, b, h = hidden.shape
    rows = hidden[:, :, model.config.prediction_slots].reshape(-1, h)  # depth order (draft_shift: which slots)
    lab = labels.reshape(-1).to(rows.device)
    ces, preds = [], []
    for i in range(0, rows.shape[0], chunk_rows):
        args = (model, rows[i : i + chunk_rows], lm_head_weight, lab[i : i + chunk_rows])
        if rows.shape[0] > chunk_rows and torch.is_grad_enabled():
            ce, pred = checkpoint(_chunk_ce, *args, use_reentrant=False)
        else:
            ce, pred = _chunk_ce(*args)
        ces.append(ce)
        preds.append(pred)
    ce = torch.cat(ces).view(s * m, b - 1)
    w = weights.to(ce.device)
    loss = (ce * w).sum() / (w.sum() * s * m)
    with torch.no_grad():
        correct = (torch.cat(preds).view(s * m, b - 1) == lab.view(s * m, b - 1)).float()
        chain = correct.cumprod(dim=1).sum(dim=1)  # leading correct slots per block
        return BlockLoss(
            loss=loss,
            ce_per_depth=ce.detach().mean(0).cpu(),
            acc_per_depth=correct.mean(0).cpu(),
            chain_tau=1.0 + float(chain.mean()),
            blocks=s * m,
        )


def _chunk_kl(
    model: DFlashDraftModel, hidden: Tensor, lm_head_weight: Tensor, t_logits: Tensor, t_ids: Tensor, tau: float
):
    logq = torch.log_softmax(model.compute_logits(hidden, lm_head_weight) / tau, dim=-1)  # [n, V] fp32
    logp = torch.log_softmax(t_logits.float() / tau, dim=-1)  # [n, K] over the teacher's top-K
    kl = (logp.exp() * (logp - logq.gather(1, t_ids))).sum(-1) * tau**2  # [n]
    return kl, logq.argmax(-1)


def block_kl_loss(
    model: DFlashDraftModel,
    hidden: Tensor,
    lm_head_weight: Tensor,
    teacher: Tensor,
    teacher_ids: Tensor,
    labels: Tensor,
    weights: Tensor,
    temperature: float = 1.0,
    chunk_rows: int = 8192,
) -> BlockLoss:
    """Forward KL to the target's distributions: hidden [S, m, B, H] (block_hidden), teacher fp32 [S, m, B-1, K]
    and teacher_ids int64 [S, m, B-1, K] (drafter_forward.block_teacher), labels int64 [S, m, B-1] (for the
    accuracies), weights fp32 [B-1]. ce_per_depth holds the KL per depth."""
    s, m, b, h = hidden.shape
    rows = hidden[:, :, model.config.prediction_slots].reshape(-1, h)
    k = teacher.shape[-1]
    t_logits = teacher.reshape(-1, k).to(rows.device)
    t_ids = teacher_ids.reshape(-1, k).to(rows.device)
    kls, preds = [], []
    for i in range(0, rows.shape[0], chunk_rows):
        args = (
            model,
            rows[i : i + chunk_rows],
            lm_head_weight,
            t_logits[i : i + chunk_rows],
            t_ids[i : i + chunk_rows],
        )
        if rows.shape[0] > chunk_rows and torch.is_grad_enabled():
            kl, pred = checkpoint(_chunk_kl, *args, temperature, use_reentrant=False)
        else:
            kl, pred = _chunk_kl(*args, temperature)
        kls.append(kl)
        preds.append(pred)
    kl = torch.cat(kls).view(s * m, b - 1)
    w = weights.to(kl.device)
    loss = (kl * w).sum() / (w.sum() * s * m)
    lab = labels.reshape(s * m, b - 1).to(kl.device)
    with torch.no_grad():
        correct = (torch.cat(preds).view(s * m, b - 1) == lab).float()
        return BlockLoss(
            loss=loss,
            ce_per_depth=kl.detach().mean(0).cpu(),
            acc_per_depth=correct.mean(0).cpu(),
            chain_tau=1.0 + float(correct.cumprod(dim=1).sum(dim=1).mean()),
            blocks=s * m,
        )

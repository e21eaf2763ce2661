"""The DFlash drafter under tensor parallelism: drafter rank r of N, beside verifier rank r
(docs/deployment_placement.md).

Rank r holds, of the whole drafter (models/dflash/model.py), the split named by memory_plan.DRAFTER_SPLIT_DIMS,
so that the memory plan counts what is held:
  q_proj / k_proj / v_proj   rows of heads [r·nh/N, (r+1)·nh/N) and KV heads [r·kvh/N, ...): column-parallel;
                             head h reads KV head h // (nh/kvh) in both, so the grouping is kept per rank
  o_proj                     the matching input columns: row-parallel, summed over ranks
  gate_proj / up_proj        rows [r·I/N, (r+1)·I/N); down_proj the matching columns: summed over ranks
  fc                         input columns [r·F/N, (r+1)·F/N) of the features, which every rank holds whole
                             (the target's taps are all-reduced, so replicated): summed over ranks
  norms                      whole (q_norm / k_norm act per head, the layer norms on the full hidden)
The local model is a DFlashDraftModel of the rank's widths whose row-parallel linears all-reduce their
output; its context K/V are the rank's KV heads, its hidden states (after each all-reduce) the whole
model's on every rank. A row-parallel bias is added by rank 0 only.

The target's embedding and LM head are split by vocabulary rows (parallel/layers.py's rule): a draft's
logits stay sharded and its top-k is merged from every rank's (shard_topk, merge_topk).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from ddtree.models.checkpoint.memory_plan import split_dim
from ddtree.models.dflash.model import DFlashDraftModel
from ddtree.models.parallel.process_group import TPGroup
from ddtree.models.parallel.shard_plan import shard_range


class RowParallelLinear(nn.Module):
    """linear(x[..., cols]) summed over ranks: `linear` holds this rank's input columns; `cols` (a slice)
    picks them from an input every rank holds whole (None: the input is already this rank's share)."""

    def __init__(self, linear: nn.Linear, tp: TPGroup, cols: slice | None = None):
        super().__init__()
        self.linear, self.tp, self.cols = linear, tp, cols

    @property
    def weight(self) -> Tensor:  # DFlashDraftModel.dtype / .device read fc.weight
        return self.linear.weight

    def forward(self, x: Tensor) -> Tensor:
        if self.cols is not None:
            x = x[..., self.cols]
        return self.tp.all_reduce(self.linear(x))


def local_config(cfg, world_size: int):
    """The DFlashConfig of one rank's widths; ValueError where a width does not split evenly."""
    for what, n in (("num_attention_heads", cfg.num_attention_heads), ("num_key_value_heads",
                    cfg.num_key_value_heads), ("intermediate_size", cfg.intermediate_size),
                    ("feature_size", cfg.feature_size)):  # fmt: skip
        if n % world_size:
            raise ValueError(f"drafter --tp {world_size}: {what} {n} is not divisible by it")
    return dataclasses.replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // world_size,
        num_key_value_heads=cfg.num_key_value_heads // world_size,
        intermediate_size=cfg.intermediate_size // world_size,
    )


def shard_state_dict(state: dict[str, Tensor], rank: int, world_size: int) -> dict[str, Tensor]:
    """Rank `rank`'s slices of a whole drafter's state dict (memory_plan.split_dim); row-parallel biases
    (o_proj, down_proj) zeroed off rank 0."""
    out = {}
    for name, t in state.items():
        dim = split_dim(name)
        if dim is not None:
            lo, hi = shard_range(t.shape[dim], rank, world_size, name)
            t = t.narrow(dim, lo, hi - lo)
        elif name.endswith(("o_proj.bias", "down_proj.bias")) and rank:
            t = torch.zeros_like(t)
        out[name] = t.clone()
    return out


def shard_dflash(model: DFlashDraftModel, tp: TPGroup) -> DFlashDraftModel:
    """This rank's drafter from a whole one (same device and dtype): local widths, row-parallel linears
    that all-reduce. Its forward_blocks returns the whole model's hidden states on every rank."""
    cfg, n = model.config, tp.world_size
    local_cfg = local_config(cfg, n)
    state = shard_state_dict(model.state_dict(), tp.rank, n)
    with torch.device("meta"):
        local = DFlashDraftModel(local_cfg)
        local.fc = nn.Linear(cfg.feature_size // n, cfg.hidden_size, bias=False)
    local.load_state_dict(state, assign=True)
    local._inv_freq, local._rope_scale = model._inv_freq, model._rope_scale
    lo, hi = shard_range(cfg.feature_size, tp.rank, n, "feature_size")
    local.fc = RowParallelLinear(local.fc, tp, slice(lo, hi))
    for layer in local.layers:
        layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj, tp)
        layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj, tp)
    # context_kv checks features against the whole width: the local config keeps feature_size whole
    return local.eval()


def shard_topk(local_logits: Tensor, k: int, vocab_start: int) -> tuple[Tensor, Tensor]:
    """fp32 [R, V/N] -> (values [R, k], global ids int64 [R, k]) of this rank's vocabulary shard."""
    values, idx = local_logits.float().topk(min(k, local_logits.shape[-1]), dim=-1)
    return values, idx + vocab_start


def merge_topk(values: Tensor, ids: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Every rank's shard_topk gathered ([N, R, k'] each, rank order) -> the top-k of the whole vocabulary
    (values [R, k] descending, ids [R, k]): each shard's top-k holds every one of its entries in the whole
    top-k."""
    n, r, kk = values.shape
    flat_v = values.permute(1, 0, 2).reshape(r, n * kk)
    flat_i = ids.permute(1, 0, 2).reshape(r, n * kk)
    top, pos = flat_v.topk(min(k, n * kk), dim=-1)
    return top, flat_i.gather(-1, pos)

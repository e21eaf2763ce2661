"""Tensor-parallel pieces over plain nn.Linear / nn.Embedding with local shapes (docs/design.md §7.5).

Column-parallel and row-parallel linears need no class of their own: a column-parallel layer is an
nn.Linear with out_features/N rows, a row-parallel one an nn.Linear with in_features/N columns whose
output is a partial sum; the decoder layer all-reduces once after attention and once after the MLP
(routed + shared experts summed first). A row-parallel bias is kept on rank 0 only (zeroed elsewhere),
so it is added once.

The vocabulary is split by rows for the embedding and the LM head. Logits stay sharded: the greedy
choice is combined from each rank's (max, global argmax) without ever gathering [R, V].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.models.parallel.process_group import TPGroup


class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_start + num_embeddings) of the embedding; ids outside give 0, then all-reduce."""

    def __init__(self, num_embeddings: int, embedding_dim: int, vocab_start: int, tp: TPGroup):
        super().__init__(num_embeddings, embedding_dim)
        self.vocab_start = vocab_start
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # int64 [T] -> [T, d]
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings)  # [T]
        x = F.embedding(local.masked_fill(~mine, 0), self.weight)
        # Exactly one rank holds each id and the others add exact zeros: the sum equals the full lookup.
        return self.tp.all_reduce(x.masked_fill(~mine[:, None], 0))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, vocab_start={self.vocab_start}"


def shard_argmax(local_logits: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """fp32 [R, V/N] -> float64 [R, 2]: (max value, global id of the first max) per row.

    float64 holds every fp32 value and every id below 2^53 exactly, so one tensor carries both.
    """
    logits = local_logits.float()
    idx = logits.argmax(dim=-1)  # [R], the first max on ties
    value = logits.gather(-1, idx[:, None]).squeeze(-1)
    return torch.stack([value.double(), (idx + vocab_start).double()], dim=-1)


def combine_shard_argmax(gathered: torch.Tensor) -> torch.Tensor:
    """[N, R, 2] from every rank (rank order) -> int64 [R], equal to torch.argmax of the full logits.

    Ranks hold ascending vocab ranges, so the first rank with the largest value holds the lowest global
    id among the ties: argmax over ranks (first max) then that rank's local first max.
    """
    best_rank = gathered[..., 0].argmax(dim=0)  # [R]
    return gathered[..., 1].gather(0, best_rank[None]).squeeze(0).long()

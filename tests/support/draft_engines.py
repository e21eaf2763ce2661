"""A random DFlash draft engine (2 layers, block 5, over a 32-wide 6-layer target) and its draft inputs."""

from __future__ import annotations

import torch

from ddtree.drafter.engine import DraftEngine, SeqDraftInput
from ddtree.models.dflash.checkpoint import load_drafter, write_random_drafter

TARGET = {"hidden_size": 32, "num_hidden_layers": 6, "vocab_size": 64, "rope_theta": 10000.0}
BLOCK = 5


def random_draft_engine(tmp_path) -> DraftEngine:
    ckpt = write_random_drafter(
        tmp_path, TARGET, seed=3, block_size=BLOCK, num_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    g = torch.Generator().manual_seed(0)
    return DraftEngine(
        load_drafter(ckpt), torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g) / 4, max_budget=64
    )


def draft_input(seq_id: str, budget: int, chain: bool) -> SeqDraftInput:
    feats = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    return SeqDraftInput(
        seq_id=seq_id,
        commit_token_ids=(1, 2, 3, 4),
        commit_start=0,
        commit_features=feats,
        root_token_id=5,
        budget=budget,
        reset=True,
        chain=chain,
    )

"""The chain option (SpecOptions.chain -> SeqDraft.chain): a width-1 tree of the drafter's top-1 token
per depth, as deep as the budget and the block allow."""

from __future__ import annotations

import torch

from ddtree.drafter.engine import DraftEngine, SeqDraftInput
from ddtree.models.dflash_checkpoint import load_drafter, write_random_drafter
from ddtree.tools.selftest.oracle_trees import noisy_tree

TARGET = {"hidden_size": 32, "num_hidden_layers": 6, "vocab_size": 64, "rope_theta": 10000.0}
BLOCK = 5


def _engine(tmp_path) -> DraftEngine:
    ckpt = write_random_drafter(
        tmp_path, TARGET, seed=3, block_size=BLOCK, num_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    g = torch.Generator().manual_seed(0)
    return DraftEngine(
        load_drafter(ckpt), torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g) / 4, max_budget=64
    )


def _seq(seq_id: str, budget: int, chain: bool) -> SeqDraftInput:
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


def test_chain_is_the_top1_path(tmp_path):
    eng = _engine(tmp_path)
    chain, tree, short = eng.draft([_seq("c", 32, True), _seq("t", 32, False), _seq("s", 2, True)])
    depth = BLOCK - 1
    assert chain.n == depth and chain.parents == tuple(range(depth)) and chain.depths == tuple(range(1, depth + 1))
    assert tree.n == 32 and tree.max_depth <= depth
    # Top-1 per depth of the drafter's block, computed by hand.
    model, feats = eng.model, _seq("x", 1, True).commit_features
    block = torch.tensor([5] + [model.config.mask_token_id] * depth)
    with torch.inference_mode():
        hidden = model.forward_block(
            eng.embed_weight[block], torch.arange(4, 4 + BLOCK), model.context_kv(feats, torch.arange(4))
        )
    assert chain.token_ids == tuple((hidden[1:] @ eng.lm_head_weight.T).argmax(-1).tolist())
    assert short.n == 2 and short.token_ids == chain.token_ids[:2]


def test_oracle_chain_is_its_noisy_tree_without_siblings():
    import random

    truth = [3, 4, 5, 6, 7, 8, 9]
    t = noisy_tree(truth, 7, 100, random.Random(0))
    assert t.n == 7 and t.parents == tuple(range(7))

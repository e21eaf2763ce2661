"""The chain option (SpecOptions.chain -> SeqDraft.chain): a width-1 tree of the drafter's top-1 token
per depth, as deep as the budget and the block allow."""

from __future__ import annotations

import torch

from ddtree.tools.selftest.oracle.trees import noisy_tree
from tests.support.draft_engines import BLOCK, draft_input, random_draft_engine


def test_chain_is_the_top1_path(tmp_path):
    eng = random_draft_engine(tmp_path)
    chain, tree, short = eng.draft([draft_input("c", 32, True), draft_input("t", 32, False), draft_input("s", 2, True)])
    depth = BLOCK - 1
    assert chain.n == depth and chain.parents == tuple(range(depth)) and chain.depths == tuple(range(1, depth + 1))
    assert tree.n == 32 and tree.max_depth <= depth
    # Top-1 per depth of the drafter's block, computed by hand.
    model, feats = eng.model, draft_input("x", 1, True).commit_features
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

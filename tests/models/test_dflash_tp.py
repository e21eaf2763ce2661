"""The DFlash drafter at TP 2 on CPU (2 ranks over gloo, torch.multiprocessing spawn): each rank's sharded
drafter (models/parallel/dflash_tp.py) gives the whole drafter's hidden states for draft blocks over cached
contexts, its context K/V are the whole drafter's for its KV heads, and the top-k merged from vocabulary
shards is the whole vocabulary's top-k; the shards hold what the memory plan counts per rank."""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.multiprocessing as tmp

from ddtree.models.checkpoint.memory_plan import drafter_shape
from ddtree.models.dflash.checkpoint import load_drafter, write_random_drafter
from ddtree.models.parallel.dflash_tp import local_config, merge_topk, shard_dflash, shard_topk
from ddtree.models.parallel.process_group import destroy_tp, init_tp
from ddtree.tools.selftest.compare import assert_close

WORLD = 2
TARGET = {"hidden_size": 32, "num_hidden_layers": 6, "vocab_size": 64, "rope_theta": 10000.0}


def inputs(cfg) -> tuple[torch.Tensor, ...]:
    """Two sequences' features (7 and 4 committed tokens) and their blocks' embeddings and positions."""
    g = torch.Generator().manual_seed(5)
    feats = torch.randn(11, cfg.feature_size, generator=g)
    embeds = torch.randn(2, cfg.block_size, cfg.hidden_size, generator=g)
    positions = torch.stack([torch.arange(7, 7 + cfg.block_size), torch.arange(4, 4 + cfg.block_size)])
    return feats, embeds, positions


def run(model, feats, embeds, positions):
    ctx = [model.context_kv(feats[:7], torch.arange(7)), model.context_kv(feats[7:], torch.arange(4))]
    return ctx, model.forward_blocks(embeds, positions, ctx)


def rank_main(rank: int, ckpt: str, out: str) -> None:
    torch.set_num_threads(1)
    tp = init_tp(WORLD, rank, torch.device("cpu"), timeout_s=60, init_method=f"file://{out}.store")
    try:
        whole = load_drafter(ckpt)
        local = shard_dflash(whole, tp)
        with torch.no_grad():
            ctx, hidden = run(local, *inputs(whole.config))
        held = sum(t.numel() for t in local.state_dict().values())
        torch.save({"ctx": ctx, "hidden": hidden, "held": held}, f"{out}.{rank}")
    finally:
        destroy_tp()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> pathlib.Path:
    return write_random_drafter(
        tmp_path_factory.mktemp("drafter"), TARGET, seed=3, block_size=4, num_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attention={"causal_head": True},
    )  # fmt: skip


def test_tp2_drafter_equals_the_whole_drafter(ckpt, tmp_path):
    out = str(tmp_path / "rank")
    tmp.spawn(rank_main, args=(str(ckpt), out), nprocs=WORLD, join=True)
    whole = load_drafter(ckpt)
    with torch.no_grad():
        ctx, hidden = run(whole, *inputs(whole.config))
    kvh = whole.config.num_key_value_heads // WORLD
    for rank in range(WORLD):
        got = torch.load(f"{out}.{rank}")
        assert_close(f"rank {rank} hidden", got["hidden"], hidden)
        for s in range(2):
            for layer, ((k, v), (k_ref, v_ref)) in enumerate(zip(got["ctx"][s], ctx[s])):
                heads = slice(rank * kvh, (rank + 1) * kvh)
                assert_close(f"rank {rank} seq {s} layer {layer} K", k, k_ref[:, heads])
                assert_close(f"rank {rank} seq {s} layer {layer} V", v, v_ref[:, heads])
        assert got["held"] == drafter_shape(whole.config, WORLD).params  # what the plan counts per rank


def test_merged_shard_topk_is_the_whole_topk():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 96, generator=g)  # distinct values: no ties
    parts = [shard_topk(logits[:, r * 32 : (r + 1) * 32], 6, r * 32) for r in range(3)]
    values, ids = merge_topk(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]), 6)
    ref_values, ref_ids = logits.topk(6, dim=-1)
    assert torch.equal(values, ref_values) and torch.equal(ids, ref_ids)


def test_uneven_split_is_refused(ckpt):
    with pytest.raises(ValueError, match="num_key_value_heads 2 is not divisible"):
        local_config(load_drafter(ckpt).config, 4)

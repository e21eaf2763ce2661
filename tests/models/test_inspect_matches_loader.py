"""`ddtree inspect` and the loader agree: the weight bytes inspect reports per rank are the bytes the loaded
rank's parameters and buffers hold (within 2%), for bf16, FP8 and INT4 checkpoints at TP 1, TP 2 and TP 2
with expert parallelism. Each rank's shard is built and loaded in this process (build_tp_model with the
rank's ShardPlan, no process group: nothing runs a collective)."""

from __future__ import annotations

import itertools

import pytest
import torch

from ddtree.models.checkpoint.loader import load_config, load_target
from ddtree.models.parallel.shard_plan import ShardPlan
from ddtree.models.parallel.tp_model import build_tp_model
from ddtree.tools.inspect import inspect_checkpoint
from tests.support.quantized_checkpoints import TINY, write_variant

# TINY with widths that cut on whole FP8 16x32 blocks and INT4 groups of 32 at TP 2
CFG = {**TINY, "moe_intermediate_size": 64, "intermediate_size": 192}
LAYOUTS = [(1, False), (2, False), (2, True)]


@pytest.fixture(scope="module", params=["bf16", "fp8", "int4"])
def ckpt(request, tmp_path_factory):
    root, _ = write_variant(tmp_path_factory.mktemp(request.param) / "ckpt", request.param, cfg=CFG, shards=2)
    return request.param, root


def held_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))


def load_rank(root, rank: int, world: int, ep: bool) -> torch.nn.Module:
    if world == 1:
        return load_target(root)
    plan = ShardPlan(load_config(root), rank, world, ep)
    return load_target(root, build_model=lambda c: build_tp_model(plan, None), slice_of=plan.slice_of, skip=plan.skip)


@pytest.mark.parametrize(("tp", "ep"), LAYOUTS, ids=["tp1", "tp2", "tp2-ep"])
def test_inspect_bytes_per_rank_equal_the_loaded_rank(ckpt, tp, ep):
    kind, root = ckpt
    report = inspect_checkpoint(root, tp=tp, ep=ep)
    for rank in range(tp):
        model = load_rank(root, rank, tp, ep)
        held = held_bytes(model)
        assert abs(held - report.weight_bytes_per_rank) <= 0.02 * held, (kind, tp, ep, rank, held, report)
        if kind != "bf16":  # the quantized weights stay packed: far fewer bytes than the same model in fp32
            packed = {t.dtype for t in model.buffers()} & {torch.int32, torch.float8_e4m3fn}
            assert packed, kind
    if tp == 1:
        assert report.weight_bytes_per_rank == report.weight_bytes

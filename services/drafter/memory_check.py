"""The drafter's memory plan on its GPU (models/checkpoint/memory_plan.py), from its config.json and its DrafterConfig
alone: factory.make_engine checks it before reading any weight, `ddtree inspect --drafter` adds it to GPU 0.

Draft contexts are planned for `sequences` live sequences (the verifier's --max-batch; at start-up the
graphs' MAX_GRAPH_SEQUENCES), each holding 2 x window rows per layer (drafter/context.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ddtree.drafter.static_draft import MAX_GRAPH_SEQUENCES
from ddtree.models.checkpoint.memory_plan import (
    MemoryPlan,
    PlanItem,
    check_plan,
    drafter_items,
    drafter_shape,
    gpu_plan,
)
from ddtree.models.dflash.config import DFlashConfig
from ddtree.telemetry.logging import get_logger

log = get_logger("ddtree.drafter.memory_check")


def read_drafter_config(path: str | Path) -> DFlashConfig:
    """A drafter checkpoint directory or its config.json."""
    p = Path(path)
    return DFlashConfig.from_dict(json.loads((p / "config.json" if p.is_dir() else p).read_text()))


def drafter_plan_items(
    cfg, drafter_config: DFlashConfig, dtype_bytes: int, sequences: int, rank: int = 0
) -> tuple[PlanItem, ...]:
    """cfg: a DrafterConfig (window, --cuda-graphs, device, --tp: drafter rank `rank`'s share)."""
    window = cfg.resolved_window()
    # draft graphs are captured at TP 1 only (drafter/tp_drafter.py runs its block forwards eagerly)
    graphs = torch.device(cfg.device).type == "cuda" and cfg.cuda_graphs != "off" and window > 0 and cfg.tp == 1
    graph_sequences = MAX_GRAPH_SEQUENCES if graphs else sequences
    # an unlimited window (0) plans one of the verifier's contexts at the drafter's largest position
    rows = window or drafter_config.max_position_embeddings
    shape = drafter_shape(drafter_config, cfg.tp)
    return drafter_items(shape, dtype_bytes, rows, sequences, graph_sequences, graphs, rank=rank)


def refuse_unless_fits(cfg, model_dir: str, dtype: torch.dtype) -> MemoryPlan | None:
    """On CUDA: the plan against the memory free now on the drafter's GPU; MemoryPlanError, the plan in its
    message, when it does not fit. None elsewhere (CPU)."""
    device = torch.device(cfg.device)
    if device.type != "cuda":
        return None
    items = drafter_plan_items(cfg, read_drafter_config(model_dir), torch.empty(0, dtype=dtype).element_size(),
                               MAX_GRAPH_SEQUENCES)  # fmt: skip
    index = device.index or 0
    plan = MemoryPlan((gpu_plan(index, torch.cuda.mem_get_info(device)[0], items),), 0, 0, 1, "free at start")
    check_plan(plan, "drafter")
    log.info("memory_plan", gpu=index, headroom_bytes=plan.tightest.headroom)
    return plan

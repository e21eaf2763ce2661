"""Builds the DFlash drafter engine a DrafterConfig asks for."""

from __future__ import annotations

import torch

from ddtree.config import DrafterConfig
from ddtree.drafter.engine import DraftEngine
from ddtree.drafter.memory_check import refuse_unless_fits
from ddtree.drafter.static_draft import StaticDraft, plan_static_draft
from ddtree.drafter.tp_drafter import start_tensor_parallel_drafter
from ddtree.models.checkpoint.loader import load_tensors
from ddtree.models.dflash.checkpoint import load_drafter
from ddtree.models.dtypes import TORCH_DTYPES


def drafter_dtype(cfg: DrafterConfig) -> torch.dtype:
    """cfg.dtype, with "auto" resolved: the DFlash drafter computes in bfloat16 where matmuls have it natively
    (CUDA; CPUs with AVX512-BF16 or AMX, as oneDNN reports), else float32. The drafter's
    precision can only change which tokens it proposes, never the output: the verifier decides every token."""
    if cfg.dtype != "auto":
        return TORCH_DTYPES[cfg.dtype]
    if torch.device(cfg.device).type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


def make_engine(cfg: DrafterConfig, model_dir: str, target_dir: str):
    dtype = drafter_dtype(cfg)
    refuse_unless_fits(cfg, model_dir, dtype)  # on CUDA: the memory plan, before any weight is read
    if cfg.tp > 1:  # N ranks, rank 0's handle (drafter/tp_drafter.py); eager forwards
        return start_tensor_parallel_drafter(cfg, model_dir, target_dir, dtype)
    model = load_drafter(model_dir).to(device=cfg.device, dtype=dtype).eval()
    head = load_tensors(target_dir, ["model.embed_tokens.weight", "lm_head.weight"])
    engine = DraftEngine(
        model,
        head["model.embed_tokens.weight"].to(cfg.device, dtype),
        head["lm_head.weight"].to(cfg.device, dtype),
        window=cfg.resolved_window(),
        default_budget=cfg.default_budget,
        max_budget=cfg.max_budget,
    )
    engine.static = make_static_draft(cfg, engine)
    return engine


def make_static_draft(cfg: DrafterConfig, engine):
    """The engine's static block step as `--cuda-graphs` asks (None: eager), its graphs captured now on
    CUDA."""
    buckets = plan_static_draft(cfg.cuda_graphs, cfg.device, cfg.resolved_window())
    if buckets is None:
        return None
    graphs = torch.device(cfg.device).type == "cuda"
    static = StaticDraft(engine.model, buckets, engine.config.block_size, engine.context_dtype, graphs)
    static.capture()
    return static

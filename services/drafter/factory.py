"""Builds the drafter engine a DrafterConfig asks for: the DFlash model or the oracle."""
from __future__ import annotations

import torch

from services.config import DrafterConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_engine(cfg: DrafterConfig, model_dir: str, target_dir: str):
    dtype = _DTYPES[cfg.dtype]
    if cfg.engine == "oracle":
        from services.drafter.oracle import OracleDraftEngine
        from services.models.loader import load_target
        target = load_target(target_dir, dtype=dtype, device=cfg.device).eval()
        return OracleDraftEngine(target, default_budget=cfg.default_budget, max_budget=cfg.max_budget,
                                 seed=cfg.oracle_seed)
    from services.drafter.engine import DraftEngine
    from services.models.dflash import load_drafter
    from services.models.loader import load_tensors
    model = load_drafter(model_dir).to(device=cfg.device, dtype=dtype).eval()
    head = load_tensors(target_dir, ["model.embed_tokens.weight", "lm_head.weight"])
    return DraftEngine(model, head["model.embed_tokens.weight"].to(cfg.device, dtype),
                       head["lm_head.weight"].to(cfg.device, dtype), window=cfg.window,
                       default_budget=cfg.default_budget, max_budget=cfg.max_budget)

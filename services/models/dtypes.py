"""Dtype names, as configs and command lines spell them (`ddtree.config.DTYPE_NAMES`), -> torch dtypes."""

from __future__ import annotations

import torch

from ddtree.config import DTYPE_NAMES

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}

"""The device and dtype an engine computes in, as configs and command lines name them (this package does
not import torch: `ddtree.models.dtypes.TORCH_DTYPES` maps the names to torch dtypes)."""

from __future__ import annotations

import typing
from typing import Literal

Dtype = Literal["float32", "bfloat16", "float16"]
DTYPE_NAMES: tuple[str, ...] = typing.get_args(Dtype)
# auto: the engine picks (the drafter: bfloat16 where matmuls have it natively, else float32).
AutoDtype = Literal["auto", Dtype]


def on_cpu(device: str) -> bool:
    """Whether a torch device name ("cpu", "cuda:1", ...) is the CPU."""
    return device.split(":")[0] == "cpu"

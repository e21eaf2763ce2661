"""Host-side checks every kernel wrapper shares (no device sync): the dtypes the kernels take, whether a
kernel runs under Triton's interpreter, that its tensors are on a device it can run on, and the 2-D operand
check of the GEMMs."""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_interpreted(kernel) -> bool:
    return isinstance(kernel, InterpretedFunction)


def check_device(device: torch.device, interpreted: bool) -> None:
    if device.type != "cuda" and not interpreted:
        raise ValueError(f"the Triton kernels need CUDA tensors, got {device} (on a CPU, set TRITON_INTERPRET=1 "
                         "before triton is imported to run them interpreted)")  # fmt: skip


def check_matrix(name: str, t, dtypes: tuple[torch.dtype, ...]) -> None:
    """ValueError unless t is a 2-D tensor of one of dtypes, contiguous in its last dim."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} dtype {t.dtype} not supported; use one of {dtypes}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, strides {t.stride()}")

"""Tensor <-> ddtree.v1.Tensor: raw little-endian bytes, shape and dtype, validated on the way in."""

from __future__ import annotations

import math
import sys

import torch

from ddtree.protocol.ddtree.v1 import common_pb2

_TO_PROTO = {
    torch.float32: common_pb2.FLOAT32,
    torch.bfloat16: common_pb2.BFLOAT16,
    torch.float16: common_pb2.FLOAT16,
    torch.int32: common_pb2.INT32,
    torch.int64: common_pb2.INT64,
}
_FROM_PROTO = {v: k for k, v in _TO_PROTO.items()}
# bf16 has no numpy/buffer type: it travels through int16 of the same width.
_BUFFER_DTYPE = {torch.bfloat16: torch.int16, torch.float16: torch.int16}
MAX_DIMS = 8
# Strides multiply every dimension but the first, zeros included as ones: they must fit int64 even when
# the tensor is empty (torch.empty([0, 2**40, 2**40]) overflows computing them).
MAX_STRIDE_PRODUCT = 2**62

assert sys.byteorder == "little", "the wire format is little-endian; big-endian hosts are not supported"


def proto_dtype(dtype: torch.dtype) -> int:
    """The wire's DType of a torch dtype (ValueError for one that cannot be sent)."""
    if dtype not in _TO_PROTO:
        raise ValueError(f"dtype {dtype} cannot be sent; supported: {sorted(str(d) for d in _TO_PROTO)}")
    return _TO_PROTO[dtype]


def tensor_to_proto(t: torch.Tensor) -> common_pb2.Tensor:
    dtype = proto_dtype(t.dtype)
    flat = t.detach().to("cpu").contiguous()
    raw = flat.view(_BUFFER_DTYPE.get(t.dtype, t.dtype)).numpy().tobytes()
    return common_pb2.Tensor(data=raw, shape=list(t.shape), dtype=dtype)


def checked_layout(shape, dtype: int, nbytes: int, what: str) -> torch.dtype:
    """The torch dtype of `nbytes` of raw data said to hold `shape` of wire `dtype`; ValueError naming
    `what` when they are inconsistent."""
    if dtype not in _FROM_PROTO:
        raise ValueError(
            f"{what}: unsupported dtype {common_pb2.DType.Name(dtype) if dtype in common_pb2.DType.values() else dtype}"
        )
    if len(shape) > MAX_DIMS:
        raise ValueError(f"{what}: {len(shape)} dimensions, at most {MAX_DIMS}")
    if any(d < 0 for d in shape):
        raise ValueError(f"{what}: negative dimension in shape {list(shape)}")
    if math.prod(max(d, 1) for d in shape) > MAX_STRIDE_PRODUCT:
        raise ValueError(f"{what}: shape {list(shape)} is too large")
    torch_dtype = _FROM_PROTO[dtype]
    need = math.prod(shape) * torch.empty((), dtype=torch_dtype).element_size()
    if nbytes != need:
        raise ValueError(
            f"{what}: shape {list(shape)} of {common_pb2.DType.Name(dtype)} needs {need} bytes, got {nbytes}"
        )
    return torch_dtype


def tensor_from_proto(msg: common_pb2.Tensor, *, what: str = "tensor") -> torch.Tensor:
    """Decode a Tensor message; raise ValueError naming `what` when it is inconsistent."""
    dtype = checked_layout(msg.shape, msg.dtype, len(msg.data), what)
    if not msg.data:
        return torch.empty(tuple(msg.shape), dtype=dtype)
    buf = torch.frombuffer(bytearray(msg.data), dtype=_BUFFER_DTYPE.get(dtype, dtype))
    return buf.view(dtype).reshape(tuple(msg.shape))


def tensor_from_bytes(raw: torch.Tensor, shape, dtype: int, *, what: str = "tensor") -> torch.Tensor:
    """raw: uint8 [n] (any device), read as `shape` of wire `dtype` (the tensor shares raw's memory);
    ValueError naming `what` when they are inconsistent."""
    torch_dtype = checked_layout(shape, dtype, raw.numel(), what)
    return raw.view(torch_dtype).reshape(tuple(shape))

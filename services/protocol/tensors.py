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


def tensor_to_proto(t: torch.Tensor) -> common_pb2.Tensor:
    if t.dtype not in _TO_PROTO:
        raise ValueError(f"dtype {t.dtype} cannot be sent; supported: {sorted(str(d) for d in _TO_PROTO)}")
    flat = t.detach().to("cpu").contiguous()
    raw = flat.view(_BUFFER_DTYPE.get(t.dtype, t.dtype)).numpy().tobytes()
    return common_pb2.Tensor(data=raw, shape=list(t.shape), dtype=_TO_PROTO[t.dtype])


def tensor_from_proto(msg: common_pb2.Tensor, *, what: str = "tensor") -> torch.Tensor:
    """Decode a Tensor message; raise ValueError naming `what` when it is inconsistent."""
    if msg.dtype not in _FROM_PROTO:
        raise ValueError(
            f"{what}: unsupported dtype {common_pb2.DType.Name(msg.dtype) if msg.dtype in common_pb2.DType.values() else msg.dtype}"
        )
    if len(msg.shape) > MAX_DIMS:
        raise ValueError(f"{what}: {len(msg.shape)} dimensions, at most {MAX_DIMS}")
    if any(d < 0 for d in msg.shape):
        raise ValueError(f"{what}: negative dimension in shape {list(msg.shape)}")
    if math.prod(max(d, 1) for d in msg.shape) > MAX_STRIDE_PRODUCT:
        raise ValueError(f"{what}: shape {list(msg.shape)} is too large")
    dtype = _FROM_PROTO[msg.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = math.prod(msg.shape)
    if len(msg.data) != count * itemsize:
        raise ValueError(
            f"{what}: shape {list(msg.shape)} of {common_pb2.DType.Name(msg.dtype)} needs "
            f"{count * itemsize} bytes, got {len(msg.data)}"
        )
    if count == 0:
        return torch.empty(tuple(msg.shape), dtype=dtype)
    buf = torch.frombuffer(bytearray(msg.data), dtype=_BUFFER_DTYPE.get(dtype, dtype))
    return buf.view(dtype).reshape(tuple(msg.shape))

"""Wire tensors, service configuration and the KV pool's accounting."""

from __future__ import annotations

import argparse

import pytest
import torch

from ddtree.config import (
    DrafterConfig,
    GatewayConfig,
    VerifierConfig,
    add_config_flags,
    config_from_flags,
    env_var_names,
)
from ddtree.protocol.ddtree.v1 import common_pb2
from ddtree.protocol.tensors import tensor_from_proto, tensor_to_proto
from ddtree.verifier.kv.kv_pool import KVPoolExhausted, LatentKVPool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64])
@pytest.mark.parametrize("shape", [(0, 4), (3,), (2, 5, 7)])
def test_tensor_round_trip(dtype, shape):
    x = (torch.randn(shape) * 100).to(dtype)
    y = tensor_from_proto(tensor_to_proto(x))
    assert y.dtype == dtype and tuple(y.shape) == shape
    assert torch.equal(x, y)


def test_tensor_non_contiguous_is_sent_in_logical_order():
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    assert torch.equal(tensor_from_proto(tensor_to_proto(x)), x)


@pytest.mark.parametrize(
    "msg,fragment",
    [
        (common_pb2.Tensor(data=b"\0" * 7, shape=[2], dtype=common_pb2.FLOAT32), "needs 8 bytes, got 7"),
        (common_pb2.Tensor(data=b"", shape=[2], dtype=common_pb2.DTYPE_UNSPECIFIED), "unsupported dtype"),
        (common_pb2.Tensor(data=b"", shape=[-1, 2], dtype=common_pb2.FLOAT32), "negative dimension"),
        # Empty but with strides past int64 (the fuzzer's merged messages): once an UNKNOWN from torch.empty.
        (common_pb2.Tensor(data=b"", shape=[0, 2**40, 2**40], dtype=common_pb2.FLOAT32), "is too large"),
        (common_pb2.Tensor(data=b"", shape=[0, 3] * 5, dtype=common_pb2.FLOAT32), "10 dimensions, at most 8"),
    ],
)
def test_tensor_from_proto_rejects_inconsistent_messages(msg, fragment):
    with pytest.raises(ValueError, match=fragment):
        tensor_from_proto(msg, what="features")


def test_config_precedence_flag_env_default():
    parser = argparse.ArgumentParser()
    add_config_flags(parser, VerifierConfig)
    args = parser.parse_args(["--max-batch", "3"])
    cfg = config_from_flags(VerifierConfig, args, environ={"DDTREE_MAX_BATCH": "9", "DDTREE_KV_TOKENS": "77"})
    assert cfg.max_batch == 3 and cfg.kv_tokens == 77 and cfg.max_queue == VerifierConfig().max_queue
    with pytest.raises(ValueError, match="DDTREE_KV_TOKENS='x'"):
        config_from_flags(VerifierConfig, None, environ={"DDTREE_KV_TOKENS": "x"})
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        config_from_flags(VerifierConfig, None, environ={"DDTREE_MAX_BATCH": "0"})
    with pytest.raises(ValueError, match="window must be >= -1"):
        config_from_flags(DrafterConfig, None, environ={"DDTREE_WINDOW": "-2"})
    assert config_from_flags(DrafterConfig, None, environ={"DDTREE_WINDOW": "-1"}).resolved_window() == 512
    with pytest.raises(ValueError, match="warmup_sequences must be >= 0, got -2"):
        config_from_flags(DrafterConfig, None, environ={"DDTREE_WARMUP_SEQUENCES": "-2"})
    assert "DDTREE_VERIFIER" in env_var_names(GatewayConfig)


def test_kv_pool_accounting():
    pool = LatentKVPool(num_layers=2, num_slots=10, width=4, dtype=torch.float32, device="cpu")
    a = pool.alloc(4)
    b = pool.alloc(6)
    assert pool.num_free == 0 and len(set(a.tolist()) | set(b.tolist())) == 10
    with pytest.raises(KVPoolExhausted, match="need 1 KV slots, 0 free of 10"):
        pool.alloc(1)
    pool.free(a[1:3])
    pool.check()
    assert pool.num_free == 2
    with pytest.raises(AssertionError, match="double free"):
        pool.free(a[1:2])
    pool.free(a[[0, 3]])
    pool.free(b)
    pool.check()
    assert pool.num_free == 10 and pool.num_used == 0

"""KV pool sizing: bytes per token, the three settings (exactly one takes effect), page rounding."""

from __future__ import annotations

import types

import pytest

from ddtree.config import VerifierConfig, config_from_flags, kv_setting
from ddtree.verifier.kv.graph_pool import (
    GRAPH_POOL_SAFETY,
    GRAPH_POOL_SLACK,
    WARMUP_COPIES,
    forward_peak_bytes,
    graph_pool_reserve,
    graph_reserve_for,
    static_buffer_bytes,
)
from ddtree.verifier.kv.kv_sizing import (
    DEFAULT_KV_TOKENS,
    GIB,
    KVSize,
    free_device_memory,
    kv_bytes_per_token,
    kv_size_for,
    size_kv_pool,
)
from ddtree.verifier.step.static_step import Bucket, make_buckets

V3 = kv_bytes_per_token(61, 512, 64, 2)  # DeepSeek-V3 / Kimi-K2 in bf16


def test_bytes_per_token():
    assert V3 == 61 * 576 * 2 == 70272  # 1152 B per layer (docs/design.md §7.1)
    assert kv_bytes_per_token(2, 64, 16, 4) == 640


def test_exactly_one_setting_takes_effect():
    assert size_kv_pool(bytes_per_token=V3) == KVSize(DEFAULT_KV_TOKENS, DEFAULT_KV_TOKENS * V3, V3, "default")
    s = size_kv_pool(bytes_per_token=V3, kv_tokens=1000)
    assert (s.tokens, s.bytes, s.source) == (1000, 1000 * V3, "kv_tokens")
    s = size_kv_pool(bytes_per_token=V3, kv_memory_gb=10)
    assert (s.tokens, s.source) == (10 * GIB // V3, "kv_memory_gb") and s.bytes <= 10 * GIB
    s = size_kv_pool(bytes_per_token=V3, kv_memory_fraction=0.5, free_bytes=80 * GIB)
    assert (s.tokens, s.source) == (40 * GIB // V3, "kv_memory_fraction")
    with pytest.raises(ValueError, match="needs the free device memory"):
        size_kv_pool(bytes_per_token=V3, kv_memory_fraction=0.5)


def test_rounds_down_to_whole_pages():
    assert size_kv_pool(bytes_per_token=V3, kv_tokens=1000, page_size=16).tokens == 992
    assert size_kv_pool(bytes_per_token=V3, kv_memory_gb=1, page_size=64).tokens == GIB // V3 // 64 * 64
    with pytest.raises(ValueError, match="less than one page of 16"):
        size_kv_pool(bytes_per_token=V3, kv_tokens=15, page_size=16)
    with pytest.raises(ValueError, match="0 tokens .*kv_memory_fraction"):
        size_kv_pool(bytes_per_token=V3, kv_memory_fraction=0.001, free_bytes=1000)


@pytest.mark.parametrize(
    "args, message",
    [
        ((100, 1.0, 0.0), "set only one of .*--kv-tokens 100, --kv-memory-gb 1.0"),
        ((0, 2.0, 0.5), "--kv-memory-gb 2.0, --kv-memory-fraction 0.5"),
        ((-1, 0.0, 0.0), "kv_tokens must be >= 0"),
        ((0, -2.0, 0.0), "kv_memory_gb must be >= 0"),
        ((0, 0.0, 1.5), r"kv_memory_fraction must be in \[0, 1\]"),
        ((0, float("nan"), 0.0), "kv_memory_gb must be >= 0"),
    ],
)
def test_bad_or_conflicting_settings_are_rejected(args, message):
    with pytest.raises(ValueError, match=message):
        kv_setting(*args)


def test_config_rejects_conflicts_from_flags_and_environment():
    assert VerifierConfig().kv_tokens == 0 and VerifierConfig().page_size == 1
    env = {"DDTREE_KV_MEMORY_FRACTION": "0.8", "DDTREE_PAGE_SIZE": "16"}
    cfg = config_from_flags(VerifierConfig, None, environ=env)
    assert (cfg.kv_memory_fraction, cfg.page_size) == (0.8, 16)
    with pytest.raises(ValueError, match="set only one of --kv-tokens, --kv-memory-gb, --kv-memory-fraction"):
        config_from_flags(VerifierConfig, None, environ={"DDTREE_KV_TOKENS": "4096", "DDTREE_KV_MEMORY_GB": "2"})
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        VerifierConfig(page_size=0).validate()
    with pytest.raises(ValueError, match="page_size > 1 is not supported with tp > 1"):
        VerifierConfig(page_size=16, tp=2).validate()


def test_free_memory_and_sizing_from_a_config():
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    assert abs(free_device_memory("cpu") - avail) < avail // 4
    model = types.SimpleNamespace(num_hidden_layers=2, kv_lora_rank=64, qk_rope_head_dim=16)
    s = kv_size_for(VerifierConfig(dtype="bfloat16", page_size=4, kv_memory_gb=0.001), model)
    assert (s.bytes_per_token, s.tokens % 4, s.source) == (320, 0, "kv_memory_gb")
    assert s.tokens == int(0.001 * GIB) // 320 // 4 * 4
    s = kv_size_for(VerifierConfig(kv_memory_fraction=0.01), model)
    assert s.bytes_per_token == 640 and 0 < s.bytes <= 0.011 * free_device_memory("cpu")


def test_the_fraction_applies_to_free_memory_less_the_graph_reserve():
    free, reserve = 80 * GIB, 7 * GIB + 12345
    s = size_kv_pool(bytes_per_token=V3, kv_memory_fraction=0.5, free_bytes=free, reserve_bytes=reserve)
    assert (s.tokens, s.reserve_bytes) == (int(0.5 * (free - reserve)) // V3, reserve)
    assert s.tokens < size_kv_pool(bytes_per_token=V3, kv_memory_fraction=0.5, free_bytes=free).tokens
    s = size_kv_pool(bytes_per_token=V3, kv_tokens=1000, reserve_bytes=reserve)  # an absolute size: not applied
    assert (s.tokens, s.reserve_bytes) == (1000, 0)
    with pytest.raises(ValueError, match=r"graph reserve \(8.00 GiB\) is not below the free device memory \(8.00"):
        size_kv_pool(bytes_per_token=V3, kv_memory_fraction=0.5, free_bytes=8 * GIB, reserve_bytes=8 * GIB)
    with pytest.raises(ValueError, match="reserve_bytes must be >= 0"):
        size_kv_pool(bytes_per_token=V3, reserve_bytes=-1)


SMALL = types.SimpleNamespace(hidden_size=64, num_attention_heads=2, kv_lora_rank=16, qk_rope_head_dim=8,
                              qk_nope_head_dim=8, v_head_dim=8, q_lora_rank=24, intermediate_size=96,
                              moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                              n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=3)  # fmt: skip


def test_graph_pool_reserve_is_every_buffer_and_two_largest_forwards_with_the_margin():
    """The reserve against a brute-force walk over the buckets: the sum of each one's buffers and the peak
    of the one whose forward needs most (the largest, as every term grows with batch, rows and keys)."""
    buckets = make_buckets((1, 2, 4), (1, 9), (16, 64, 128))
    total_buffers, peak, largest = 0, 0, None
    for b in buckets:
        total_buffers += static_buffer_bytes(b.batch, b.rows, b.keys, SMALL.hidden_size, 2, 2)
        p = forward_peak_bytes(SMALL, b.batch, b.rows, b.keys, 2, 2)
        if p > peak:
            peak, largest = p, b
    assert largest == Bucket(4, 9, 128)
    want = int(GRAPH_POOL_SAFETY * (total_buffers + WARMUP_COPIES * peak)) + GRAPH_POOL_SLACK
    assert graph_pool_reserve(SMALL, buckets, 2, 2) == want
    # Each bucket's buffers, tensor by tensor (models/runtime/static_batch.py with the torch backend's layout): ids and
    # positions int64, then the int32 write and key slots in the same buffer; the bf16 key bias; the all-rows
    # index; the outputs.
    T = 4 * 9
    packed = 2 * T * 8 + (T + 4 * 128) * 4
    assert static_buffer_bytes(4, 9, 128, 64, 2, 2) == packed + 4 * 9 * 128 * 2 + T * 8 + T * 64 * 2 * 3


def test_graph_reserve_for_a_config():
    plan = types.SimpleNamespace(buckets=make_buckets((1, 2), (1, 17), (512, 1024)), graphs=True)
    got = graph_reserve_for(VerifierConfig(device="cuda", dtype="bfloat16"), SMALL, plan, 3)
    assert got == (graph_pool_reserve(SMALL, plan.buckets, 3, 2), "estimate")
    assert graph_reserve_for(VerifierConfig(cuda_graph_reserve_gb=1.5), SMALL, plan, 3) == (
        int(1.5 * GIB),
        "cuda_graph_reserve_gb",
    )
    assert graph_reserve_for(VerifierConfig(), SMALL, None, 3) == (0, "none")
    cpu_plan = types.SimpleNamespace(buckets=plan.buckets, graphs=False)  # the CPU: no capture, nothing reserved
    assert graph_reserve_for(VerifierConfig(), SMALL, cpu_plan, 3) == (0, "none")
    with pytest.raises(ValueError, match="cuda_graph_reserve_gb must be >= 0"):
        VerifierConfig(cuda_graph_reserve_gb=-1).validate()

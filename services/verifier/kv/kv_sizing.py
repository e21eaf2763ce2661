"""How many tokens the latent KV pool holds, from one of three settings (pure, apart from reading memory).

    bytes per token = num_layers × (kv_lora_rank + qk_rope_head_dim) × dtype size
                      (DeepSeek-V3 in bf16: 61 × 576 × 2 = 70,272 B; docs/design.md §7.1)

Exactly one setting takes effect; setting more than one is an error (`ddtree.config.kv_setting`,
called by VerifierConfig.validate):
  --kv-tokens N            N tokens;
  --kv-memory-gb G         G GiB (G × 2^30 bytes) of KV;
  --kv-memory-fraction F   F × (the device memory free after the model is loaded (CUDA:
                           torch.cuda.mem_get_info; CPU: MemAvailable in /proc/meminfo) − the reserve
                           for the CUDA graphs' memory pool, captured after the KV pool is allocated:
                           graph_pool.py's estimate, or --cuda-graph-reserve-gb);
  none of them             DEFAULT_KV_TOKENS.
The token count is rounded down to whole pages; less than one page is an error.
"""

from __future__ import annotations

import dataclasses

import torch

from ddtree.config import kv_setting
from ddtree.models.dtypes import TORCH_DTYPES

DEFAULT_KV_TOKENS = 65536
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class KVSize:
    tokens: int  # pool slots, a multiple of the page size
    bytes: int  # tokens × bytes_per_token
    bytes_per_token: int
    source: str  # kv_tokens | kv_memory_gb | kv_memory_fraction | default
    reserve_bytes: int = 0  # taken off the free memory before the fraction applies (kv_memory_fraction only)


def kv_bytes_per_token(num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype_bytes: int) -> int:
    return num_layers * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes


def size_kv_pool(
    *,
    bytes_per_token: int,
    page_size: int = 1,
    kv_tokens: int = 0,
    kv_memory_gb: float = 0.0,
    kv_memory_fraction: float = 0.0,
    free_bytes: int | None = None,
    reserve_bytes: int = 0,
) -> KVSize:
    """The pool's size. `free_bytes` (device memory free after loading the model) is needed only with
    kv_memory_fraction, which applies to free_bytes − reserve_bytes (the CUDA graphs' pool)."""
    if bytes_per_token < 1 or page_size < 1:
        raise ValueError(f"bytes_per_token {bytes_per_token} and page_size {page_size} must be >= 1")
    if reserve_bytes < 0:
        raise ValueError(f"reserve_bytes must be >= 0, got {reserve_bytes}")
    source = kv_setting(kv_tokens, kv_memory_gb, kv_memory_fraction)
    if source == "kv_tokens":
        tokens = kv_tokens
    elif source == "kv_memory_gb":
        tokens = int(kv_memory_gb * GIB) // bytes_per_token
    elif source == "kv_memory_fraction":
        if free_bytes is None:
            raise ValueError("kv_memory_fraction needs the free device memory")
        if reserve_bytes >= free_bytes:
            raise ValueError(
                f"the CUDA graph reserve ({reserve_bytes / GIB:.2f} GiB) is not below the free device memory "
                f"({free_bytes / GIB:.2f} GiB): lower --max-batch or --max-context, set --cuda-graph-reserve-gb, "
                "or --cuda-graphs off"
            )
        tokens = int(kv_memory_fraction * (free_bytes - reserve_bytes)) // bytes_per_token
    else:
        tokens = DEFAULT_KV_TOKENS
    tokens -= tokens % page_size
    if tokens < page_size:
        raise ValueError(
            f"the KV pool would hold {tokens} tokens (from {source}, {bytes_per_token} B per token), "
            f"less than one page of {page_size}"
        )
    applied = reserve_bytes if source == "kv_memory_fraction" else 0
    return KVSize(tokens, tokens * bytes_per_token, bytes_per_token, source, applied)


def free_device_memory(device: str) -> int:
    """Bytes free now: torch.cuda.mem_get_info on a CUDA device, MemAvailable of /proc/meminfo on CPU."""
    if str(device).startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def dtype_bytes_of(name: str) -> int:
    return torch.empty(0, dtype=TORCH_DTYPES[name]).element_size()


def kv_size_for(config, model_config, reserve_bytes: int = 0) -> KVSize:
    """The pool size for a VerifierConfig and a loaded model's config (measures free memory if needed);
    reserve_bytes: graph_reserve_for's, when CUDA graphs will be captured after the pool is allocated."""
    dtype_bytes = dtype_bytes_of(config.dtype)
    per_token = kv_bytes_per_token(
        model_config.num_hidden_layers, model_config.kv_lora_rank, model_config.qk_rope_head_dim, dtype_bytes
    )
    free = free_device_memory(config.device) if config.kv_memory_fraction > 0 else None
    return size_kv_pool(
        bytes_per_token=per_token,
        page_size=config.page_size,
        kv_tokens=config.kv_tokens,
        kv_memory_gb=config.kv_memory_gb,
        kv_memory_fraction=config.kv_memory_fraction,
        free_bytes=free,
        reserve_bytes=reserve_bytes,
    )

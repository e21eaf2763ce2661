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
                           graph_pool_reserve below, or --cuda-graph-reserve-gb);
  none of them             DEFAULT_KV_TOKENS.
The token count is rounded down to whole pages; less than one page is an error.
"""

from __future__ import annotations

import dataclasses

from ddtree.config import kv_setting

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
        import torch

        return torch.cuda.mem_get_info(torch.device(device))[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def dtype_bytes_of(name: str) -> int:
    import torch

    from ddtree.models.dtypes import TORCH_DTYPES

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


# ---- the CUDA graphs' memory pool (static_step.py), reserved before the fraction applies -------------------
#
# Captured after the KV pool is allocated, the graphs hold (a) every bucket's static inputs and outputs and
# (b) one pool shared by all buckets, captured largest first: the intermediates of one forward are freed at
# the end of its capture and reused by the next, so the pool peaks at the largest bucket's activations.
# While a bucket is warmed up (outside the pool, then handed back: StaticStep.capture) a second copy of
# about that peak is in use, hence WARMUP_COPIES. forward_peak_bytes counts, per phase, every
# intermediate the forward makes as if all were live at once (an upper bound: tests/verifier/test_static_step.py
# measures the real forward's live peak against it). GRAPH_POOL_SAFETY covers the CUDA caching allocator:
# requests rounded up to 512 B, large ones carved from 2 MiB-rounded segments of which a private pool frees
# none, so different sizes per bucket leave split remainders (a quarter of the total bounds that for the
# tensors of many MiB that dominate); GRAPH_POOL_SLACK the capture stream's cuBLAS workspace and small
# per-launch allocations, independent of the bucket shapes.
WARMUP_COPIES = 2
GRAPH_POOL_SAFETY = 1.25
GRAPH_POOL_SLACK = 256 << 20
F32 = 4  # bytes: scores, softmax, router, RoPE's cos/sin and the expert combine are fp32 in any dtype
I64 = 8


def static_buffer_bytes(batch: int, rows: int, keys: int, hidden: int, n_taps: int, dtype_bytes: int) -> int:
    """One bucket's StaticBatch (models/static_batch.py) with the torch backend's layout, and its captured
    outputs. The Triton backend's plan tables are smaller from 64 keys on (no [B, Q, K] bias): a bound."""
    T = batch * rows
    tables = T + batch * keys  # int32: write slots, key slots
    packed = (2 * T + (tables + 1) // 2) * I64  # ids, positions, then the tables as int32
    inputs = packed + batch * rows * keys * 2 + T * I64  # the bf16 key bias; the all-rows index
    outputs = T * hidden * dtype_bytes * (1 + n_taps)  # final-normed rows [T, d], taps [T, n_taps·d]
    return inputs + outputs


def forward_peak_bytes(mc, batch: int, rows: int, keys: int, n_taps: int, s: int) -> int:
    """Upper bound of the memory live at once in the model's forward over a static batch at bucket (batch,
    rows, keys) with the torch attention backend (the Triton one makes less): a model config `mc`
    (models/config.py: hidden, heads, q/kv projections, MLA latent widths, expert intermediate) at TP 1,
    weights and KV in dtype_bytes `s`. Shapes as in models/padded_attention.py and mla.py; each phase's intermediates
    summed as if all were live at once, the phases (attention, MLP; in the MoE the expert matmuls and
    their combine) apart, as their intermediates are freed in between."""
    T, B, Q, K = batch * rows, batch, rows, keys
    d, H, r, dr = mc.hidden_size, mc.num_attention_heads, mc.kv_lora_rank, mc.qk_rope_head_dim
    dn, dv, ql = mc.qk_nope_head_dim, mc.v_head_dim, mc.q_lora_rank or 0
    up = 0 if s == F32 else F32  # an fp32 copy of an s tensor (.float() of an fp32 one is the tensor itself)
    norm = s + 2 * up  # per element: an RMSNorm's output (in bf16/fp16 also its fp32 copy and scaled copy)
    rope = 2 * F32 + up + s  # per element: the fp32 copy, complex product, real view copy, cast back
    # Held through the forward: the residual, RoPE's cos, sin [T, dr/2] fp32 and cis complex64, the taps.
    held = T * d * s + T * dr * 2 * F32 + T * d * s * n_taps
    residual_add = T * d * s  # x + h: the new residual beside the old
    attention = (
        T * d * norm  # input_layernorm
        + T * ql * (s + norm)  # q_a_proj, q_a_layernorm
        + T * H * (dn + dr) * s  # q
        + T * H * dr * rope  # q_pe
        + T * (r + dr) * s
        + T * r * norm
        + T * dr * rope
        + T * (r + dr) * s  # latent, its norm and RoPE, row
        + T * H * r * s  # q_lat
        + T * H * (r + dr) * (s + up + F32)  # cat, .float(), × softmax_scale
        + B * K * (r + dr) * (s + up)  # the gathered keys, in fp32
        + 2 * B * Q * H * K * F32  # scores and the masked copy; then the masked copy and the softmax
        + T * H * r * (F32 + 2 * s)  # o_lat in fp32, cast, transposed for the bmm
        + T * H * dv * 2 * s  # o, reshaped
        + T * d * s  # o_proj
    )
    dense = 3 * T * mc.intermediate_size * s + T * d * s if mc.first_k_dense_replace > 0 else 0
    moe = 0
    if mc.num_hidden_layers > mc.first_k_dense_replace:
        E, k, inter = mc.n_routed_experts, mc.num_experts_per_tok, mc.moe_intermediate_size
        shared = mc.n_shared_experts * inter
        A = T * k  # (row, choice) assignments of grouped_moe (models/moe_grouped.py)
        routing = T * d * up + 3 * T * E * F32 + T * k * (F32 + 2 * I64)  # router: x in fp32, logits, scores, choice
        # Sorted by expert: slots, keys, order, rows, counts and offsets, the weights in that order.
        routing += 5 * A * I64 + 2 * (E + 1) * I64 + A * F32
        # The gathered rows [A, d]; then gate, up, their product [A, I]; then down [A, d] in fp32, weighted,
        # and the output [T + 1, d] fp32 with its cast. Packed experts' dequantized copies (the torch path's)
        # are not counted: the fused MoE kernel the GPU runs makes none.
        experts = A * d * s + max(
            3 * A * inter * s,
            A * inter * s + A * d * (s + up + F32) + (T + 1) * d * F32 + T * d * s,
        )
        combine = T * d * s + 3 * T * shared * s + T * d * (s + s)  # the experts' sum; the shared experts, added
        moe = routing + experts + combine
    return held + residual_add + max(attention, T * d * norm + max(dense, moe))


def graph_pool_reserve(mc, buckets, n_taps: int, dtype_bytes: int) -> int:
    """Bytes to leave free for the CUDA graphs of `buckets` (static_step.Bucket: batch, rows, keys)."""
    if not buckets:
        return 0
    buffers = sum(static_buffer_bytes(b.batch, b.rows, b.keys, mc.hidden_size, n_taps, dtype_bytes) for b in buckets)
    peak = max(forward_peak_bytes(mc, b.batch, b.rows, b.keys, n_taps, dtype_bytes) for b in buckets)
    return int(GRAPH_POOL_SAFETY * (buffers + WARMUP_COPIES * peak)) + GRAPH_POOL_SLACK


def graph_reserve_for(config, model_config, plan, n_taps: int) -> tuple[int, str]:
    """(bytes, source) the KV pool leaves to a VerifierConfig's CUDA graphs: --cuda-graph-reserve-gb when set,
    else graph_pool_reserve's estimate; (0, "none") when no graph is captured (plan None or not graphs)."""
    if plan is None or not plan.graphs:
        return 0, "none"
    if config.cuda_graph_reserve_gb > 0:
        return int(config.cuda_graph_reserve_gb * GIB), "cuda_graph_reserve_gb"
    return graph_pool_reserve(model_config, plan.buckets, n_taps, dtype_bytes_of(config.dtype)), "estimate"

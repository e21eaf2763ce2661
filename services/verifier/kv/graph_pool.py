"""The CUDA graphs' memory pool (verifier/step/static_step.py), reserved before the KV pool's fraction applies.

Captured after the KV pool is allocated, the graphs hold (a) every bucket's static inputs and outputs and (b)
one pool shared by all buckets, captured largest first: the intermediates of one forward are freed at the end
of its capture and reused by the next, so the pool peaks at the largest bucket's activations. Every bucket is
warmed up before the first capture (outside the pool, then handed back: models/runtime/cuda_graphs.py), so the
warm-ups and the pool never hold that peak at the same time, hence WARMUP_COPIES = 1 (it was 2 while each
bucket's warm-up ran beside the pool of the buckets before it). forward_peak_bytes counts, per phase, every
intermediate the forward makes as if all were live at once (an upper bound: tests/verifier/test_static_step.py
measures the real forward's live peak against it, on the torch backend). GRAPH_POOL_SAFETY covers the CUDA
caching allocator: requests rounded up to 512 B, large ones carved from 2 MiB-rounded segments of which a
private pool frees none, so different sizes per bucket leave split remainders (a quarter of the total bounds
that for the tensors of many MiB that dominate); GRAPH_POOL_SLACK the capture stream's cuBLAS workspace and
small per-launch allocations, independent of the bucket shapes.

Everything is per rank: at TP N `rank_config` gives the widths one rank computes with. The attention
backend decides the attention's share: the torch backend gathers every key and scores them all
(models/layers/padded_attention.py), the Triton one keeps only its splits' fp32 partials
(kernels/mla/static_plan.py: every row's own splits, fixed by the bucket and the heads, not the device),
counted here exactly at the default kernel config.
"""

from __future__ import annotations

import math
import types

from ddtree.kernels.mla.plan import MLAKernelConfig
from ddtree.kernels.mla.static_plan import StaticPlanShape, static_plan_shape
from ddtree.verifier.kv.kv_sizing import GIB, dtype_bytes_of

WARMUP_COPIES = 1
GRAPH_POOL_SAFETY = 1.25
GRAPH_POOL_SLACK = 256 << 20
F32 = 4  # bytes: scores, softmax, router, RoPE's cos/sin and the expert combine are fp32 in any dtype
I64 = 8
I32 = 4


def rank_config(mc, tp: int, expert_parallel: bool):
    """The widths one rank computes with: heads and MLP widths split (routed experts whole under EP)."""
    if tp <= 1:
        return mc
    share = lambda n: math.ceil(n / tp)  # noqa: E731
    fields = {f: getattr(mc, f) for f in vars(mc) if not f.startswith("_")}
    fields.update(
        num_attention_heads=share(mc.num_attention_heads),
        intermediate_size=share(mc.intermediate_size),
        moe_intermediate_size=mc.moe_intermediate_size if expert_parallel else share(mc.moe_intermediate_size),
    )
    return types.SimpleNamespace(**fields)


def _triton_plan(batch: int, rows: int, keys: int, heads: int) -> StaticPlanShape:
    """A bucket's static MLA plan counts at the default kernel config (any device: they do not depend on it)."""
    return static_plan_shape(batch, rows, keys, heads, MLAKernelConfig())


def static_buffer_bytes(
    batch: int, rows: int, keys: int, hidden: int, n_taps: int, dtype_bytes: int, backend: str = "torch", heads: int = 1
) -> int:
    """One bucket's StaticBatch (models/runtime/static_batch.py) and its captured outputs: the torch backend's layout
    exactly; the Triton one's too (its plan's counts at the default kernel config; `heads`: the rank's)."""
    T = batch * rows
    if backend == "triton":
        tables = sum(_triton_plan(batch, rows, keys, heads).table_sizes().values())
        extra = 0
    else:
        tables = T + batch * keys  # int32: write slots, key slots
        extra = batch * rows * keys * 2  # the bf16 key bias
    packed = (2 * T + (tables + 1) // 2) * I64  # ids, positions, then the tables as int32
    inputs = packed + extra + T * I64  # the all-rows index
    outputs = T * hidden * dtype_bytes * (1 + n_taps)  # final-normed rows [T, d], taps [T, n_taps·d]
    return inputs + outputs


def forward_peak_bytes(mc, batch: int, rows: int, keys: int, n_taps: int, s: int, backend: str = "torch") -> int:
    """Upper bound of the memory live at once in the model's forward over a static batch at bucket (batch,
    rows, keys) with the `backend` attention: a model config `mc` (models/deepseek_v3/config.py: hidden, heads, q/kv
    projections, MLA latent widths, expert intermediate; a rank's widths: rank_config), weights and KV in
    dtype_bytes `s`. Shapes as in models/layers/padded_attention.py and mla.py; each phase's intermediates
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
        + _attend_bytes(B, Q, K, H, r, dr, s, up, backend)
        + T * H * dv * 2 * s  # o, reshaped
        + T * d * s  # o_proj
    )
    dense = 3 * T * mc.intermediate_size * s + T * d * s if mc.first_k_dense_replace > 0 else 0
    moe = 0
    if mc.num_hidden_layers > mc.first_k_dense_replace:
        E, k, inter = mc.n_routed_experts, mc.num_experts_per_tok, mc.moe_intermediate_size
        shared = mc.n_shared_experts * inter
        A = T * k  # (row, choice) assignments of grouped_moe (models/deepseek_v3/moe_grouped.py)
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


def _attend_bytes(B: int, Q: int, K: int, H: int, r: int, dr: int, s: int, up: int, backend: str) -> int:
    """The attention proper of one layer, after q_lat: its intermediates and output o_lat."""
    T = B * Q
    if backend == "triton":  # q_lat / q_pe read in place; fp32 partials of every split; o_lat, transposed
        plan = _triton_plan(B, Q, K, H)
        return plan.items * plan.block_m * ((1 << (r - 1).bit_length()) + 1) * F32 + 2 * T * H * r * s
    return (
        T * H * (r + dr) * (s + up + F32)  # cat, .float(), × softmax_scale
        + B * K * (r + dr) * (s + up)  # the gathered keys, in fp32
        + 2 * B * Q * H * K * F32  # scores and the masked copy; then the masked copy and the softmax
        + T * H * r * (F32 + 2 * s)  # o_lat in fp32, cast, transposed for the bmm
    )


def graph_pool_reserve(mc, buckets, n_taps: int, dtype_bytes: int, backend: str = "torch") -> int:
    """Bytes to leave free for the CUDA graphs of `buckets` (static_step.Bucket: batch, rows, keys) on one
    rank of widths `mc` (rank_config) with the `backend` attention."""
    if not buckets:
        return 0
    H = mc.num_attention_heads
    buffers = sum(
        static_buffer_bytes(b.batch, b.rows, b.keys, mc.hidden_size, n_taps, dtype_bytes, backend, H) for b in buckets
    )
    peak = max(forward_peak_bytes(mc, b.batch, b.rows, b.keys, n_taps, dtype_bytes, backend) for b in buckets)
    return int(GRAPH_POOL_SAFETY * (buffers + WARMUP_COPIES * peak)) + GRAPH_POOL_SLACK


def graph_reserve_for(config, model_config, plan, n_taps: int, backend: str = "torch") -> tuple[int, str]:
    """(bytes, source) the KV pool leaves to a VerifierConfig's CUDA graphs on each rank: --cuda-graph-reserve-gb
    when set, else graph_pool_reserve's estimate at the rank's widths; (0, "none") when no graph is
    captured (plan None or not graphs). `model_config` is the logical model's."""
    if plan is None or not plan.graphs:
        return 0, "none"
    if config.cuda_graph_reserve_gb > 0:
        return int(config.cuda_graph_reserve_gb * GIB), "cuda_graph_reserve_gb"
    mc = rank_config(model_config, config.tp, config.expert_parallel)
    return graph_pool_reserve(mc, plan.buckets, n_taps, dtype_bytes_of(config.dtype), backend), "estimate"

"""Fused MoE: out = Σ_j w[t, j] · down_e(silu(gate_e(x_t)) · up_e(x_t)), e = the local expert of slot j,
as moe.reference.fused_moe_reference, with the weights in their packed format (moe/weights.py).

One call is 6 launches, whatever the weight format (fp8 quantizes x and h inside the GEMMs):
  1. moe_align (3 small kernels): pairs p = token·k + slot grouped by local expert, padded to BLOCK_M;
  2. gate/up: a grouped GEMM, one program per (M-block, N-tile of I). The program reads its block's
     expert (-1: a block past the padded length, it returns at once), gathers the x rows of its pairs
     and runs two accumulators (gate, up) over one pass of K = d; h = silu(gate) · up (fp32) is stored
     per pair, h [P, I];
  3. down: the same GEMM over h (K = I) with the pair's routing weight multiplied in, y fp32 [P, D];
  4. the top-k sum: a program per (BLOCK_T tokens, D-tile) adds each token's k rows of y in slot order,
     skipping pairs of other ranks. No atomics: the result is bit-for-bit deterministic.
EVEN_K (K % BLOCK_K == 0, a property of the weight and the tile) drops the K bounds from the loads' masks.
Every shape is static in (M, k, E, config) and nothing is read back to the host: routing values are not
checked on the host (moe_align drops a pair whose id or map value is out of range; DDTREE_CHECK_ROUTING=1
checks them on the host instead, for debugging, outside CUDA graph capture).
Weights are dequantized in the K loop:
  bf16 (or fp16 / fp32): loaded and cast to the dot dtype;
  int4: BLOCK_K / 8 int32 words per row (nibble j of word w is column 8w + j, value nibble - 8; in pair
        order, ExpertWeights.paired, slot s is column quant_formats.PAIR_ORDER[s]), unpacked
        two nibbles per 32-bit op straight into the dot's dtype and multiplied there by the group scale of
        each word (gemm/int4_dequant.py: no fp32 math for bf16 scales; the group size is a multiple of 8, so
        the 8 nibbles of a word share a scale, loaded once per group where the tile holds whole groups; any
        K: the tail nibbles meet zero columns of A). The tile is a joined tensor: gemm/kwidth_fence.py keeps
        the compiler's mma operand layout that reads it with ldmatrix;
  fp8:  e4m3 weights and activations in an fp8 dot (sm_89+: Triton has no e4m3 before), every K tile
        scaled by the activation scale of its rows [BLOCK_M] and the weight block scale of its columns
        [BLOCK_N]; BLOCK_K divides the weight's K block (SCALE_BK, 128), so a tile has one scale per row /
        column. The activations (x in its dtype for gate/up, h fp32 for down) are quantized per row and
        K block in the K loop: scale = max(amax / 448, 1e-12), q = e4m3(clamp(x / scale, ±448)) (IEEE
        division, nearest even), bit for bit quantize_fp8_torch's, as FP8 block checkpoints are served,
        so the result differs from the fp32 reference by that rounding (up to 2^-4 relative per
        activation). A tile as wide as the block gets its amax from itself; a narrower one (BLOCK_K is
        cut to the largest power of two dividing the block, and smaller_configs halves it) reads the
        whole block's amax at the block's first tile and keeps the scale for the tiles after it. Each
        program of an M-block quantizes the same rows again (per N tile): the cost of no extra launch.
Numerics: fp32 accumulation; x bf16 / fp16 run the dots in x's dtype (weights dequantized to it, h
rounded to it); x fp32 runs exact fp32 dots. Under the Triton interpreter (TRITON_INTERPRET=1) every
dot is fp32 (its bf16 dot is wrong, see mla/checks.py kernel_dims), h stays fp32 and the bf16 output is
rounded with explicit bit arithmetic; the fp8 dot runs as on a GPU (the interpreter widens e4m3 to fp16,
exactly).
Tiles: the committed table of the device class and weight shape (moe/tiles.py: sm_90, sm_120; one tile for
every M, so a row's result does not depend on the rows beside it), else moe.configs.get_config. A GEMM whose
config needs more shared memory (or threads) than the device has is relaunched with
moe.configs.smaller_configs until one fits, and that one is used for its key from then on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable

import torch
import triton
import triton.language as tl

from ddtree.kernels import shared_memory
from ddtree.kernels.checks import check_device, is_interpreted
from ddtree.kernels.gemm.int4_dequant import int4_dequant_words
from ddtree.kernels.gemm.kwidth_fence import kwidth_fence
from ddtree.kernels.mla.latent_write import _round_bf16
from ddtree.kernels.moe import tiles as moe_tiles
from ddtree.kernels.moe.align import moe_align
from ddtree.kernels.moe.configs import MoeTileConfig, get_config, smaller_configs
from ddtree.kernels.moe.weights import FLOAT_DTYPES, ExpertWeights, check_routing
from ddtree.kernels.quant_formats import FP8_MAX
from ddtree.kernels.shared_memory import OutOfResources  # noqa: F401  (what a launch raises: callers catch moe.fused.OutOfResources)
from ddtree.kernels.weight_formats import FORMATS, FP8_BLOCK, INT4_PACK

_KIND = {name: f.kernel_id for name, f in FORMATS.items()}  # the KIND constexpr by format name
_INT4 = tl.constexpr(INT4_PACK.kernel_id)  # the kernels' branches of the quantized formats
_FP8 = tl.constexpr(FP8_BLOCK.kernel_id)
FP8_MIN_BLOCK_K = 32  # an 8-bit tl.dot's K on NVIDIA GPUs
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_SCALE_MIN = 1e-12  # the activation scale of an all-zero group
_FITTED: dict[tuple, MoeTileConfig] = {}  # _gemm's launch key -> the config that launched (launch_with_fallback)


@triton.jit
def _round_e4m3(x):
    """fp32 in [-448, 448] -> the nearest float8_e4m3fn value (ties to even), still fp32, so that the cast
    to e4m3 after it is exact (the interpreter's own fp32 -> fp8 cast does not carry into the exponent)."""
    bits = x.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)  # 3 mantissa bits
    sub = (tl.abs(x) * 512.0 + 8388608.0) - 8388608.0  # below 2^-6: multiples of 2^-9 (2^23 rounds to integers)
    sub = tl.where((bits >> 31) != 0, -sub, sub) * 0.001953125  # the sign of x, -0 included
    return tl.where(tl.abs(x) < 0.015625, sub, normal)


@triton.jit
def _fp8_scale(amax):
    """The activation scale of a row group from its amax: max(amax / 448, 1e-12) (quantize_fp8_torch's)."""
    return tl.maximum(tl.math.div_rn(amax, 448.0), 1e-12)  # IEEE division, as torch's (a bare / may not be)


@triton.jit
def _group_amax(A, row, row_ok, k0, K, stride_am, SCALE_BK: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_M: tl.constexpr):  # fmt: skip
    """max |A[row, k0 : k0 + SCALE_BK]| per row [BLOCK_M] (zero past K and for rows not ok), read in the
    SCALE_BK / BLOCK_K tiles of BLOCK_K columns the K loop is about to read again (a cache hit)."""
    amax = tl.zeros([BLOCK_M], tl.float32)
    for j in tl.static_range(SCALE_BK // BLOCK_K):
        offs_k = k0 + j * BLOCK_K + tl.arange(0, BLOCK_K)
        t = tl.load(A + row[:, None] * stride_am + offs_k[None, :], mask=row_ok[:, None] & (offs_k < K)[None, :],
                    other=0.0)  # fmt: skip
        amax = tl.maximum(amax, tl.max(tl.abs(t.to(tl.float32)), 1))
    return amax


@triton.jit
def _int4_scales(
    S, k0, offs_n, n_ok, K, stride_sn, stride_sk,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """The group scale of each word of an INT4 tile, [BLOCK_K / 8, BLOCK_N] (a group is whole words), each
    group's loaded once where the tile holds whole groups or lies in one (k0 is a multiple of BLOCK_K)."""
    if GROUP % BLOCK_K == 0:  # the tile lies in one group
        s = tl.load(S + offs_n * stride_sn + (k0 // GROUP) * stride_sk, mask=n_ok, other=0.0)
        return tl.broadcast_to(s[None, :], [BLOCK_K // 8, BLOCK_N])
    elif BLOCK_K % GROUP == 0:  # whole groups: each group's scale for its GROUP / 8 words
        offs_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        ok = n_ok[None, :] if EVEN_K else (offs_g < (K + GROUP - 1) // GROUP)[:, None] & n_ok[None, :]
        s = tl.load(S + offs_n[None, :] * stride_sn + offs_g[:, None] * stride_sk, mask=ok, other=0.0)
        s = tl.broadcast_to(s[:, None, :], [BLOCK_K // GROUP, GROUP // 8, BLOCK_N])
        return tl.reshape(s, [BLOCK_K // 8, BLOCK_N])
    else:  # groups of 8·m columns across tile edges: each word's own
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        ok = n_ok[None, :] if EVEN_K else (offs_w < (K + 7) // 8)[:, None] & n_ok[None, :]
        return tl.load(S + offs_n[None, :] * stride_sn + (offs_w * 8 // GROUP)[:, None] * stride_sk, mask=ok,
                       other=0.0)  # fmt: skip


@triton.jit
def _weight_tile(
    W, S, e, k0, offs_n, n_ok, K,
    stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    KIND: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
    EVEN_K: tl.constexpr, PAIRED: tl.constexpr,
):  # fmt: skip
    """W_e[n, k0 + i] as [BLOCK_K, BLOCK_N] in the dot dtype, zero past K / N (fp8: unscaled; INT4 PAIRED:
    the words in pair order)."""
    if KIND == _INT4:
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # [BLOCK_K / 8] words
        ok = n_ok[None, :] if EVEN_K else (offs_w < (K + 7) // 8)[:, None] & n_ok[None, :]
        words = tl.load(W + e * stride_we + offs_n[None, :] * stride_wn + offs_w[:, None] * stride_wk, mask=ok, other=0)
        s = _int4_scales(S + e * stride_se, k0, offs_n, n_ok, K, stride_sn, stride_sk, GROUP, BLOCK_K, BLOCK_N,
                         EVEN_K)  # fmt: skip
        # integer ops into DOT, two nibbles an op for 16-bit dots (gemm/int4_dequant.py). Padding nibbles past K
        # (K % 8, and a last group's words past K) need no mask: they dequantize to finite values and meet the A
        # columns past K, loaded as 0
        w = int4_dequant_words(words, s, DOT, PAIRED)
        if DOT != tl.float32:  # joins behind a 16-bit operand: keep the compiler's kWidth 2 (gemm/kwidth_fence.py)
            w = kwidth_fence(w)
        return w
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        ok = n_ok[None, :] if EVEN_K else (offs_k < K)[:, None] & n_ok[None, :]
        w = tl.load(W + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk, mask=ok, other=0.0)
        if KIND != _FP8:  # fp8 stays e4m3 for the fp8 dot
            w = w.to(DOT)
        return w


@triton.jit
def _moe_gemm_kernel(
    A, W1, S1, W2, S2, OUT, SORTED, BLOCK_EXPERT, TOPK_W,
    num_pairs, N, K,
    stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_om,
    ROW_DIV: tl.constexpr, GATE_UP: tl.constexpr, KIND: tl.constexpr, GROUP: tl.constexpr,
    SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, DOT: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, PAIRED: tl.constexpr,
):  # fmt: skip
    """OUT[p, n] for the pairs p of one M-block: GATE_UP silu(A W1ᵀ) · (A W2ᵀ) with A rows p // ROW_DIV
    (the tokens), else (A W1ᵀ) · TOPK_W[p] with A rows p (h). KIND 2 (fp8) quantizes A per row and K group
    of SCALE_BK columns as it goes (BLOCK_K divides SCALE_BK, so a K tile lies in one group)."""
    pid_m = tl.program_id(0)
    e = tl.load(BLOCK_EXPERT + pid_m)
    if e < 0:
        return
    e = e.to(tl.int64)
    pair = tl.load(SORTED + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]; sentinel = num_pairs
    row_ok = pair < num_pairs
    row = (pair // ROW_DIV).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc1 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    a_s = tl.zeros([BLOCK_M], tl.float32)  # fp8: the activation scale of the K group being read, per row
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a_ok = row_ok[:, None] if EVEN_K else row_ok[:, None] & (offs_k < K)[None, :]  # EVEN_K: K % BLOCK_K == 0
        a = tl.load(A + row[:, None] * stride_am + offs_k[None, :], mask=a_ok, other=0.0)
        if KIND == _FP8:  # e4m3(clamp(a / scale, ±448)) as quantize_fp8_torch; padding rows: scale 1e-12, q = 0
            a = a.to(tl.float32)
            if BLOCK_K == SCALE_BK:  # the tile is its group
                a_s = _fp8_scale(tl.max(tl.abs(a), 1))
            elif k0 % SCALE_BK == 0:  # the first tile of a group: its amax over all of the group's tiles
                a_s = _fp8_scale(_group_amax(A, row, row_ok, k0, K, stride_am, SCALE_BK, BLOCK_K, BLOCK_M))
            q = tl.minimum(tl.maximum(tl.math.div_rn(a, a_s[:, None]), -448.0), 448.0)
            a = _round_e4m3(q).to(W1.dtype.element_ty)  # exact: _round_e4m3 already rounded (the interpreter's
            # own fp32 -> e4m3 cast does not carry into the exponent; on a GPU the hardware's gives the same)
        else:
            a = a.to(DOT)
        w1 = _weight_tile(W1, S1, e, k0, offs_n, n_ok, K, stride_we, stride_wn, stride_wk, stride_se, stride_sn,
                          stride_sk, KIND, GROUP, BLOCK_K, BLOCK_N, DOT, EVEN_K, PAIRED)  # fmt: skip
        if GATE_UP:
            w2 = _weight_tile(W2, S2, e, k0, offs_n, n_ok, K, stride_we, stride_wn, stride_wk, stride_se, stride_sn,
                              stride_sk, KIND, GROUP, BLOCK_K, BLOCK_N, DOT, EVEN_K, PAIRED)  # fmt: skip
        if KIND == _FP8:  # one activation scale per row (a_s), one weight scale per column in this K tile
            s_off = e * stride_se + (offs_n // SCALE_BN) * stride_sn + (k0 // SCALE_BK) * stride_sk
            s1 = tl.load(S1 + s_off, mask=n_ok, other=0.0)
            acc1 += tl.dot(a, w1, input_precision=PRECISION) * (a_s[:, None] * s1[None, :])
            if GATE_UP:
                s2 = tl.load(S2 + s_off, mask=n_ok, other=0.0)
                acc2 += tl.dot(a, w2, input_precision=PRECISION) * (a_s[:, None] * s2[None, :])
        else:
            acc1 = tl.dot(a, w1, acc1, input_precision=PRECISION)
            if GATE_UP:
                acc2 = tl.dot(a, w2, acc2, input_precision=PRECISION)
    out = OUT + pair[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if GATE_UP:
        h = acc1 * tl.sigmoid(acc1) * acc2  # silu(gate) · up in fp32
        tl.store(out, h.to(OUT.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
    else:
        w = tl.load(TOPK_W + pair, mask=row_ok, other=0.0)
        tl.store(out, acc1 * w[:, None], mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_sum_kernel(
    Y, LOCAL, OUT, M, N, stride_om,
    TOPK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, ROUND_BF16: tl.constexpr,
):  # fmt: skip
    """out[t] = Σ_j y[t·k + j] over the slots j of local experts, for BLOCK_T tokens x BLOCK_N columns."""
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (t < M)[:, None] & (offs_n < N)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for j in range(TOPK):  # slot order: deterministic
        p = t * TOPK + j
        local = tl.load(LOCAL + p, mask=t < M, other=-1)
        acc += tl.load(Y + p[:, None] * N + offs_n[None, :], mask=ok & (local >= 0)[:, None], other=0.0)
    if ROUND_BF16:
        acc = _round_bf16(acc)
    tl.store(OUT + t[:, None] * stride_om + offs_n[None, :], acc.to(OUT.dtype.element_ty), mask=ok)


def quantize_fp8_torch(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] -> (float8_e4m3fn [R, K], fp32 scale [R, ceil(K/group)]), x ≈ q · scale per row group:
    scale = max(amax / 448, 1e-12), q = e4m3(clamp(x / scale, ±448)) rounded to nearest even."""
    R, K = x.shape
    G = -(-K // group)
    xf = torch.zeros(R, G * group, dtype=torch.float32, device=x.device)
    xf[:, :K] = x.float()
    g = xf.view(R, G, group)
    scale = (g.abs().amax(dim=2) / FP8_MAX).clamp(min=_SCALE_MIN)
    q = (g / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).view(R, -1)[:, :K]
    return q.to(torch.float8_e4m3fn).contiguous(), scale


def _format(w: ExpertWeights) -> tuple:
    scale = None if w.scale is None else (w.scale.dtype, w.scale.stride())
    return (w.kind, w.out_features, w.in_features, w.group_size, w.block, w.weight.dtype, w.weight.stride(), scale,
            w.paired)  # fmt: skip


def _check_inputs(x, gate, up, down, topk_weights, topk_ids, expert_map) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"fused moe: x must be a bf16 / fp16 / fp32 [M, d] tensor, got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', []))}")  # fmt: skip
    if x.numel() and x.stride(1) != 1:
        raise ValueError(f"fused moe: x must be contiguous in its last dim, strides {x.stride()}")
    for name, w in (("gate", gate), ("up", up), ("down", down)):
        if not isinstance(w, ExpertWeights):
            raise ValueError(f"fused moe: {name} must be ExpertWeights, got {type(w).__name__}")
        w.validate()
        for t in (w.weight, w.scale):
            if t is not None and t.device != x.device:
                raise ValueError(f"fused moe: {name} weights are on {t.device}, x on {x.device}")
    if _format(gate) != _format(up):
        raise ValueError("fused moe: gate and up must have the same kind, shape, dtype, strides, scales and word order")
    if gate.in_features != x.shape[1]:
        raise ValueError(f"fused moe: gate / up take {gate.in_features} features, x has {x.shape[1]}")
    if down.in_features != gate.out_features:
        raise ValueError(f"fused moe: down takes {down.in_features} features, gate / up give {gate.out_features}")
    if not gate.num_experts == up.num_experts == down.num_experts:
        raise ValueError(f"fused moe: expert counts differ: gate {gate.num_experts}, up {up.num_experts}, "
                         f"down {down.num_experts}")  # fmt: skip
    for name, w in (("gate / up", gate), ("down", down)):
        if w.fmt.block_scaled and (w.block[1] & -w.block[1]) < FP8_MIN_BLOCK_K:
            raise ValueError(f"fused moe: {name} fp8 scale blocks must be a multiple of {FP8_MIN_BLOCK_K} along K "
                             f"(a K tile lies in one, and an 8-bit dot needs K >= 32), got {w.block}")  # fmt: skip
    num_global = gate.num_experts if expert_map is None else expert_map.shape[0]
    if topk_weights.dtype not in FLOAT_DTYPES:
        raise ValueError(f"fused moe: topk_weights must be a float tensor, got {topk_weights.dtype}")
    if expert_map is not None and (expert_map.dim() != 1 or expert_map.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"fused moe: expert_map must be int32 or int64 [E_global], got {expert_map.dtype} "
                         f"{list(expert_map.shape)}")  # fmt: skip
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights), ("expert_map", expert_map)):
        if t is not None and t.device != x.device:
            raise ValueError(f"fused moe: {name} is on {t.device}, x on {x.device}")
    # Shapes only: the ids' and the map's values are guarded in moe_align (out of range = dropped), as
    # reading them here would sync (routing_value_checks() turns the host check on, for debugging).
    values = None if not (x.is_cuda and torch.cuda.is_current_stream_capturing()) else False
    check_routing(topk_ids, topk_weights, x.shape[0], num_global, expert_map, gate.num_experts, values)


def _configs(config, x, gate, down, topk: int, wide: bool) -> tuple[MoeTileConfig, MoeTileConfig]:
    if isinstance(config, MoeTileConfig):
        return config, config
    if isinstance(config, tuple) and len(config) == 2 and all(isinstance(c, MoeTileConfig) for c in config):
        if config[0].block_m != config[1].block_m:
            raise ValueError(f"fused moe: gate_up and down configs must share block_m, got {config}")
        return config
    if config is not None:
        raise ValueError(f"fused moe: config must be None, a MoeTileConfig or a (gate_up, down) pair, got {config!r}")
    table = moe_tiles.table_configs(_device_class(x), gate, down)
    if table is not None:  # the committed tile of this device class and weight shape, the same for every M
        return table
    name = torch.cuda.get_device_name(x.device) if x.is_cuda else None
    budget = shared_memory.device_smem_budget(x.device)
    E, M, inter, d = gate.num_experts, x.shape[0], gate.out_features, gate.in_features
    # an activation element as the tiles hold it: the dot's width, or for fp8 as loaded (x; h is fp32)
    a_gu, a_dn = gate.fmt.activation_bytes(x.element_size(), wide), down.fmt.activation_bytes(4, wide)
    gu = get_config(gate.kind, "gate_up", E, inter, d, M, topk, name, a_gu, budget)
    dn = get_config(down.kind, "down", E, down.out_features, inter, M, topk, name, a_dn, budget)
    return gu, MoeTileConfig(gu.block_m, dn.block_n, dn.block_k, dn.num_warps, dn.num_stages)


def _device_class(x: torch.Tensor) -> str | None:
    """moe/tiles.py's device class of x's GPU (None interpreted: interpreted runs use moe/configs.py's defaults;
    a step modeled for a device, tools/roofline/as_gpu.py, gets that device's class)."""
    if is_interpreted(_moe_gemm_kernel):
        return None
    return moe_tiles.device_class(torch.cuda.get_device_capability(x.device))


def launch_with_fallback(
    launch: Callable[[MoeTileConfig], None], cfg: MoeTileConfig, cache: dict, key: Hashable
) -> MoeTileConfig:
    """shared_memory.launch_with_fallback over moe.configs.smaller_configs: launch(cfg), smaller configs while
    that raises OutOfResources; cache[key] keeps the one that launched."""
    return shared_memory.launch_with_fallback(launch, cfg, cache, key, smaller_configs, _describe, "fused moe")


def _describe(c: MoeTileConfig) -> str:
    return f"{c.block_m}x{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages}"


def _gemm(a, w1: ExpertWeights, w2, out, align, cfg, row_div, topk_w, dot, precision, fallback) -> None:
    """One grouped GEMM; fallback: a config that does not fit the device shrinks (launch_with_fallback), else
    OutOfResources propagates (an explicit config is launched as given: the autotuner rejects tiles by it)."""
    N, K = w1.out_features, w1.in_features
    if w1.fmt.block_scaled:
        # a K tile lies in one scale block (the largest 2^n dividing it; smaller_configs' halving keeps that)
        # and is at least 32 wide: an 8-bit tl.dot needs K >= 32 on NVIDIA GPUs (the interpreter takes any)
        block_k = max(FP8_MIN_BLOCK_K, min(cfg.block_k, w1.block[1] & -w1.block[1]))
        cfg = dataclasses.replace(cfg, block_k=block_k)
        precision = "tf32"
    ws = w1.weight.stride()
    ss = (0, 0, 0) if w1.scale is None else w1.scale.stride()
    w_up = w2 or w1  # down: w1 again (GATE_UP is off, it is not read)

    def launch(c: MoeTileConfig) -> None:
        _moe_gemm_kernel[(align.num_blocks, triton.cdiv(N, c.block_n))](
            a, w1.weight, w1.weight if w1.scale is None else w1.scale,
            w_up.weight, w_up.weight if w_up.scale is None else w_up.scale, out,
            align.sorted_pair_ids, align.block_expert, topk_w, align.num_pairs, N, K,
            a.stride(0), *ws, *ss, out.stride(0),
            ROW_DIV=row_div, GATE_UP=w2 is not None, KIND=w1.fmt.kernel_id, GROUP=max(w1.group_size, 8),
            SCALE_BN=w1.block[0], SCALE_BK=w1.block[1], DOT=dot, PRECISION=precision, BLOCK_M=c.block_m,
            BLOCK_N=c.block_n, BLOCK_K=c.block_k, EVEN_K=K % c.block_k == 0, PAIRED=w1.paired,
            num_warps=c.num_warps, num_stages=c.num_stages,
        )  # fmt: skip

    # What sets the compiled kernel's shared memory besides the tile config: dtypes, weight format, op.
    scale_dtype = None if w1.scale is None else w1.scale.dtype
    key = (cfg, str(dot), precision, w2 is not None, w1.kind, w1.weight.dtype, scale_dtype, w1.group_size, w1.block,
           a.dtype, out.dtype, a.device.index)  # fmt: skip
    if fallback:
        launch_with_fallback(launch, cfg, _FITTED, key)
    else:
        launch(cfg)


def fused_moe(
    x: torch.Tensor,  # [M, d] bf16 / fp16 / fp32
    gate: ExpertWeights,  # [E, I, d]
    up: ExpertWeights,  # [E, I, d], the same format as gate
    down: ExpertWeights,  # [E, D, I]
    topk_weights: torch.Tensor,  # float [M, k]
    topk_ids: torch.Tensor,  # int [M, k] global expert ids
    expert_map: torch.Tensor | None = None,  # int [E_global]: local slot or -1 (another rank)
    config: MoeTileConfig | tuple[MoeTileConfig, MoeTileConfig] | None = None,  # None: moe/configs.py's table (shrunk
    # when it does not fit the device); a config given is launched as is
) -> torch.Tensor:  # [M, D], dtype of x
    """fused_moe_reference's result from the Triton kernels (ValueError on malformed inputs)."""
    _check_inputs(x, gate, up, down, topk_weights, topk_ids, expert_map)
    interpreted = is_interpreted(_moe_gemm_kernel)
    check_device(x.device, interpreted)
    need = max(gate.fmt.min_capability, down.fmt.min_capability)  # fp8: sm_89 (Ada, Hopper), Triton's first e4m3
    if need > (0, 0) and not interpreted and torch.cuda.get_device_capability(x.device) < need:
        raise ValueError(f"fused moe: {gate.kind} / {down.kind} weights need an sm_{need[0]}{need[1]}+ GPU")
    M, k = topk_ids.shape
    D = down.out_features
    out = torch.empty(M, D, dtype=x.dtype, device=x.device)
    if M == 0 or k == 0 or D == 0:
        return out.zero_()
    wide = interpreted or x.dtype == torch.float32
    cfg_gu, cfg_dn = _configs(config, x, gate, down, k, wide)
    align = moe_align(topk_ids, gate.num_experts, cfg_gu.block_m, expert_map)
    P, inter = align.num_pairs, gate.out_features
    dot = tl.float32 if wide else _TL[x.dtype]
    precision = "ieee" if wide else "tf32"  # fp32 dots are exact fp32 (no TF32); ignored for 16-bit inputs
    topk_w = topk_weights.reshape(-1).float().contiguous()

    # fp8 experts quantize x, then h, per row and K block inside the GEMMs (quantize_fp8_torch's values)
    h_dtype = torch.float32 if wide or down.fmt.quantizes_activations else x.dtype
    h = torch.empty(P, inter, dtype=h_dtype, device=x.device)
    _gemm(x, gate, up, h, align, cfg_gu, k, topk_w, dot, precision, config is None)

    y = torch.empty(P, D, dtype=torch.float32, device=x.device)
    _gemm(h, down, None, y, align, cfg_dn, 1, topk_w, dot, precision, config is None)

    block_n = min(256, triton.next_power_of_2(D))
    block_t = max(1, min(triton.next_power_of_2(M), 4096 // block_n))
    _moe_sum_kernel[(triton.cdiv(M, block_t), triton.cdiv(D, block_n))](
        y, align.local_ids, out, M, D, out.stride(0), TOPK=k, BLOCK_T=block_t, BLOCK_N=block_n,
        ROUND_BF16=x.dtype == torch.bfloat16,
    )  # fmt: skip
    return out

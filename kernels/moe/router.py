"""The DeepSeek-V3 / Kimi router in one launch: scores, sigmoid, correction bias, group-limited top-k,
top-k, renormalisation and routed scaling (services/models/deepseek_v3/moe.py DeepseekV3TopkRouter; reference
layer_reference.route_ref).

    scores = sigmoid(x · Wᵀ)                         fp32 [N, E]  (fp32 accumulate, exact fp32 products)
    choice = scores + bias                           selection only
    groups: keep the topk_group of n_group groups by the sum of their top-2 choices (others -inf)
    ids    = top_k of choice;  w = scores[ids] (/ (Σ w + 1e-20) if renormalize) · scaling

W is read in its stored dtype (the checkpoint's: bf16 in Kimi / DeepSeek checkpoints, fp32 in HF copies that
keep the router in fp32) and widened in registers: no fp32 copy is made.

The logits are computed in fixed tiles whatever the number of rows (BLOCK_M rows x BLOCK_E experts, the
hidden dimension cut into K_SPLIT-column splits, each split's dot started from zero and the splits summed in
order), so a row's result is bit for bit the same in a launch of 1 row or 1000 (row invariance). How the
work is spread is the only choice made per call: when row blocks x expert blocks would leave the device's
SMs idle (decode and tree verify: 1-17 rows), each K split is its own program (grid (row blocks, E blocks,
splits): 168 programs at 1 row for Kimi's 384 experts x 7168), storing its partial logits to an fp32
scratch [splits, N, E]; the program that finishes a (row block, E block) tile last (an atomic ticket per
tile) sums the partials in split order, the same sum a one-program-per-tile launch makes in registers.
Then, as before, each tile's sigmoid scores go to an fp32 scratch [N, E] and the program that finishes a
row block last (a ticket per row block) reads the row block's E scores back (L2, .cg) and selects. Tickets
are acquire-release at GPU scope after a block barrier; the last program resets its ticket for the next
launch, so the tickets (a small int32 buffer per device, zero at start) need no memset per call and the
launch can be graph-captured. Two launches on one device may not run concurrently on different streams
(they share the tickets).

Ties: a larger value first; among equal values the lower expert (group) index. torch.topk leaves the
order of ties unspecified, so the reference agrees wherever there are no exact ties.
ids are int64 [N, top_k] in selection order (descending choice); weights fp32 [N, top_k].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree.kernels.checks import DTYPES, check_device, is_interpreted
from ddtree.kernels.mla.plan import num_sms
from ddtree.kernels.shared_memory import device_smem_budget, dot_smem_bytes, stages_within

BLOCK_M = 16  # rows per program: fixed, so a row's logits never depend on the launch's rows (a dot's least M)
BLOCK_E = 32  # experts per program
ROUTER_BLOCK_K = 64  # hidden columns per step of the logits' K loop
K_SPLIT = 512  # hidden columns per split: each split's dot starts from zero, the splits are summed in order


def router_tiles(N: int, E: int, K: int, sms: int) -> tuple[int, int, int]:
    """(row blocks, E blocks, K splits run as their own programs: 1 when row blocks x E blocks fill `sms`)."""
    row_blocks, e_blocks = triton.cdiv(N, BLOCK_M), triton.cdiv(E, BLOCK_E)
    return row_blocks, e_blocks, triton.cdiv(K, K_SPLIT) if row_blocks * e_blocks < sms else 1


def smem_bytes(block_m: int, block_e: int, x_bytes: int, w_bytes: int, num_stages: int) -> int:
    """shared_memory's estimate: the x and weight tiles per buffer as loaded, and their fp32 copies for the dot."""
    k = ROUTER_BLOCK_K
    return dot_smem_bytes(num_stages, block_m, [(block_m, k, x_bytes), (k, block_e, w_bytes)],
                          [(block_m, k, 4 * (x_bytes < 4)), (k, block_e, 4 * (w_bytes < 4))])  # fmt: skip


# Per device, every ticket buffer ever made, the newest last. A CUDA graph captured with a buffer keeps its
# address, so a buffer is never freed: a larger call adds one (16 KB covers 4096 row blocks' tickets).
_TICKETS: dict[torch.device, list[torch.Tensor]] = {}
_MIN_TICKETS = 4096


@triton.jit
def _split_logits(X, W, rows, row_ok, offs_e, e_ok, k_lo, K, stride_xm, stride_we,
                  BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, K_SPLIT: tl.constexpr):  # fmt: skip
    """x · Wᵀ over the columns [k_lo, k_lo + K_SPLIT) of K, from zero: [BLOCK_M, BLOCK_E] fp32."""
    acc = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)
    for k0 in range(k_lo, k_lo + K_SPLIT, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(X + rows[:, None] * stride_xm + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + offs_e[None, :].to(tl.int64) * stride_we + offs_k[:, None],
                    mask=k_ok[:, None] & e_ok[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    return acc


@triton.jit
def _router_kernel(
    X, W, BIAS, PARTS, SCORES, TICKETS, OUT_W, OUT_IDS,
    M, E, K, stride_xm, stride_we, scaling, n_tiles,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, N_GROUP: tl.constexpr, G_PAD: tl.constexpr,
    TOPK_GROUP: tl.constexpr, RENORMALIZE: tl.constexpr, E_BLOCKS: tl.constexpr, SPLITS: tl.constexpr,
    N_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    K_SPLIT: tl.constexpr, E_PAD: tl.constexpr,
):  # fmt: skip
    """Program (row block, E block, split): SPLITS > 1 splits are programs (N_SPLITS of them over K), else
    one program runs all N_SPLITS splits of its tile. TICKETS: [n_tiles] per (row block, E block) tile,
    then one per row block."""
    pid_m = tl.program_id(0)
    pid_e = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    r64 = rows.to(tl.int64)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    tile_ok = row_ok[:, None] & e_ok[None, :]
    if SPLITS > 1:
        split = tl.program_id(2)
        part = _split_logits(X, W, r64, row_ok, offs_e, e_ok, split * K_SPLIT, K, stride_xm, stride_we,
                             BLOCK_M, BLOCK_E, BLOCK_K, K_SPLIT)  # fmt: skip
        tl.store(PARTS + (split * M + r64[:, None]) * E + offs_e[None, :], part, mask=tile_ok)
        tl.debug_barrier()  # every thread's partial is stored before the tile's ticket is taken
        tile = pid_m * E_BLOCKS + pid_e
        ticket = tl.atomic_add(TICKETS + tile, 1, sem="acq_rel", scope="gpu")
        if ticket != SPLITS - 1:
            return
        tl.store(TICKETS + tile, 0)  # the tile's last split: ready for the next launch
        logits = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)
        for j in range(0, SPLITS):  # in split order: the sum the one-program path makes
            logits += tl.load(PARTS + (j * M + r64[:, None]) * E + offs_e[None, :], mask=tile_ok, other=0.0,
                              cache_modifier=".cg")  # fmt: skip
    else:
        logits = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)
        for j in range(0, N_SPLITS):
            logits += _split_logits(X, W, r64, row_ok, offs_e, e_ok, j * K_SPLIT, K, stride_xm, stride_we,
                                    BLOCK_M, BLOCK_E, BLOCK_K, K_SPLIT)  # fmt: skip
    scores = tl.math.div_rn(1.0, 1.0 + tl.exp(-logits))
    tl.store(SCORES + r64[:, None] * E + offs_e[None, :], scores, mask=tile_ok)
    tl.debug_barrier()  # every thread's scores are stored before they are read back or released
    if E_BLOCKS > 1:
        ticket = tl.atomic_add(TICKETS + n_tiles + pid_m, 1, sem="acq_rel", scope="gpu")
        if ticket != E_BLOCKS - 1:
            return
        tl.store(TICKETS + n_tiles + pid_m, 0)  # the last program of this row block: ready for the next launch
        tl.debug_barrier()

    offs = tl.arange(0, E_PAD)
    ok = offs < E
    s = tl.load(SCORES + r64[:, None] * E + offs[None, :], mask=row_ok[:, None] & ok[None, :], other=0.0,
                cache_modifier=".cg")  # [BLOCK_M, E_PAD]  # fmt: skip
    bias = tl.load(BIAS + offs, mask=ok, other=0.0).to(tl.float32)
    choice = tl.where(ok[None, :], s + bias[None, :], float("-inf"))
    if N_GROUP > 1:
        group = offs // (E // N_GROUP)  # padding columns fall past the last group
        g_offs = tl.arange(0, G_PAD)
        group_score = tl.full([BLOCK_M, G_PAD], float("-inf"), dtype=tl.float32)
        for g in tl.static_range(N_GROUP):
            c = tl.where((group == g)[None, :], choice, float("-inf"))
            top1 = tl.max(c, 1)
            first = tl.min(tl.where(c == top1[:, None], offs[None, :], E_PAD), 1)
            top2 = tl.max(tl.where(offs[None, :] == first[:, None], float("-inf"), c), 1)
            group_score = tl.where(g_offs[None, :] == g, (top1 + top2)[:, None], group_score)
        keep = tl.zeros([BLOCK_M, E_PAD], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(group_score, 1)
            g_best = tl.min(tl.where(group_score == best[:, None], g_offs[None, :], G_PAD), 1)
            keep = keep | (group[None, :] == g_best[:, None])
            group_score = tl.where(g_offs[None, :] == g_best[:, None], float("-inf"), group_score)
        choice = tl.where(keep, choice, float("-inf"))

    k_offs = tl.arange(0, K_PAD)
    weights = tl.zeros([BLOCK_M, K_PAD], dtype=tl.float32)
    ids = tl.zeros([BLOCK_M, K_PAD], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(choice, 1)
        pick = tl.min(tl.where((choice == best[:, None]) & ok[None, :], offs[None, :], E_PAD), 1)  # [BLOCK_M]
        chosen = offs[None, :] == pick[:, None]
        w = tl.sum(tl.where(chosen, s, 0.0), 1)  # the unbiased score
        weights = tl.where(k_offs[None, :] == j, w[:, None], weights)
        ids = tl.where(k_offs[None, :] == j, pick.to(tl.int64)[:, None], ids)
        choice = tl.where(chosen, float("-inf"), choice)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, 1)[:, None] + 1e-20)
    weights = weights * scaling
    out_ok = row_ok[:, None] & (k_offs < TOP_K)[None, :]
    tl.store(OUT_W + r64[:, None] * TOP_K + k_offs[None, :], weights, mask=out_ok)
    tl.store(OUT_IDS + r64[:, None] * TOP_K + k_offs[None, :], ids, mask=out_ok)


def _tickets(device: torch.device, n: int) -> torch.Tensor:
    """The device's zeroed ticket buffer, at least n long (the kernel leaves it zeroed). A larger call than
    any before gets a new buffer; the old ones stay alive for the graphs that hold their addresses."""
    buffers = _TICKETS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < n:
        buffers.append(torch.zeros(max(n, _MIN_TICKETS), dtype=torch.int32, device=device))
    return buffers[-1]


def route(
    x: torch.Tensor,  # [N, d]
    weight: torch.Tensor,  # [E, d] the router weight as stored (fp32 / bf16 / fp16)
    bias: torch.Tensor,  # [E] e_score_correction_bias
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights fp32 [N, top_k], ids int64 [N, top_k]
    N, d = x.shape if x.dim() == 2 else (-1, -1)
    E = weight.shape[0] if weight.dim() == 2 else -1
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != d or bias.shape != (E,):
        raise ValueError(f"x {tuple(x.shape)} / weight {tuple(weight.shape)} / bias {tuple(bias.shape)} must be "
                         "[N, d] / [E, d] / [E]")  # fmt: skip
    if n_group < 1 or E % n_group or not 1 <= topk_group <= n_group or E // n_group < 2 and n_group > 1:
        raise ValueError(f"{E} experts in {n_group} groups (keep {topk_group}): groups must split E evenly, "
                         "at least 2 experts each")  # fmt: skip
    if not 1 <= top_k <= topk_group * (E // n_group):
        raise ValueError(f"top_k {top_k} must be in [1, {topk_group * (E // n_group)}] (the kept groups' experts)")
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t.dtype not in DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} must be in {DTYPES}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    check_device(x.device, is_interpreted(_router_kernel))
    if x.numel() and x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    out_w = torch.empty(N, top_k, dtype=torch.float32, device=x.device)
    out_ids = torch.empty(N, top_k, dtype=torch.int64, device=x.device)
    if N == 0:
        return out_w, out_ids
    e_pad = max(16, triton.next_power_of_2(E))
    row_blocks, e_blocks, splits = router_tiles(N, E, d, num_sms(x.device))
    n_tiles = row_blocks * e_blocks
    scores = torch.empty(N, E, dtype=torch.float32, device=x.device)
    parts = torch.empty(splits if splits > 1 else 0, N, E, dtype=torch.float32, device=x.device)
    smem = lambda s: smem_bytes(BLOCK_M, BLOCK_E, x.element_size(), weight.element_size(), s)  # noqa: E731
    stages = stages_within(device_smem_budget(x.device), smem)
    _router_kernel[(row_blocks, e_blocks, splits)](
        x, weight, bias.contiguous(), parts, scores, _tickets(x.device, n_tiles + row_blocks), out_w, out_ids,
        N, E, d, x.stride(0), weight.stride(0), float(scaling), n_tiles,
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), N_GROUP=n_group, G_PAD=triton.next_power_of_2(n_group),
        TOPK_GROUP=topk_group, RENORMALIZE=bool(renormalize), E_BLOCKS=e_blocks, SPLITS=splits,
        N_SPLITS=triton.cdiv(d, K_SPLIT), BLOCK_M=BLOCK_M, BLOCK_E=BLOCK_E, BLOCK_K=ROUTER_BLOCK_K, K_SPLIT=K_SPLIT,
        E_PAD=e_pad, num_warps=8 if e_pad >= 256 else 4, num_stages=stages,
    )  # fmt: skip
    return out_w, out_ids

"""Fused MoE (kernels/moe/fused.py, moe/align.py, moe/configs.py) against the per-expert loop reference.

Each weight kind (bf16 / int4 / fp8) runs over E in {4, 16, 64}, top-k in {1, 2, 8} and M in {1, 17, 136}
in combined cases (not the cross product): skewed routing (every pair on one expert), experts without
pairs, expert parallel (expert_map with -1), N and K not multiples of the tile nor of the int4 group /
word / fp8 block. bf16 and int4 must match fused_moe_reference within the shared comparator's default
tolerances. fp8 quantizes its activations (x and h, per row and 128-block, as W8A8 block checkpoints
run), which the reference does not: it is compared exactly-ish with a reference that applies the same
activation quantization (_fp8_oracle) and loosely with fused_moe_reference itself.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.support.triton_env import DEVICE, INTERPRET, triton_interpret_env  # noqa: F401  (before kernels are imported)

# isort: split
# tests/support/triton_env.py imported the kernel modules with the interpreter set; these are those modules.
from ddtree.kernels.moe import align as ma
from ddtree.kernels.moe import configs as mc
from ddtree.kernels.moe import fused as fm

if INTERPRET and not fm.is_interpreted(fm._moe_gemm_kernel):
    raise RuntimeError("ddtree.kernels.moe.fused was imported before TRITON_INTERPRET=1 was set: add it to the "
                       "imports of tests/support/triton_env.py")  # fmt: skip

import triton.language as tl  # noqa: E402

from ddtree.kernels.moe.reference import fused_moe_reference  # noqa: E402
from ddtree.kernels.moe.weights import ExpertWeights  # noqa: E402
from ddtree.kernels.quant_formats import pair_int4_words, quantize_fp8_block, quantize_int4_group  # noqa: E402
from ddtree.tools.selftest.compare import assert_close  # noqa: E402

MoeTileConfig = mc.MoeTileConfig


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    kind: str
    E: int
    topk: int
    M: int
    d: int = 40  # hidden size: gate / up K, down N
    inter: int = 24  # intermediate size: gate / up N, down K
    dtype: torch.dtype = torch.bfloat16
    routing: str = "random"  # random (distinct experts per token) | skewed (all on one) | sparse (2 experts)
    ep: bool = False  # expert_map over 2E global experts, E of them local
    group: int = 16  # int4 group size
    block: tuple[int, int] = (16, 32)  # fp8 scale block (K: a multiple of 32, an 8-bit dot's least K)
    config: MoeTileConfig | None = None  # None: moe_configs' default

    def __str__(self) -> str:
        return self.name


SMALL = MoeTileConfig(16, 16, 16)  # several N and K tiles at these widths
CASES = [
    Case("bf16_e4_k1_m1", "bf16", 4, 1, 1),
    Case("bf16_e16_k2_m17_fp32_tiles", "bf16", 16, 2, 17, d=44, inter=20, dtype=torch.float32, config=SMALL),
    Case("bf16_e64_k8_m136_ep", "bf16", 64, 8, 136, ep=True, config=MoeTileConfig(64, 32, 64)),
    Case("bf16_e16_k8_m17_skewed_fp16", "bf16", 16, 8, 17, dtype=torch.float16, routing="skewed"),
    Case("int4_e4_k2_m136_skewed", "int4", 4, 2, 136, d=72, inter=48, group=32, routing="skewed"),
    Case("int4_e16_k8_m17_tiles", "int4", 16, 8, 17, d=44, inter=20, config=SMALL),  # K % 8 != 0: padding nibbles
    Case("int4_e64_k1_m136_fp16_ep", "int4", 64, 1, 136, d=48, inter=32, dtype=torch.float16, ep=True, group=8),
    Case("int4_e16_k2_m1_fp32_sparse", "int4", 16, 2, 1, d=80, inter=40, dtype=torch.float32, group=24),
    Case("fp8_e4_k2_m17_blocks", "fp8", 4, 2, 17, d=48, inter=40, block=(16, 32), config=SMALL),
    Case("fp8_e16_k8_m136_ep", "fp8", 16, 8, 136, d=64, inter=32, ep=True, block=(32, 32)),
    Case("fp8_e64_k1_m1_fp32", "fp8", 64, 1, 1, d=40, inter=24, dtype=torch.float32, block=(128, 128)),
    Case("fp8_e16_k8_m17_sparse_128", "fp8", 16, 8, 17, d=72, inter=48, routing="sparse", block=(128, 128)),
    Case("fp8_e4_k1_m136_skewed_fp16", "fp8", 4, 1, 136, d=40, inter=32, dtype=torch.float16, routing="skewed"),
    # K tiles of 32 (SMALL's 16 raised to an 8-bit dot's least) in scale blocks of 64: a group's amax is read at
    # its first tile; ragged last groups
    Case("fp8_e8_k2_m17_narrow_k_tiles", "fp8", 8, 2, 17, d=200, inter=72, block=(16, 64), config=SMALL),
]


def _weights(kind: str, E: int, N: int, K: int, gen, group: int, block) -> ExpertWeights:
    w = torch.randn(E, N, K, generator=gen) / K**0.5
    if kind == "bf16":
        return ExpertWeights("bf16", w.to(torch.bfloat16), N, K)
    if kind == "int4":
        packed = [quantize_int4_group(w[e], group)[:2] for e in range(E)]
        return ExpertWeights("int4", torch.stack([p for p, _ in packed]), N, K, torch.stack([s for _, s in packed]),
                             group_size=group)  # fmt: skip
    q = [quantize_fp8_block(w[e], block) for e in range(E)]
    return ExpertWeights("fp8", torch.stack([a for a, _ in q]), N, K, torch.stack([s for _, s in q]), block=block)


def _to(w: ExpertWeights, device) -> ExpertWeights:
    scale = None if w.scale is None else w.scale.to(device)
    return dataclasses.replace(w, weight=w.weight.to(device), scale=scale)


def _routing(case: Case, gen):
    """topk_ids [M, k] (global), topk_weights [M, k], expert_map or None."""
    G = 2 * case.E if case.ep else case.E
    if case.routing == "skewed":
        ids = torch.full((case.M, case.topk), G // 2 + 1, dtype=torch.int64)
    elif case.routing == "sparse":
        ids = torch.tensor([1, G - 2])[torch.randint(0, 2, (case.M, case.topk), generator=gen)]
    else:
        ids = torch.stack([torch.randperm(G, generator=gen)[: case.topk] for _ in range(case.M)]).reshape(case.M, -1)
    emap = None
    if case.ep:  # E local experts of the 2E, scattered; the skewed expert G/2 + 1 is local
        local = torch.randperm(G, generator=gen)[: case.E].sort().values
        if case.routing == "skewed" and G // 2 + 1 not in local:
            local[0] = G // 2 + 1
            local = local.sort().values
        emap = torch.full((G,), -1, dtype=torch.int32)
        emap[local] = torch.arange(case.E, dtype=torch.int32)
    weights = torch.rand(case.M, case.topk, generator=gen) + 0.1
    return ids.to(torch.int32 if case.M % 2 else torch.int64), weights, emap


def _inputs(case: Case, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    gate = _weights(case.kind, case.E, case.inter, case.d, gen, case.group, case.block)
    up = _weights(case.kind, case.E, case.inter, case.d, gen, case.group, case.block)
    down = _weights(case.kind, case.E, case.d, case.inter, gen, case.group, case.block)
    x = (torch.randn(case.M, case.d, generator=gen) * 2).to(case.dtype)
    ids, weights, emap = _routing(case, gen)
    return x, gate, up, down, weights, ids, emap


def _on_device(*ts):
    return [t if t is None else _to(t, DEVICE) if isinstance(t, ExpertWeights) else t.to(DEVICE) for t in ts]


def _qdq(t: torch.Tensor, group: int) -> torch.Tensor:
    q, s = fm.quantize_fp8_torch(t, group)
    return q.float() * s.repeat_interleave(group, dim=1)[:, : t.shape[1]]


def _fp8_oracle(x, gate, up, down, weights, ids, emap) -> torch.Tensor:
    """fused_moe_reference with the fp8 path's activation quantization of x and of h."""
    local = ids.long() if emap is None else emap.long()[ids.long()]
    out = torch.zeros(x.shape[0], down.out_features)
    xq = _qdq(x.float(), gate.block[1])
    for e in sorted(set(local.flatten().tolist()) - {-1}):
        rows, slots = (local == e).nonzero(as_tuple=True)
        h = F.silu(xq[rows] @ gate.dequantize(e).T) * (xq[rows] @ up.dequantize(e).T)
        out.index_add_(0, rows, (_qdq(h, down.block[1]) @ down.dequantize(e).T) * weights[rows, slots, None].float())
    return out.to(x.dtype)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_fused_moe_matches_reference(case):
    x, gate, up, down, weights, ids, emap = _inputs(case)
    got = fm.fused_moe(*_on_device(x, gate, up, down, weights, ids, emap), config=case.config).cpu()
    expected = fused_moe_reference(x, gate, up, down, weights, ids, emap)
    assert got.dtype == x.dtype and got.shape == expected.shape
    if case.kind != "fp8":
        assert_close(case.name, got, expected)
        return
    # h is rounded to fp8 after a differently ordered fp32 sum, so an element may land one e4m3 step away
    oracle = _fp8_oracle(x, gate, up, down, weights, ids, emap)
    assert_close(f"{case.name} vs quantized oracle", got, oracle, **({"abs_tol": 2e-3 * oracle.abs().max().item(),
                 "rel_tol": 1e-2, "cos_tol": 1e-5} if case.dtype == torch.float32 else {}))  # fmt: skip
    scale = expected.float().abs().max().item()
    assert_close(f"{case.name} vs reference", got, expected, abs_tol=0.2 * scale, rel_tol=0.3, cos_tol=5e-3)


def _paired(w: ExpertWeights) -> ExpertWeights:
    return dataclasses.replace(w, weight=pair_int4_words(w.weight), paired=True)


@pytest.mark.parametrize("case", [c for c in CASES if c.kind == "int4"], ids=str)
def test_int4_words_in_pair_order_give_the_same_result_bit_for_bit(case):
    """The device path's word order (quant_formats.pair_int4_words: no byte permutes in the unpack) is the same
    weights: the kernel's output equals its output on the checkpoint's order bit for bit, and the reference
    (ExpertWeights.dequantize) reads the paired words as the same matrices."""
    x, gate, up, down, weights, ids, emap = _inputs(case)
    paired = [_paired(w) for w in (gate, up, down)]
    for ours, theirs in zip(paired, (gate, up, down), strict=True):
        assert not torch.equal(ours.weight, theirs.weight)  # the nibbles did move
        assert torch.equal(ours.dequantize(1), theirs.dequantize(1))
    want = fm.fused_moe(*_on_device(x, gate, up, down, weights, ids, emap), config=case.config).cpu()
    got = fm.fused_moe(*_on_device(x, *paired, weights, ids, emap), config=case.config).cpu()
    assert torch.equal(got.view(torch.int16 if got.dtype != torch.float32 else torch.int32),
                       want.view(torch.int16 if want.dtype != torch.float32 else torch.int32))  # fmt: skip


def test_fused_moe_edge_cases():
    """M = 0, every pair on another rank (zeros), determinism, x rows with a stride, an int64 expert_map."""
    case = Case("edge", "int4", 4, 2, 5, ep=True)
    x, gate, up, down, weights, ids, emap = _inputs(case)
    dev = _on_device(x, gate, up, down, weights, ids, emap)
    empty = fm.fused_moe(dev[0][:0], *dev[1:4], dev[4][:0], dev[5][:0], dev[6])
    assert empty.shape == (0, case.d) and empty.dtype == x.dtype
    none_local = torch.full_like(dev[6], -1)
    zeros = fm.fused_moe(*dev[:6], none_local).cpu()
    assert torch.equal(zeros, torch.zeros_like(zeros))
    first = fm.fused_moe(*dev, config=SMALL)
    assert torch.equal(first, fm.fused_moe(*dev, config=SMALL)), "two runs differ"
    assert_close("edge", first.cpu(), fused_moe_reference(x, gate, up, down, weights, ids, emap))
    wide = torch.zeros(x.shape[0], x.shape[1] + 24, dtype=x.dtype, device=DEVICE)
    wide[:, 8 : 8 + x.shape[1]] = dev[0]  # rows with a stride of d + 24
    strided = fm.fused_moe(wide[:, 8 : 8 + x.shape[1]], *dev[1:6], dev[6].long(), config=SMALL)
    assert torch.equal(strided, first)


@pytest.mark.parametrize("case_name", ["int4_e16_k8_m17_tiles", "fp8_e4_k2_m17_blocks"])
def test_fused_moe_runs_the_kernels(monkeypatch, case_name):
    """The kernels do the work: the reference is never called, and each GEMM launches once (fp8 too: its
    activations are quantized inside the GEMMs, no launch of their own)."""
    import ddtree.kernels.moe.reference as ref_module

    case = next(c for c in CASES if c.name == case_name)
    x, gate, up, down, weights, ids, emap = _inputs(case)
    oracle = _fp8_oracle if case.kind == "fp8" else fused_moe_reference  # fp8: the activations quantized too
    expected = oracle(x, gate, up, down, weights, ids, emap)
    launches = []
    for name in ("_moe_gemm_kernel", "_moe_sum_kernel"):
        kernel = getattr(fm, name)
        real_run = kernel.run
        monkeypatch.setattr(kernel, "run", lambda *a, _n=name, _r=real_run, **kw: launches.append(_n) or _r(*a, **kw))

    def boom(*args, **kwargs):
        raise AssertionError("fused_moe fell back to the reference")

    monkeypatch.setattr(ref_module, "fused_moe_reference", boom)
    launched = []  # every `kernel[grid](...)` of any Triton kernel: nothing but the align, GEMM and sum kernels
    cls = type(fm._moe_gemm_kernel)
    real_getitem = cls.__getitem__
    monkeypatch.setattr(
        cls, "__getitem__", lambda self, grid: launched.append(self.__name__) or real_getitem(self, grid)
    )
    got = fm.fused_moe(*_on_device(x, gate, up, down, weights, ids, emap), config=case.config).cpu()
    assert launches == ["_moe_gemm_kernel", "_moe_gemm_kernel", "_moe_sum_kernel"], launches
    assert len(launched) == 6 and not [n for n in launched if "quant" in n], launched
    assert_close("launches", got, expected)


ALIGN = [  # (M, k, E, block_m, global experts for an expert_map or None, routing)
    (1, 8, 4, 16, None, "random"),
    (17, 2, 16, 16, None, "random"),
    (136, 8, 64, 32, 128, "random"),
    (136, 1, 16, 64, None, "skewed"),
    (0, 2, 4, 16, None, "random"),
    (40, 8, 384, 16, None, "random"),  # the Kimi expert count: BLOCK_E 512, one-hot sub-chunks of 8
    (600, 2, 3, 16, 7, "random"),  # several chunks of 256 pairs
]


def _align_brute(ids: torch.Tensor, E: int, block_m: int, emap) -> tuple[list[int], list[int]]:
    flat = ids.reshape(-1).tolist()
    P = len(flat)
    local = [e if emap is None else int(emap[e]) for e in flat]
    pairs, blocks = [], []
    for e in range(E):
        mine = [p for p in range(P) if local[p] == e]
        n = -(-len(mine) // block_m) * block_m
        pairs += mine + [P] * (n - len(mine))
        blocks += [e] * (n // block_m)
    return pairs, blocks


@pytest.mark.parametrize("M, k, E, block_m, G, routing", ALIGN)
def test_moe_align_matches_brute_force(M, k, E, block_m, G, routing):
    gen = torch.Generator().manual_seed(M + E)
    emap = None
    if G:
        emap = torch.full((G,), -1, dtype=torch.int32)
        emap[torch.randperm(G, generator=gen)[:E].sort().values] = torch.arange(E, dtype=torch.int32)
    ids = torch.randint(0, G or E, (M, k), generator=gen)
    if routing == "skewed":
        ids.fill_(E // 2)
    got = ma.moe_align(*_on_device(ids), E, block_m, None if emap is None else emap.to(DEVICE))
    twin = ma.moe_align_torch(ids, E, block_m, emap)
    for field in ("sorted_pair_ids", "block_expert", "num_padded", "local_ids"):
        assert torch.equal(getattr(got, field).cpu(), getattr(twin, field)), field
    pairs, blocks = _align_brute(ids, E, block_m, emap)
    n = int(got.num_padded)
    assert n == len(pairs) and got.sorted_pair_ids.shape[0] == ma.capacity(M * k, E, block_m)
    assert got.sorted_pair_ids[:n].tolist() == pairs and got.block_expert[: n // block_m].tolist() == blocks
    assert (got.sorted_pair_ids[n:] == M * k).all() and (got.block_expert[n // block_m :] == -1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group,block_k", [(128, 128), (128, 32), (32, 32), (96, 32)], ids=lambda v: str(v))
def test_fp8_activation_quantization_is_bit_exact(group, block_k, dtype):
    """The GEMM's in-kernel quantizer equals the torch twin bit for bit, ties and e4m3 subnormals included,
    for K tiles as wide as the group and narrower (the group's amax read at its first tile), a group that
    is no power of two, and a ragged last group. Read through one grouped GEMM (down's: A rows = pairs, the
    routing weight 1) with an identity expert of unit scales: y[:, j] = q[:, j] · s[:, j // group] in fp32,
    the other K groups adding exact zeros."""
    gen = torch.Generator().manual_seed(3)
    R, K = 37, 300
    x = torch.randn(R, K, generator=gen) * torch.logspace(-4, 3, K)[None, :]
    x[3] = 0.0  # an all-zero row: scale 1e-12, q = 0
    grid = torch.tensor([0.0, 2**-9, 2**-8, 3 * 2**-9, 2**-6, 1.0, 1.125, 240.0, 256.0, 416.0, 448.0])
    ties = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, grid * 0.999, -grid * 1.001])  # midpoints round to even
    x[5, : ties.numel()] = ties
    x[5, 31] = 448.0  # the row group's amax: scale exactly 1 (31 < every group size here)
    x = x.to(dtype)
    eye = ExpertWeights("fp8", torch.eye(K).to(torch.float8_e4m3fn)[None], K, K,
                        torch.ones(1, -(-K // 128), -(-K // group)), block=(128, group))  # fmt: skip
    ids = torch.zeros(R, 1, dtype=torch.int32)  # every row a pair of expert 0, in row order
    cfg = MoeTileConfig(16, 64, block_k, 4, 1)
    align = ma.moe_align(ids.to(DEVICE), 1, cfg.block_m)
    y = torch.empty(R, K, device=DEVICE)
    ones = torch.ones(R, device=DEVICE)
    fm._gemm(x.to(DEVICE), _to(eye, DEVICE), None, y, align, cfg, 1, ones, tl.float32, "ieee", False)
    q_ref, s_ref = fm.quantize_fp8_torch(x, group)
    want = q_ref.float() * s_ref.repeat_interleave(group, dim=1)[:, :K]
    bad = (y.cpu() != want).nonzero()
    assert bad.numel() == 0, [(x[i, j].item(), y[i, j].item(), want[i, j].item()) for i, j in bad[:5].tolist()]


def _bad_inputs():
    case = Case("err", "int4", 4, 2, 3)
    x, gate, up, down, weights, ids, emap = _inputs(case)
    other = _weights("int4", 4, case.inter, case.d, torch.Generator().manual_seed(1), 8, None)
    fp8 = _weights("fp8", 4, case.inter, case.d, torch.Generator().manual_seed(1), 0, (16, 16))
    fp8_k8 = dataclasses.replace(fp8, scale=torch.ones(4, 2, 5), block=(16, 8))
    ok = dict(x=x, gate=gate, up=up, down=down, topk_weights=weights, topk_ids=ids, expert_map=None)
    emap = torch.tensor([0, 1, 2, 3, -1], dtype=torch.int32)
    return ok, [
        (dict(x=x[None]), "x must be a bf16 / fp16 / fp32 \\[M, d\\]"),
        (dict(x=x.to(torch.int32)), "x must be a bf16"),
        (dict(x=torch.randn(case.d, 3).to(x.dtype).T), "contiguous in its last dim"),
        (dict(gate=gate.weight), "gate must be ExpertWeights"),
        (dict(up=other), "gate and up must have the same"),
        (dict(x=x[:, :-8]), "gate / up take 40 features, x has 32"),
        (dict(down=_weights("int4", 4, case.d, 16, torch.Generator(), 16, None)), "down takes 16 features"),
        (dict(down=_weights("int4", 5, case.d, case.inter, torch.Generator(), 16, None)), "expert counts differ"),
        (dict(gate=fp8_k8, up=fp8_k8), "multiple of 32 along K"),
        (dict(topk_ids=ids[:-1], topk_weights=weights[:-1]), "topk_ids must be \\[3, k\\]"),
        (dict(topk_weights=weights[:, :1]), "topk_weights \\[3, 1\\] != topk_ids"),
        (dict(topk_ids=ids.float()), "int32 or int64"),
        (dict(topk_weights=weights.long()), "topk_weights must be a float"),
        (dict(expert_map=emap[None]), "expert_map must be int32 or int64 \\[E_global\\]"),
        (dict(expert_map=emap.float()), "expert_map must be int32 or int64"),
        (dict(config="big"), "config must be None, a MoeTileConfig"),
        (dict(config=(MoeTileConfig(16), MoeTileConfig(32))), "share block_m"),
    ]


def test_out_of_range_routing_is_dropped_or_rejected_on_request(monkeypatch):
    """Routing values are not read back in a forward: an id outside [0, E_global) or a map value outside
    [-1, E_local) drops its pair (it contributes nothing, as another rank's expert would), in the Triton
    alignment, its torch twin and the CPU grouped path alike; DDTREE_CHECK_ROUTING=1 rejects them instead."""
    from ddtree.models.deepseek_v3.moe_grouped import grouped_moe

    case = Case("range", "int4", 4, 2, 3)
    x, gate, up, down, weights, ids, _ = _inputs(case)
    bad_ids = ids.clone()
    bad_ids[0, 0], bad_ids[2, 1] = 4, -3  # two pairs out of range
    emap = torch.tensor([0, 1, 2, 3, -1], dtype=torch.int32)
    emap_bad = torch.tensor([0, 1, 2, 4, -7], dtype=torch.int32)  # global 3 -> 4 and 4 -> -7: out of range
    bad_map_ids = ids % 4
    bad_map_ids[1, 0] = 3
    kept_weights = weights.clone()
    kept_weights[0, 0] = kept_weights[2, 1] = 0.0  # the reference with the dropped pairs weighted 0
    kept_ids = bad_ids.clamp(0, 3)
    map_weights = torch.where(bad_map_ids == 3, 0.0, weights)
    on = [fm.fused_moe, grouped_moe]
    for fn in on:  # the grouped path in fp32 (its bf16 matmuls round h, which the reference does not)
        dev, xf = (DEVICE, x) if fn is fm.fused_moe else ("cpu", x.float())
        args = _on_device(xf, gate, up, down) if dev == DEVICE else [xf, gate, up, down]
        got = fn(*args, weights.to(dev), bad_ids.to(dev))
        assert_close(f"{fn.__name__} ids", got.cpu(), fused_moe_reference(xf, gate, up, down, kept_weights, kept_ids))
        got = fn(*args, weights.to(dev), bad_map_ids.to(dev), emap_bad.to(dev))
        want = fused_moe_reference(xf, gate, up, down, map_weights, bad_map_ids, emap)
        assert_close(f"{fn.__name__} map", got.cpu(), want)
    twin = ma.moe_align_torch(bad_ids, 4, 16)
    got = ma.moe_align(bad_ids.to(DEVICE), 4, 16)
    assert twin.local_ids[0] == -1 and twin.local_ids[5] == -1
    for field in ("sorted_pair_ids", "block_expert", "num_padded", "local_ids"):
        assert torch.equal(getattr(got, field).cpu(), getattr(twin, field)), field
    monkeypatch.setenv("DDTREE_CHECK_ROUTING", "1")
    for fn in on:
        with pytest.raises(ValueError, match="expert ids must be in \\[0, 4\\)"):
            fn(x, gate, up, down, weights, bad_ids)
    with pytest.raises(ValueError, match="expert_map values must be in \\[-1, 4\\)"):
        fm.fused_moe(x, gate, up, down, weights, bad_map_ids, emap_bad)


def test_fused_moe_rejects_bad_inputs():
    ok, bad = _bad_inputs()
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            fm.fused_moe(**{**ok, **change})
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        MoeTileConfig(16, 24)


def test_moe_configs_table(tmp_path, monkeypatch):
    """Nearest M bucket of the device's table, defaults without one, a clear error on a malformed file."""
    monkeypatch.setattr(mc, "TABLE_DIR", tmp_path)
    path = mc.device_table_path("NVIDIA H200 (test)")
    assert path == tmp_path / "NVIDIA_H200_test.json"
    a, b = MoeTileConfig(16, 32, 128, 4, 3), MoeTileConfig(64, 128, 64, 8, 4)
    mc.save_table(path, {mc.table_key("int4", "gate_up", 384, 256, 7168): {1: a, 128: b}}, "NVIDIA H200 (test)")
    get = lambda M: mc.get_config("int4", "gate_up", 384, 256, 7168, M, 8, "NVIDIA H200 (test)")  # noqa: E731
    assert get(1) == a and get(8) == a and get(100) == b and get(4096) == b
    assert mc.get_config("int4", "down", 384, 7168, 256, 8, 8, "NVIDIA H200 (test)") == mc.default_config(
        "int4", "down", 384, 7168, 256, 8, 8
    )
    assert mc.get_config("fp8", "down", 8, 64, 32, 8, 2, None).block_m == 16
    assert mc.default_config("bf16", "gate_up", 4, 256, 7168, 4096, 8).block_m == 64
    path.write_text(json.dumps({"configs": {"k": {"1": {"block_m": 16, "bogus": 1}}}}))
    mc.load_table.cache_clear()
    with pytest.raises(ValueError, match="NVIDIA_H200_test.json.*unknown fields"):
        get(1)
    mc.load_table.cache_clear()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the bench runs for real on a GPU")
def test_bench_kernels_without_cuda_exits_2():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "scripts.bench.bench_moe_kernels", "--moe"], capture_output=True,
                         text=True, timeout=120, env=env)  # fmt: skip
    assert res.returncode == 2, res.stdout + res.stderr
    assert "needs a CUDA device" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU stand-in for the GPU bench")
def test_bench_kernels_dry_run(tmp_path):
    """The bench's code paths (timing, the loop baseline, the output check, --autotune writing a table that
    moe_configs reads back) on tiny shapes, interpreted."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out, table = tmp_path / "bench.json", tmp_path / "table.json"
    res = subprocess.run([sys.executable, "-m", "scripts.bench.bench_moe_kernels", "--moe", "--dry-run", "--autotune",
                          "--m", "3", "--out", str(out), "--table", str(table)], capture_output=True, text=True,
                         timeout=300, env=env)  # fmt: skip
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["kind"] for r in rows} == {"int4", "fp8", "bf16"} and all(r["ok"] for r in rows)
    tuned = mc.load_table(table)
    assert set(tuned) == {"int4/gate_up/E8/N32/K64", "int4/down/E8/N64/K32"} and all(3 in v for v in tuned.values())


def test_bench_kernels_compile_only(tmp_path):
    """The kernels build for sm_90 at the DeepSeek-V3 decode shapes with the default configs (no GPU needed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "compile.json"
    res = subprocess.run([sys.executable, "-m", "scripts.bench.bench_moe_kernels", "--moe", "--compile-only",
                          "--models", "deepseek-v3", "--m", "1", "--out", str(out)], capture_output=True, text=True,
                         timeout=600, env=env)  # fmt: skip
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    rows = json.loads(out.read_text())["compile"]
    assert {r["kernel"].split(" E")[0] for r in rows} >= {"fp8 gate_up", "fp8 down", "bf16 gate_up", "bf16 down"}
    assert all(r["registers"] > 0 for r in rows)

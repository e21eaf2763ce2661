"""The packed modules on the CPU: the grouped MoE path against the per-expert reference loop
(kernels/moe/reference.py) for bf16 / int4 / fp8 expert weights, skewed and empty routing and an
expert-parallel map; its gradients against autograd through the loop; Int4Linear / Fp8Linear against
F.linear on the dequantized weight; the stacked experts' per-expert state dict."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddtree.kernels.moe.reference import fused_moe_reference
from ddtree.kernels.moe.weights import ExpertWeights
from ddtree.kernels.quant_formats import quantize_fp8_block, quantize_int4_group
from ddtree.models.deepseek_v3 import moe_grouped
from ddtree.models.deepseek_v3.moe_experts import StackedExperts
from ddtree.models.deepseek_v3.moe_grouped import grouped_moe
from ddtree.models.layers import packed_linear
from ddtree.models.layers.packed_linear import Fp8Linear, Int4Linear
from ddtree.tools.selftest.compare import assert_close

METHODS = ["grouped_mm", "bmm"]


def experts(kind: str, E: int, N: int, K: int, seed: int, dtype=torch.float32, block=(16, 32)) -> ExpertWeights:
    w = torch.randn(E, N, K, generator=torch.Generator().manual_seed(seed)) * 0.1
    if kind == "bf16":
        return ExpertWeights("bf16", w.to(dtype), N, K)
    if kind == "int4":
        parts = [quantize_int4_group(w[e], 32) for e in range(E)]
        q, s = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
        return ExpertWeights("int4", q, N, K, s, group_size=32)
    parts = [quantize_fp8_block(w[e], block) for e in range(E)]
    q, s = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    return ExpertWeights("fp8", q, N, K, s, block=block)


def moe_weights(kind: str, E: int, d: int, inter: int, dtype=torch.float32):
    return tuple(
        experts(kind, E, n, k, seed, dtype) for seed, (n, k) in enumerate([(inter, d), (inter, d), (d, inter)])
    )


def routing(M: int, k: int, E_global: int, skew: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    if skew:  # most rows to expert 0; the last expert never chosen
        ids = torch.stack([torch.zeros(M, dtype=torch.int64), torch.randint(1, E_global - 1, (M,), generator=g)], 1)
        ids = ids[:, :k] if k <= 2 else torch.cat([ids, torch.randint(1, E_global - 1, (M, k - 2), generator=g)], 1)
    else:
        ids = torch.stack([torch.randperm(E_global, generator=g)[:k] for _ in range(M)])
    return torch.rand(M, k, generator=g) + 0.1, ids


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", ["bf16", "int4", "fp8"])
@pytest.mark.parametrize("skew", [False, True], ids=["spread", "skewed"])
@pytest.mark.parametrize("M", [1, 17, 136])
def test_grouped_equals_the_reference_loop(method, kind, skew, M):
    d, inter, E, k = 96, 64, 8, 3  # 96 fp32 = 384 B rows: _grouped_mm runs (no bmm fallback)
    gate, up, down = moe_weights(kind, E, d, inter)
    w, ids = routing(M, k, E, skew, seed=M)
    x = torch.randn(M, d, generator=torch.Generator().manual_seed(7))
    got = grouped_moe(x, gate, up, down, w, ids, method=method)
    assert_close(f"{kind} {method}", got, fused_moe_reference(x, gate, up, down, w, ids))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", ["bf16", "int4", "fp8"])
def test_expert_parallel_map_and_empty_experts(method, kind):
    """Rank 1 of 2 holds global experts 4..7; rows routed only elsewhere give zeros; no row at all too."""
    d, inter, E_global, M = 96, 64, 8, 40
    gate, up, down = moe_weights(kind, 4, d, inter)
    expert_map = torch.full((E_global,), -1, dtype=torch.int32)
    expert_map[4:] = torch.arange(4, dtype=torch.int32)
    w, ids = routing(M, 2, E_global, skew=True, seed=3)  # expert 0 (another rank's) on every row
    ids[:5] = torch.tensor([1, 2])  # rows with no local expert
    x = torch.randn(M, d)
    got = grouped_moe(x, gate, up, down, w, ids, expert_map, method=method)
    assert_close(f"{kind} ep", got, fused_moe_reference(x, gate, up, down, w, ids, expert_map))
    assert torch.equal(got[:5], torch.zeros(5, d))
    local_only = torch.full_like(ids, 1)  # nobody routed here
    assert torch.equal(grouped_moe(x, gate, up, down, w, local_only, expert_map, method=method), torch.zeros(M, d))
    assert grouped_moe(x[:0], gate, up, down, w[:0], ids[:0], expert_map, method=method).shape == (0, d)


@pytest.mark.parametrize("kind", ["int4", "fp8"])
def test_quantized_experts_dequantized_in_blocks(kind, monkeypatch):
    """DEQUANT_ELEMENTS bounds the dequantized weights at once: many blocks give the same result."""
    d, inter, E = 96, 64, 8
    gate, up, down = moe_weights(kind, E, d, inter)
    w, ids = routing(50, 2, E, skew=False, seed=5)
    x = torch.randn(50, d)
    whole = grouped_moe(x, gate, up, down, w, ids)
    monkeypatch.setattr(moe_grouped, "DEQUANT_ELEMENTS", 2 * d * inter)  # two experts per block
    assert torch.equal(grouped_moe(x, gate, up, down, w, ids), whole)


def test_bf16_model_dtype_and_unaligned_widths():
    """bf16 weights and activations (and widths whose bf16 rows are not 16-byte multiples: the padded bmm)."""
    # Seeded: the inputs came from whatever RNG state earlier tests left, and about 1 draw in 400 put one
    # element of 2880 past the bf16 tolerance (an output near cancellation, where rounding h to bf16 moves it).
    torch.manual_seed(0)
    for d, inter in ((96, 64), (44, 20)):
        gate, up, down = moe_weights("bf16", 8, d, inter, torch.bfloat16)
        w, ids = routing(30, 2, 8, skew=False, seed=1)
        x = torch.randn(30, d).bfloat16()
        got = grouped_moe(x, gate, up, down, w, ids)
        assert got.dtype == torch.bfloat16
        # bf16 matmuls round h = silu(gate)·up to bf16 (as nn.Linear did); the reference stays fp32 throughout
        assert_close(f"bf16 d={d}", got, fused_moe_reference(x, gate, up, down, w, ids), cos_tol=1e-4)


@pytest.mark.parametrize("method", METHODS)
def test_gradients_equal_autograd_through_the_loop(method):
    """Training runs this path: d(loss)/d(x, routing weights, every expert's weights) as through the loop."""
    d, inter, E, M = 96, 64, 6, 33
    base = [t.weight for t in moe_weights("bf16", E, d, inter)]
    w, ids = routing(M, 2, E, skew=True, seed=2)
    x0 = torch.randn(M, d)
    g_out = torch.randn(M, d)

    def run(fn):
        ws = [b.clone().requires_grad_() for b in base]
        x, rw = x0.clone().requires_grad_(), w.clone().requires_grad_()
        (fn(x, ws, rw) * g_out).sum().backward()
        return [x.grad, rw.grad, *(t.grad for t in ws)]

    def grouped(x, ws, rw):
        gate, up, down = (ExpertWeights("bf16", t, t.shape[1], t.shape[2]) for t in ws)
        return grouped_moe(x, gate, up, down, rw, ids, method=method)

    def loop(x, ws, rw):
        out = torch.zeros(M, d)
        for e in range(E):
            rows, slots = (ids == e).nonzero(as_tuple=True)
            h = F.silu(x[rows] @ ws[0][e].T) * (x[rows] @ ws[1][e].T)
            out = out.index_add(0, rows, (h @ ws[2][e].T) * rw[rows, slots, None])
        return out

    for name, a, b in zip(["x", "routing", "gate", "up", "down"], run(grouped), run(loop), strict=True):
        assert_close(f"grad {name}", a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linears_equal_f_linear_on_the_dequantized_weight(dtype, bias, monkeypatch):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(70, 100, generator=g), torch.randn(70, generator=g)
    x = torch.randn(9, 100, generator=g).to(dtype)
    q4, s4, shape = quantize_int4_group(w, 32)
    int4 = Int4Linear(100, 70, 32, bias=bias)
    q8, s8 = quantize_fp8_block(w, (16, 32))
    fp8 = Fp8Linear(100, 70, (16, 32), bias=bias)
    with torch.no_grad():
        int4.weight_packed.copy_(q4), int4.weight_scale.copy_(s4)
        fp8.weight.copy_(q8), fp8.weight_scale_inv.copy_(s8)
        for m in (int4, fp8):
            if bias:
                m.bias.copy_(b)
    assert int4.weight_shape.tolist() == shape.tolist() == [70, 100]
    for m in (int4, fp8):
        m.to(dtype)  # the bias only: packed buffers keep their dtypes
        assert (int4.weight_scale.dtype, fp8.weight.dtype, fp8.weight_scale_inv.dtype) == (
            torch.bfloat16, torch.float8_e4m3fn, torch.float32)  # fmt: skip
        dense = m.dequantized()
        want = F.linear(x, dense.to(dtype), m.bias.to(dtype) if bias else None)
        assert torch.equal(m(x), want)
        monkeypatch.setattr(packed_linear, "CHUNK_ELEMENTS", 16 * 100)  # 16 output rows at a time
        assert_close("chunked", m(x), want)
        monkeypatch.undo()
    assert {n for n, _ in int4.named_buffers()} == {"weight_packed", "weight_scale", "weight_shape"}
    assert {n for n, _ in fp8.named_buffers()} == {"weight", "weight_scale_inv"}


def test_stacked_experts_state_dict_is_per_expert():
    """Names `{g}.{proj}.weight` with global ids g, views of the stacked tensor; load_state_dict inverts it."""
    ex = StackedExperts(12, 8, num_experts=6, expert_range=(2, 5))
    with torch.no_grad():
        for p in ex.projections():
            p.weight.normal_()
    sd = ex.state_dict()
    assert list(sd) == [f"{g}.{p}.weight" for g in (2, 3, 4) for p in ("gate_proj", "up_proj", "down_proj")]
    assert sd["3.down_proj.weight"].shape == (12, 8)
    assert sd["3.down_proj.weight"].data_ptr() == ex.down_proj.weight[1].data_ptr()  # a view: loaded in place
    assert ex.expert_map.tolist() == [-1, -1, 0, 1, 2, -1]
    other = StackedExperts(12, 8, num_experts=6, expert_range=(2, 5))
    other.load_state_dict({k: v.clone() for k, v in sd.items()})
    for a, b in zip(ex.projections(), other.projections(), strict=True):
        assert torch.equal(a.weight, b.weight)
    assert [n for n, _ in ex.named_parameters()] == ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]

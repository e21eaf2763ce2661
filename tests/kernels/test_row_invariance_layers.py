"""Row invariance of the device path's per-row kernels, interpreted on the CPU: each row computed inside a launch
of M rows (M = 9, 17, 40: a tree, a tree beside other sequences) equals, bit for bit, the same row computed
alone (M = 1, an AR decode). Dense INT4 and FP8 GEMMs, the fused MoE (bf16 / INT4 / FP8 experts: the other
rows share the row's experts, so every expert's row count changes), the router, add + RMSNorm, the queries'
RoPE and SiLU-and-mul. The weights are the Kimi K2 / DeepSeek-V3 formats at small widths."""

from __future__ import annotations

import pytest
import torch

from ddtree.kernels.activation import silu_mul
from ddtree.kernels.gemm.fp8 import fp8_block_gemm
from ddtree.kernels.gemm.int4 import int4_gemm
from ddtree.kernels.moe.fused import fused_moe
from ddtree.kernels.moe.router import route
from ddtree.kernels.moe.weights import ExpertWeights
from ddtree.kernels.quant_formats import quantize_fp8_block, quantize_int4_group
from ddtree.kernels.rmsnorm import add_rms_norm, rms_norm
from ddtree.kernels.rope import rope_q
from tests.support.triton_env import DEVICE, triton_interpret_env  # noqa: F401,I001  (before kernels are imported)

SIZES = (9, 17, 40)
PROBE = (0, 5, 8)  # rows compared with their solo twin (the first, a middle one, the last of the smallest M)


def _differing(fn, inputs: list[torch.Tensor]) -> list[tuple[int, int]]:
    """(M, row) pairs where fn over the first M rows differs from fn over that row alone; `fn` takes row-major
    tensors and returns a tensor or a tuple of them."""

    def run(rows):
        out = fn(*[t[rows].to(DEVICE) for t in inputs])
        return [o.cpu() for o in (out if isinstance(out, tuple) else (out,))]

    solo = {r: run(slice(r, r + 1)) for r in PROBE}
    bad = []
    for M in SIZES:
        many = run(slice(0, M))
        bad += [(M, r) for r in PROBE if not all(torch.equal(a[r : r + 1], b) for a, b in zip(many, solo[r]))]
    return bad


def _x(d: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    return (torch.randn(max(SIZES), d, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_gemm_rows(dtype):
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(1)) / 16
    packed, scale, _ = quantize_int4_group(w, 32)
    packed, scale = packed.to(DEVICE), scale.to(dtype).to(DEVICE)
    assert _differing(lambda x: int4_gemm(x, packed, scale, 32), [_x(256, dtype)]) == []


def test_fp8_gemm_rows():
    q, s = quantize_fp8_block(torch.randn(96, 256, generator=torch.Generator().manual_seed(2)) / 16, (32, 64))
    q, s = q.to(DEVICE), s.to(DEVICE)
    assert _differing(lambda x: fp8_block_gemm(x, q, s, (32, 64)), [_x(256)]) == []


def _experts(kind: str, E: int, N: int, K: int, seed: int) -> ExpertWeights:
    w = torch.randn(E, N, K, generator=torch.Generator().manual_seed(seed)) / K**0.5
    if kind == "bf16":
        return ExpertWeights("bf16", w.to(torch.bfloat16).to(DEVICE), N, K)
    if kind == "int4":
        p = [quantize_int4_group(w[e], 32)[:2] for e in range(E)]
        return ExpertWeights("int4", torch.stack([a for a, _ in p]).to(DEVICE), N, K,
                             torch.stack([b for _, b in p]).to(DEVICE), group_size=32)  # fmt: skip
    p = [quantize_fp8_block(w[e], (32, 32)) for e in range(E)]
    return ExpertWeights("fp8", torch.stack([a for a, _ in p]).to(DEVICE), N, K, torch.stack([b for _, b in p]).to(DEVICE),
                         block=(32, 32))  # fmt: skip


@pytest.mark.parametrize("kind", ["bf16", "int4", "fp8"])
def test_fused_moe_rows(kind):
    """Every row routes to experts 0..3 (top 2 of 4, a skewed routing): each expert's block holds up to 40 rows."""
    E, d, inter = 4, 64, 32
    gate, up, down = (_experts(kind, E, n, k, s) for s, (n, k) in enumerate([(inter, d), (inter, d), (d, inter)]))
    gen = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(max(SIZES))])
    weights = torch.rand(max(SIZES), 2, generator=gen) + 0.1
    bad = _differing(lambda x, w, i: fused_moe(x, gate, up, down, w, i), [_x(d), weights, ids])
    assert bad == [], f"{kind} experts: rows differ from their solo twin at (M, row) {bad}"


def test_router_rows():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    bias = torch.randn(64, generator=torch.Generator().manual_seed(5)).to(DEVICE) * 0.01
    fn = lambda x: route(x, w, bias, 6, n_group=8, topk_group=4, renormalize=True, scaling=2.5)  # noqa: E731
    assert _differing(fn, [_x(128)]) == []


def test_norms_rope_activation_rows():
    d = 256
    weight = torch.rand(d, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).to(DEVICE) + 0.5
    assert _differing(lambda x: rms_norm(x, weight, 1e-6), [_x(d)]) == []
    assert _differing(lambda x, r: add_rms_norm(x, r, weight, 1e-6), [_x(d), _x(d, seed=7)]) == []
    assert _differing(silu_mul, [_x(d), _x(d, seed=8)]) == []
    q = _x(4 * 64).view(-1, 4, 64)
    angles = torch.rand(max(SIZES), 32, generator=torch.Generator().manual_seed(9)) * 6
    assert _differing(rope_q, [q, angles.cos(), angles.sin()]) == []

"""The packed modules' CUDA calls into the Triton kernels (int4_gemm, fp8_block_gemm, fused_moe), run under
the interpreter on a CPU: the arguments the modules pass fit the kernels, and the results match the torch
path the modules take without them (FP8 quantizes its activations in the kernels: looser tolerance)."""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_env import INTERPRET, triton_interpret_env  # noqa: F401,I001  (before kernels are imported)

# tests/support/triton_env.py imported the kernel modules with the interpreter set; these are those modules.
fp8_gemm = pytest.importorskip("ddtree.kernels.gemm.fp8")
int4_gemm = pytest.importorskip("ddtree.kernels.gemm.int4")
fused_moe = pytest.importorskip("ddtree.kernels.moe.fused")

from ddtree.kernels.quant_formats import quantize_fp8_block, quantize_int4_group  # noqa: E402
from ddtree.models.deepseek_v3.moe_experts import StackedExperts, StackedProjection  # noqa: E402
from ddtree.models.layers.packed_linear import Fp8Linear, Int4Linear, cuda_kernel  # noqa: E402
from ddtree.tools.selftest.compare import assert_close  # noqa: E402

pytestmark = pytest.mark.skipif(not INTERPRET, reason="on a GPU the modules call the kernels themselves")
FP8_TOL = dict(abs_tol=0.15, rel_tol=0.1, cos_tol=2e-3)  # W8A8: x is quantized to e4m3 (3 mantissa bits) too


def _weights(N: int, K: int, seed: int) -> torch.Tensor:
    return torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.1


@pytest.mark.parametrize("cls", [Int4Linear, Fp8Linear])
def test_packed_linear_kernel_gemm(cls):
    N, K = 40, 96
    w = _weights(N, K, 0)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1))
    if cls is Int4Linear:
        m = Int4Linear(K, N, 32)
        packed, scale, _ = quantize_int4_group(w, 32)
        m.weight_packed.copy_(packed), m.weight_scale.copy_(scale)
    else:
        m = Fp8Linear(K, N, (16, 32))
        q, s = quantize_fp8_block(w, (16, 32))
        m.weight.copy_(q), m.weight_scale_inv.copy_(s)
    got = m.kernel_gemm(x)
    assert got is not None and got.shape == (5, N) and got.dtype == x.dtype
    assert_close(cls.__name__, got, m(x), **({} if cls is Int4Linear else FP8_TOL))


@pytest.mark.parametrize("kind", ["bf16", "int4", "fp8"])
def test_stacked_experts_fused(kind):
    """An expert-parallel shard (experts 2..5 of 8) through fused_moe == through the grouped torch path."""
    d, inter, M = 64, 32, 9
    ex = StackedExperts(d, inter, num_experts=8, expert_range=(2, 6))
    for name, proj in zip(("gate_proj", "up_proj", "down_proj"), ex.projections(), strict=True):
        ws = [_weights(proj.out_features, proj.in_features, 10 * i + len(name)) for i in range(4)]
        if kind == "bf16":
            with torch.no_grad():
                proj.weight.copy_(torch.stack(ws))
            continue
        block = (16, 32)
        new = StackedProjection(4, proj.out_features, proj.in_features, kind, 32, block)
        parts = [quantize_int4_group(w, 32)[:2] if kind == "int4" else quantize_fp8_block(w, block) for w in ws]
        leaves = ("weight_packed", "weight_scale") if kind == "int4" else ("weight", "weight_scale_inv")
        for leaf, t in zip(leaves, zip(*parts, strict=True), strict=True):
            getattr(new, leaf).copy_(torch.stack(t))
        ex.set_projection(name, new)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(M, d, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(M)])
    w = torch.rand(M, 2, generator=g)
    assert cuda_kernel("fused_moe") is fused_moe.fused_moe
    with torch.no_grad():
        got, want = ex.fused(x, w, ids), ex(x, w, ids)  # on the CPU forward takes the grouped path
    assert_close(f"fused {kind}", got, want, **(FP8_TOL if kind == "fp8" else {}))

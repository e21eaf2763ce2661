"""RMSNorm and fused add + RMSNorm (kernels/rmsnorm.py) against their references and the model's torch path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ddtree.kernels.layer_reference import add_rms_norm_ref, rms_norm_ref
from ddtree.kernels.rmsnorm import add_rms_norm, rms_norm
from ddtree.models.layers.norm import RMSNorm
from ddtree.tools.selftest.compare import assert_close
from tests.support.triton_env import DEVICE, triton_interpret_env  # noqa: F401,I001  (before kernels are imported)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    rows: int
    hidden: int
    dtype: torch.dtype = torch.float32
    weight_dtype: torch.dtype | None = None  # None: x's dtype

    def __str__(self) -> str:
        return self.name


CASES = [
    Case("one_row_fp32", 1, 64),
    Case("tree17_bf16", 17, 96, torch.bfloat16),
    Case("odd_hidden_fp32", 5, 100),
    Case("odd_hidden_bf16", 9, 37, torch.bfloat16),
    Case("fp16", 7, 48, torch.float16),
    Case("bf16_x_fp32_weight", 6, 80, torch.bfloat16, torch.float32),
    Case("wide_bf16", 3, 1000, torch.bfloat16),
]


def _inputs(case: Case, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(case.rows, case.hidden, generator=g) * 3).to(case.dtype)
    res = (torch.randn(case.rows, case.hidden, generator=g) * 5).to(case.dtype)
    w = (1 + 0.3 * torch.randn(case.hidden, generator=g)).to(case.weight_dtype or case.dtype)
    return [t.to(DEVICE) for t in (x, res, w)]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_rms_norm_matches_reference(case):
    x, _, w = _inputs(case)
    got = rms_norm(x, w, 1e-6)
    expected = rms_norm_ref(x, w, 1e-6)
    assert got.dtype == expected.dtype
    assert_close(case.name, got, expected)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_add_rms_norm_matches_reference(case):
    x, res, w = _inputs(case, seed=1)
    normed, new_res = add_rms_norm(x, res, w, 1e-5)
    ref_normed, ref_res = add_rms_norm_ref(x, res, w, 1e-5)
    assert torch.equal(new_res.cpu(), ref_res.cpu()), "the residual sum is one rounding of x + residual"
    assert_close(case.name, normed, ref_normed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_matches_the_model_norm(dtype):
    norm = RMSNorm(72, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.mul_(torch.linspace(0.5, 1.5, 72).to(dtype))
    x = torch.randn(11, 72).to(dtype)
    with torch.no_grad():
        expected = norm(x)
    assert_close(f"model norm {dtype}", rms_norm(x.to(DEVICE), norm.weight.detach().to(DEVICE), norm.eps), expected)


def test_three_dims_and_empty():
    x = torch.randn(2, 3, 40).to(DEVICE)
    w = torch.ones(40).to(DEVICE)
    assert_close("3-D", rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    normed, res = add_rms_norm(x[:0], x[:0], w, 1e-6)
    assert normed.shape == res.shape == (0, 3, 40)


def test_rms_norm_rejects_bad_inputs():
    x, res, w = _inputs(Case("err", 4, 32))
    with pytest.raises(ValueError, match="end in the weight's size"):
        rms_norm(x, w[:-1], 1e-6)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, res.to(torch.float16), w, 1e-6)
    with pytest.raises(ValueError, match="dtypes"):
        rms_norm(x.double(), w, 1e-6)

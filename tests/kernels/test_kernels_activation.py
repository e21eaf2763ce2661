"""SiLU-and-mul (kernels/activation.py) against its reference, on whole gate_up rows and on two views."""

from __future__ import annotations

import pytest
import torch

from ddtree.kernels.activation import silu_and_mul, silu_mul
from ddtree.kernels.layer_reference import silu_and_mul_ref
from ddtree.tools.selftest.compare import assert_close
from tests.support.triton_env import DEVICE, triton_interpret_env  # noqa: F401,I001  (before kernels are imported)

CASES = [(1, 16), (17, 44), (5, 100), (3, 1500), (0, 8)]  # (rows, I): ragged rows, odd widths, > one block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("rows", "inter"), CASES)
def test_silu_and_mul_matches_reference(rows, inter, dtype):
    g = torch.Generator().manual_seed(rows * 1000 + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype).to(DEVICE)
    got = silu_and_mul(gate_up)
    assert got.dtype == dtype and got.shape == (rows, inter)
    assert_close(f"{rows}x{inter} {dtype}", got, silu_and_mul_ref(gate_up))


def test_silu_mul_on_separate_strided_inputs():
    g = torch.Generator().manual_seed(3)
    gate = torch.randn(6, 80, generator=g).to(DEVICE)[:, ::2]  # not contiguous in the last dim: copied
    up = torch.randn(6, 60, generator=g).to(DEVICE)[:, 10:50]  # a strided row view
    assert_close("views", silu_mul(gate, up), torch.nn.functional.silu(gate) * up)


def test_silu_and_mul_rejects_bad_inputs():
    with pytest.raises(ValueError, match=r"\[N, 2I\]"):
        silu_and_mul(torch.zeros(3, 5))
    with pytest.raises(ValueError, match="one \\[N, I\\] shape"):
        silu_mul(torch.zeros(3, 4), torch.zeros(3, 5))
    with pytest.raises(ValueError, match="dtypes"):
        silu_mul(torch.zeros(3, 4), torch.zeros(3, 4, dtype=torch.float16))

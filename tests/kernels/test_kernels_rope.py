"""The queries' rotary embedding (kernels/rope.py) against its reference, PositionRope (models/layers/rope.py), on
q_pe as the model makes it (the rope columns of q, a strided view), ragged heads and widths, every dtype.
Inside the model it runs with the other layer kernels: tests/kernels/test_kernels_layer_model.py."""

from __future__ import annotations

import pytest
import torch

from ddtree.kernels.rope import rope_q
from ddtree.models.layers.rope import PositionRope, RotaryEmbedding
from ddtree.tools.selftest.compare import assert_close
from tests.support.triton_env import DEVICE, triton_interpret_env  # noqa: F401,I001  (before kernels are imported)

CASES = [(1, 1, 64), (17, 8, 64), (5, 3, 32), (40, 16, 64), (0, 4, 64)]  # (T, H, dr)


def _rope(dr: int):
    from ddtree.models.checkpoint.random import DEFAULT_TARGET_CONFIG
    from ddtree.models.deepseek_v3.config import DeepseekV3Config

    config = DeepseekV3Config.from_dict({**DEFAULT_TARGET_CONFIG, "qk_rope_head_dim": dr})
    return RotaryEmbedding(config.rope, dr)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("T", "H", "dr"), CASES)
def test_rope_q_matches_position_rope(T, H, dr, dtype):
    g = torch.Generator().manual_seed(T * 100 + H + dr)
    q = (torch.randn(T, H, 32 + dr, generator=g) * 3).to(dtype).to(DEVICE)
    q_pe = q[..., 32:]  # the rope columns of q: a strided view, as project_q splits it
    positions = torch.randint(0, 30000, (T,), generator=g).to(DEVICE)
    rope = PositionRope(_rope(dr).to(DEVICE), positions)
    got = rope_q(q_pe, rope.cos, rope.sin)
    want = rope(q_pe, positions)
    assert got.dtype == dtype and got.shape == (T, H, dr) and got.is_contiguous()
    assert_close(f"{T}x{H}x{dr} {dtype}", got, want)


def test_rope_q_rejects_bad_inputs():
    x = torch.zeros(3, 2, 8)
    with pytest.raises(ValueError, match=r"\[T, H, dr\]"):
        rope_q(x, torch.zeros(3, 3), torch.zeros(3, 3))
    with pytest.raises(ValueError, match="fp32"):
        rope_q(x, torch.zeros(3, 4, dtype=torch.float16), torch.zeros(3, 4, dtype=torch.float16))

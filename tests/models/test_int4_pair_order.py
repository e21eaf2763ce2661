"""The device path keeps INT4 routed experts' words in pair order (kernels/quant_formats.pair_int4_words), set
by the same switch that routes a model's linears to the Triton kernels (layers/device_linear.route_linears):
rewritten in place, in their own storage, and back to the checkpoint's order when the path is switched off;
the torch path reads either order as the same weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddtree.kernels.quant_formats import pair_int4_words, quantize_int4_group
from ddtree.models.deepseek_v3 import moe_experts
from ddtree.models.deepseek_v3.moe_experts import StackedProjection
from ddtree.models.layers.device_linear import route_linears

E, N, K, GROUP = 3, 8, 64, 32


def _int4_projection() -> tuple[nn.Module, torch.Tensor]:
    proj = StackedProjection(E, N, K, kind="int4", group_size=GROUP)
    g = torch.Generator().manual_seed(0)
    for e in range(E):
        words, scale, _ = quantize_int4_group(torch.randn(N, K, generator=g), GROUP)
        proj.weight_packed[e].copy_(words)
        proj.weight_scale[e].copy_(scale)
    return nn.ModuleDict({"experts": proj}), proj.weight_packed.clone()


@pytest.mark.parametrize("chunk_words", [N * K // 8, 2 * N * K // 8 + 1, 1 << 22], ids=["1", "2", "all"])
def test_the_device_path_pairs_the_words_in_place_and_switching_it_off_restores_them(chunk_words, monkeypatch):
    monkeypatch.setattr(moe_experts, "PAIR_CHUNK_WORDS", chunk_words)  # experts rewritten at a time: 1, 2, all
    model, stored = _int4_projection()
    proj = model["experts"]
    dense = torch.stack([proj.expert_weights().dequantize(e) for e in range(E)])
    storage = proj.weight_packed.data_ptr()
    route_linears(model, True)
    assert proj.paired and proj.expert_weights().paired
    assert torch.equal(proj.weight_packed, pair_int4_words(stored)) and proj.weight_packed.data_ptr() == storage
    assert torch.equal(torch.stack([proj.expert_weights().dequantize(e) for e in range(E)]), dense)
    route_linears(model, True)  # a second switch to the same path changes nothing
    assert torch.equal(proj.weight_packed, pair_int4_words(stored))
    route_linears(model, False)
    assert not proj.paired and torch.equal(proj.weight_packed, stored)
    assert torch.equal(model.state_dict()["experts.weight_packed"], stored)


def test_other_kinds_have_no_pair_order():
    proj = StackedProjection(E, N, K, kind="bf16")
    route_linears(nn.ModuleDict({"experts": proj}), True)
    assert not proj.paired and not proj.expert_weights().paired

"""The weight-format registry (kernels/weight_formats.py, models/quantization/formats.py): each format's
methods against the arithmetic they wrap and against the tensors they describe."""

from __future__ import annotations

import pytest
import torch

from ddtree.kernels.moe.weights import ExpertWeights
from ddtree.kernels.quant_formats import dequantize_fp8_block, dequantize_int4, quantize_fp8_block, quantize_int4_group
from ddtree.kernels.weight_formats import BY_QUANT_METHOD, FORMATS, weight_format
from ddtree.models.quantization import parse_quantization
from ddtree.models.quantization.formats import CHECKPOINT_FORMATS

GROUP, BLOCK = 16, (32, 32)
E, N, K = 3, 40, 72  # ragged against both the group and the block


@pytest.mark.parametrize("name", list(FORMATS))
def test_quantize_and_dequantize_match_the_arithmetic_per_expert(name):
    fmt = weight_format(name)
    w = torch.randn(E, N, K, generator=torch.Generator().manual_seed(0))
    q, s = fmt.quantize(w, GROUP, BLOCK)
    ew = ExpertWeights(name, q, N, K, s, GROUP if fmt.grouped else 0, BLOCK)  # validates the stacked layout
    for e in range(E):
        if not fmt.packed:
            ref = w[e]
        elif fmt.grouped:
            pe, se, _ = quantize_int4_group(w[e], GROUP)
            assert torch.equal(q[e], pe) and torch.equal(s[e], se)
            ref = dequantize_int4(pe, se, GROUP, K)
        else:
            qe, se = quantize_fp8_block(w[e], BLOCK)
            assert torch.equal(q[e].view(torch.uint8), qe.view(torch.uint8)) and torch.equal(s[e], se)
            ref = dequantize_fp8_block(qe, se, BLOCK)
        assert torch.equal(ew.dequantize(e), ref.float())


@pytest.mark.parametrize("name", list(FORMATS))
def test_stored_bytes_and_leaves_are_the_tensors(name):
    """stored_bytes counts what `empty` allocates (the leaves, in order), scales and shape included."""
    fmt = weight_format(name)
    if not fmt.packed:
        assert fmt.stored_bytes(N, K, GROUP, BLOCK) == (2 * N * K, 0) and fmt.leaves == ("weight",)
        return
    leaves = fmt.empty(1, N, K, GROUP, BLOCK, torch.bfloat16)
    assert tuple(leaves) == fmt.leaves
    total, whole = fmt.stored_bytes(N, K, GROUP, BLOCK)
    assert total == sum(t.nbytes for t in leaves.values())
    assert whole == (leaves["weight_shape"].nbytes if fmt.stores_shape else 0)
    read = leaves[fmt.leaves[0]].nbytes + leaves[fmt.leaves[1]].nbytes  # K = 72 fills whole int32 words
    assert (
        fmt.read_bytes(N, K, GROUP, BLOCK) == read
        and fmt.scale_bytes(N, K, GROUP, BLOCK) == leaves[fmt.leaves[1]].nbytes
    )


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_table_key_names_the_parameters_it_needs(name):
    fmt = weight_format(name)
    group, block = fmt.params_of(fmt.params_key(GROUP, BLOCK))
    assert group == (GROUP if fmt.grouped else 0) and block == (BLOCK if fmt.block_scaled else (0, 0))


def test_every_checkpoint_name_parses_to_its_format():
    assert set(CHECKPOINT_FORMATS) == set(BY_QUANT_METHOD)
    configs = {
        "fp8": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
        "compressed-tensors": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
            "g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                     "strategy": "group", "group_size": 32}}}},
    }  # fmt: skip
    for method, fmt in BY_QUANT_METHOD.items():
        scheme = parse_quantization(configs[method], "config.json")
        assert scheme.weight_format is fmt and scheme.name == method


def test_an_unknown_name_is_a_clear_error():
    with pytest.raises(ValueError, match="weight format must be one of bf16, int4, fp8"):
        weight_format("nf4")

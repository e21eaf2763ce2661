"""Linears merged into one GEMM (merged_linear.py): the MLP's gate + up and MLA's q_a + kv_a. The state dict
keeps the checkpoint's names (views of the merged weight), plain and quantized checkpoints load into the
merged modules where their blocks allow it (FP8: whole row blocks per part; INT4: always) and into two
GEMMs where they do not, and the logits equal the dequantized model's."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ddtree.models.checkpoint.loader import load_target
from ddtree.models.checkpoint.random import write_random_target
from ddtree.models.deepseek_v3.model import DeepseekV3ForCausalLM
from ddtree.models.deepseek_v3.moe import DeepseekV3MLP
from ddtree.models.layers.merged_linear import unmerge_all
from ddtree.models.layers.packed_linear import Fp8Linear, Int4Linear
from ddtree.models.quantization import quantize_int4_group
from ddtree.tools.selftest.compare import assert_close
from tests.support.quantized_checkpoints import INT4_GROUP, TINY, int4_config, logits, write_variant

IDS = [5, 17, 3, 99, 250, 7, 42, 1, 300, 11]


def test_mlp_names_are_views_of_one_weight():
    mlp = DeepseekV3MLP(8, 6)
    sd = mlp.state_dict()
    assert list(sd) == ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    fused = mlp.gate_up_proj.weight
    assert sd["gate_proj.weight"].data_ptr() == fused.data_ptr() and sd["gate_proj.weight"].shape == (6, 8)
    assert sd["up_proj.weight"].data_ptr() == fused[6:].data_ptr()
    g = torch.Generator().manual_seed(0)
    new = {k: torch.randn(v.shape, generator=g) for k, v in sd.items()}
    mlp.load_state_dict(new)
    assert all(torch.equal(mlp.state_dict()[k], v) for k, v in new.items())
    x = torch.randn(5, 8, generator=g)
    with torch.no_grad():
        expected = F.linear(F.silu(F.linear(x, new["gate_proj.weight"])) * F.linear(x, new["up_proj.weight"]),
                            new["down_proj.weight"])  # fmt: skip
        assert_close("merged MLP", mlp(x), expected)
    with pytest.raises(RuntimeError, match="gate_up_proj.weight"):
        mlp.load_state_dict({k: v for k, v in new.items() if k != "up_proj.weight"})


def test_unmerge_all_keeps_the_names(tmp_path):
    root = write_random_target(tmp_path / "ckpt", TINY)
    merged = load_target(root)
    split = load_target(root, build_model=lambda c: unmerge_all(DeepseekV3ForCausalLM(c)))
    assert not hasattr(split.model.layers[0].mlp, "gate_up_proj")
    assert split.model.layers[0].self_attn.q_a_proj.out_features == TINY["q_lora_rank"]
    a, b = merged.state_dict(), split.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert_close("merged vs split logits", logits(merged, IDS), logits(split, IDS))


def test_fp8_merges_where_the_blocks_allow(tmp_path):
    """Blocks of 8 rows: q_a (40) + kv_a and the dense gate + up (200) merge; the shared expert's 44 rows do not."""
    root, _ = write_variant(tmp_path / "fp8", "fp8", fp8_block=(8, 32))
    model = load_target(root)
    attn, dense, shared = model.model.layers[0].self_attn, model.model.layers[0].mlp, model.model.layers[1].mlp
    assert isinstance(attn.fused_qkv_a_proj_with_mqa, Fp8Linear) and attn.fused_qkv_a_proj_with_mqa.out_features == 80
    assert isinstance(dense.gate_up_proj, Fp8Linear) and dense.gate_up_proj.out_features == 400
    assert not hasattr(shared.shared_experts, "gate_up_proj")
    assert isinstance(shared.shared_experts.gate_proj, Fp8Linear) and shared.shared_experts.gate_proj.out_features == 44
    stored = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"] if (
        root / "model.safetensors.index.json").exists() else load_file(root / "model.safetensors")  # fmt: skip
    assert sorted(model.state_dict()) == sorted(stored)
    ref = load_target(root, dequantize=True)
    assert_close("fp8 merged vs dequantized", logits(model, IDS), logits(ref, IDS))


def test_int4_merges_every_projection_pair(tmp_path):
    """Every projection INT4 (not Kimi's layout, where attention and shared experts stay bf16): rows of
    INT4 groups are independent, so q_a + kv_a and every gate + up merge; weight_shape is each part's own."""
    src = write_random_target(tmp_path / "src", TINY)
    config = json.loads((src / "config.json").read_text())
    out = {}
    for name, w in load_file(src / "model.safetensors").items():
        stem = name.removesuffix(".weight")
        if stem.endswith(("_proj", "kv_a_proj_with_mqa")):
            out[stem + ".weight_packed"], out[stem + ".weight_scale"], out[stem + ".weight_shape"] = (
                quantize_int4_group(w, INT4_GROUP)
            )
        else:
            out[name] = w
    config["quantization_config"] = {**int4_config(), "ignore": ["re:.*lm_head.*"]}
    root = tmp_path / "int4"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config))
    save_file(out, str(root / "model.safetensors"))
    model = load_target(root)
    attn, shared = model.model.layers[1].self_attn, model.model.layers[1].mlp.shared_experts
    assert isinstance(attn.fused_qkv_a_proj_with_mqa, Int4Linear) and isinstance(shared.gate_up_proj, Int4Linear)
    sd = model.state_dict()
    assert sorted(sd) == sorted(out)
    assert sd["model.layers.1.self_attn.q_a_proj.weight_shape"].tolist() == [40, 96]
    assert torch.equal(sd["model.layers.1.mlp.shared_experts.up_proj.weight_packed"],
                       out["model.layers.1.mlp.shared_experts.up_proj.weight_packed"])  # fmt: skip
    ref = load_target(root, dequantize=True)
    assert_close("int4 merged vs dequantized", logits(model, IDS), logits(ref, IDS))

"""`ddtree inspect`: exact parameter counts (whole and per TP rank), dtype mix, KV bytes and max context."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from ddtree.cli import main
from ddtree.models.checkpoint.loader import TensorSlice
from ddtree.models.checkpoint.weight_bytes import config_tensors
from ddtree.models.deepseek_v3.config import DeepseekV3Config
from ddtree.models.deepseek_v3.model import DeepseekV3ForCausalLM
from ddtree.tools.inspect import (
    active_parameters,
    count_parameters,
    format_report,
    inspect_checkpoint,
)  # fmt: skip
from tests.support.paths import REPO
from tests.support.quantized_checkpoints import TINY, shrink_to_slices, write_variant

CONFIGS = {
    "moe": TINY,
    "dense": {**TINY, "first_k_dense_replace": 3},
    "allmoe_qproj_bias": {**TINY, "first_k_dense_replace": 0, "q_lora_rank": None, "attention_bias": True},
    "two_shared": {**TINY, "n_shared_experts": 2, "first_k_dense_replace": 2},
}


def meta_model(cfg: DeepseekV3Config, build=DeepseekV3ForCausalLM):
    with torch.device("meta"):
        return build(cfg)


def numel(model) -> int:
    return sum(t.numel() for t in model.state_dict().values())


def tp_slice_of(c: DeepseekV3Config, tp: int, ep: bool):
    """Rank 0's part, written out independently of inspect.py (heads, widths, vocab; EP: whole experts)."""

    def first(size: int, unit: int = 1) -> TensorSlice:
        return TensorSlice(0, 0, math.ceil(size // unit / tp) * unit)

    def slice_of(name: str) -> TensorSlice | None:
        leaf = name.split(".")[-2]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return first(c.vocab_size)
        if leaf in ("q_proj", "q_b_proj") and name.endswith("weight"):
            return first(c.num_attention_heads * c.qk_head_dim, c.qk_head_dim)
        if leaf == "kv_b_proj":
            return first(c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), c.qk_nope_head_dim + c.v_head_dim)
        if leaf == "o_proj" and name.endswith("weight"):
            return TensorSlice(1, 0, math.ceil(c.num_attention_heads / tp) * c.v_head_dim)
        if ".experts." in name and ep:
            return None
        if leaf in ("gate_proj", "up_proj", "down_proj"):
            width = c.moe_intermediate_size if ".experts." in name else (
                c.moe_intermediate_size * c.n_shared_experts if "shared" in name else c.intermediate_size)  # fmt: skip
            sl = first(width)
            return TensorSlice(1, sl.start, sl.stop) if leaf == "down_proj" else sl
        return None

    return slice_of


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_counts_equal_the_built_model(name):
    c = DeepseekV3Config.from_dict(CONFIGS[name])
    model = meta_model(c)
    specs = config_tensors(c)
    assert {s.name: s.shape for s in specs} == {n: tuple(t.shape) for n, t in model.state_dict().items()}
    counts = count_parameters(c)
    assert sum(counts.values()) == numel(model) == sum(s.numel for s in specs)
    routed = sum(t.numel() for n, t in model.state_dict().items() if ".mlp.experts." in n)
    assert counts["routed_experts"] == routed
    per_expert = routed // max(1, (c.num_hidden_layers - c.first_k_dense_replace) * c.n_routed_experts)
    n_moe = c.num_hidden_layers - c.first_k_dense_replace
    assert active_parameters(c) == numel(model) - routed + n_moe * c.num_experts_per_tok * per_expert


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_per_rank_counts_equal_a_sliced_model(name, ep):
    c = DeepseekV3Config.from_dict(CONFIGS[name])
    slice_of = tp_slice_of(c, 2, ep)
    keep = math.ceil(c.n_routed_experts / 2)

    def build(config):
        model = shrink_to_slices(DeepseekV3ForCausalLM(config), slice_of)
        if ep:
            for layer in model.model.layers[config.first_k_dense_replace :]:
                layer.mlp.keep_experts(0, keep)  # experts [0, keep) whole (unsliced under EP)
        return model

    rank0 = numel(meta_model(c, build))
    assert sum(count_parameters(c, tp=2, ep=ep).values()) == rank0 < numel(meta_model(c))


def test_odd_tp_rounds_up_and_notes_it(tmp_path):
    root, _ = write_variant(tmp_path / "ckpt", "fp32")
    r = inspect_checkpoint(root, tp=3)
    assert any("num_attention_heads 4 is not divisible by --tp 3" in n for n in r.notes)
    assert r.params_per_rank == sum(count_parameters(r.config, tp=3).values())


@pytest.mark.parametrize("kind", ["fp32", "fp8", "int4"])
def test_headers_and_config_agree_on_bytes(tmp_path, kind):
    root, _ = write_variant(tmp_path / kind, kind, shards=2, kimi_k25=kind == "int4")
    from_headers = inspect_checkpoint(root, tp=2, device_memory_gb=0.01)
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(root / "config.json", config_only / "config.json")
    from_config = inspect_checkpoint(config_only / "config.json", tp=2, device_memory_gb=0.01)
    assert from_headers.dtype_source == "safetensors headers"
    assert from_config.dtype_source.startswith("quantization_config")
    files = sum(f.stat().st_size for f in root.glob("*.safetensors"))
    assert from_headers.weight_bytes < files  # the vision tensors and headers are not counted
    assert from_headers.weight_bytes == from_config.weight_bytes
    assert from_headers.weight_bytes_per_rank == from_config.weight_bytes_per_rank
    assert {m.params for m in from_headers.dtype_mix} == {m.params for m in from_config.dtype_mix}
    assert sum(m.params for m in from_headers.dtype_mix) == from_headers.total_params
    formats = {m.format.split("-")[0] for m in from_headers.dtype_mix}
    assert formats == {"fp32"} | ({"fp8"} if kind == "fp8" else {"int4"} if kind == "int4" else set())
    c = from_headers.config
    kv = c.kv_cache_width * c.num_hidden_layers * 2
    assert from_headers.kv_bytes_per_token == kv
    assert from_headers.max_context_tokens == max(0, int((0.01e9 * 0.9 - from_headers.weight_bytes_per_rank) // kv))


def test_kimi_k26_config_report(capsys):
    path = REPO / "docs" / "kimi_k26_config.json"
    raw = json.loads(path.read_text())
    assert raw["model_type"] == "kimi_k25" and raw["text_config"]["rope_scaling"]["factor"] == 64.0
    r = inspect_checkpoint(path, tp=8, device_memory_gb=96)
    assert r.kv_bytes_per_token == (512 + 64) * 61 * 2 == 70272
    assert 1.0e12 < r.total_params < 1.05e12 and 32e9 < r.active_params < 33e9  # "about 1T total, 32B active"
    routed = 60 * 384 * 3 * 7168 * 2048
    assert r.params["routed_experts"] == routed
    int4 = next(m for m in r.dtype_mix if m.format == "int4-g32")
    assert int4.params == routed  # only routed experts are INT4; attention, shared and dense MLP stay bf16
    assert int4.bytes == 60 * 384 * (2 * (2048 * 896 * 4 + 2048 * 224 * 2 + 8) + (7168 * 256 * 4 + 7168 * 64 * 2 + 8))
    free = 96e9 * 0.9 - r.weight_bytes_per_rank
    assert r.max_context_tokens == int(free // 70272) > 0
    assert main(["inspect", str(path), "--tp", "8", "--device-memory-gb", "96"]) == 0
    out = capsys.readouterr().out
    report, plan = out.split("memory plan", 1)  # the report, then (with --device-memory-gb) the plan per GPU
    assert report.strip() == format_report(r).strip() and "per GPU" in plan
    assert "70,272 B per token" in out and f"{r.max_context_tokens:,} tokens" in out
    assert main(["inspect", str(path), "--json", "--ep", "--tp", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["ep"] is True


def test_missing_checkpoint_is_one_clear_line(tmp_path):
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "ddtree.cli", "inspect", str(tmp_path)], capture_output=True, text=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"{tmp_path}: no checkpoint config here" in res.stderr and "config.json" in res.stderr

"""Broken checkpoints: each raises CheckpointError naming the file and the tensor."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ddtree.models.checkpoint.loader import CheckpointError, TensorSlice, load_config, load_target
from ddtree.models.deepseek_v3.model import DeepseekV3ForCausalLM
from tests.support.quantized_checkpoints import TINY, write_variant

Q_B = "model.layers.1.self_attn.q_b_proj.weight"
EXPERT = "model.layers.2.mlp.experts.3.down_proj"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpts")
    return {kind: write_variant(base / kind, kind)[0] for kind in ("fp32", "fp8", "int4")}


def edited(src: Path, dst: Path, edit=None, config_edit=None) -> Path:
    """A copy of a single-file checkpoint with its tensors / config edited."""
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    if config_edit:
        config_edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(src / "model.safetensors")
    if edit:
        edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def raises(path: Path, *parts: str, **kw):
    with pytest.raises(CheckpointError) as info:
        load_target(path, **kw)
    for part in parts:
        assert part in str(info.value), f"{part!r} not in: {info.value}"
    return info.value


def test_missing_tensor(ckpts, tmp_path):
    bad = edited(ckpts["fp8"], tmp_path / "a", lambda t: t.pop(Q_B + "_scale_inv"))
    raises(bad, str(bad / "model.safetensors"), "missing tensors: 1 [" + Q_B + "_scale_inv]", "quantization: fp8")
    bad = edited(ckpts["int4"], tmp_path / "b", lambda t: t.pop(EXPERT + ".weight_shape"))
    raises(bad, str(bad / "model.safetensors"), EXPERT + ".weight_shape")
    bad = edited(ckpts["fp32"], tmp_path / "c", lambda t: t.pop("lm_head.weight"))
    raises(bad, "missing tensors: 1 [lm_head.weight]")


def test_wrong_shapes(ckpts, tmp_path):
    def shrink(name):
        return lambda t: t.__setitem__(name, t[name][:-1].contiguous())

    file = "model.safetensors"
    bad = edited(ckpts["fp32"], tmp_path / "plain", shrink(Q_B))
    raises(bad, str(bad / file), f"tensor {Q_B}: checkpoint shape [95, 40] != model shape [96, 40]")
    bad = edited(ckpts["fp8"], tmp_path / "scale", shrink(Q_B + "_scale_inv"))
    raises(bad, str(bad / file), f"{Q_B}_scale_inv has shape [5, 2], expected [6, 2]")
    bad = edited(ckpts["fp8"], tmp_path / "fp8w", shrink(Q_B))
    raises(bad, str(bad / file), f"tensor {Q_B}: checkpoint shape [95, 40] != model shape [96, 40]")  # same scales

    def wrong_shape(t):
        t[EXPERT + ".weight_shape"] = torch.tensor([96, 60], dtype=torch.int32)

    bad = edited(ckpts["int4"], tmp_path / "int4shape", wrong_shape)
    raises(bad, str(bad / file), f"{EXPERT}.weight_packed has shape [96, 6], which does not pack")
    bad = edited(ckpts["int4"], tmp_path / "int4scale", shrink(EXPERT + ".weight_scale"))
    raises(bad, str(bad / file), f"{EXPERT}.weight_scale has shape [95, 2], expected [96, 2]")


def test_stored_fp8_without_quantization_config(ckpts, tmp_path):
    bad = edited(ckpts["fp8"], tmp_path / "noqc", config_edit=lambda c: c.pop("quantization_config"))
    err = raises(bad, str(bad / "model.safetensors"))
    assert re.search(r"(unexpected tensors|is stored as F8_E4M3)", str(err))


def test_unknown_or_unsupported_quantization(ckpts, tmp_path):
    bad = edited(ckpts["fp32"], tmp_path / "awq", config_edit=lambda c: c.__setitem__("quantization_config",
                                                                                     {"quant_method": "awq"}))  # fmt: skip
    raises(bad, str(bad / "config.json"), "quant_method 'awq' is not supported")

    def eight_bits(c):
        c["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 8

    bad = edited(ckpts["int4"], tmp_path / "int8", config_edit=eight_bits)
    raises(bad, str(bad / "config.json"), "num_bits/type/symmetric/strategy (8, 'int', True, 'group')")
    bad = edited(ckpts["fp8"], tmp_path / "e5m2", config_edit=lambda c: c["quantization_config"].update(fmt="e5m2"))
    raises(bad, str(bad / "config.json"), "'e5m2'")


def test_truncated_and_corrupt_files(tmp_path):
    root, _ = write_variant(tmp_path / "sharded", "fp8", shards=3)
    index = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    shard = root / index[Q_B]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])  # truncated: the header promises more bytes than there are
    err = raises(root, str(shard), "cannot read tensor")
    assert "model." in str(err).split("cannot read tensor")[1]  # names the tensor being read
    n = int.from_bytes(data[:8], "little")
    shard.write_bytes(data[:8] + b"{" + b"x" * (n - 1) + data[8 + n :])  # corrupt JSON header
    raises(root, str(shard), "cannot read tensor")

    single, _ = write_variant(tmp_path / "single", "fp32")
    file = single / "model.safetensors"
    file.write_bytes(b"\xff" * 8 + file.read_bytes()[8:])
    raises(single, str(file), "unreadable safetensors header")
    (root / "model.safetensors.index.json").write_text("{not json")
    raises(root, str(root / "model.safetensors.index.json"), "not a valid safetensors index")


def test_bad_slices_and_skips(ckpts):
    def build(c):
        return DeepseekV3ForCausalLM(c)

    raises(ckpts["fp32"], Q_B, "out of checkpoint shape [96, 40]",
           slice_of=lambda n: TensorSlice(0, 90, 100) if n == Q_B else None)  # fmt: skip
    raises(ckpts["int4"], EXPERT + ".weight", "sliced by TensorSlice(dim=1, start=0, stop=22) to [96, 22]",
           slice_of=lambda n: TensorSlice(1, 0, 22) if n == EXPERT + ".weight" else None)  # fmt: skip
    raises(ckpts["fp32"], "the model holds tensors that skip() excludes", "lm_head.weight",
           build_model=build, skip=lambda n: n == "lm_head.weight")  # fmt: skip


def test_load_config_reads_kimi_k25(tmp_path):
    root, _ = write_variant(tmp_path / "k25", "int4", kimi_k25=True)
    cfg = load_config(root)
    assert cfg.model_type == "kimi_k2" and cfg.hidden_size == TINY["hidden_size"]
    assert load_config(root / "config.json") == cfg

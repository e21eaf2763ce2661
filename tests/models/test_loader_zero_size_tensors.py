"""A transformers-saved checkpoint with `n_shared_experts: 0` holds zero-size `shared_experts` tensors
(intermediate size 0); they carry no weights, so the loader takes them as absent instead of "unexpected",
and the model is the one the same checkpoint without them gives. A non-empty leftover is still refused."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file, save_file

from ddtree.models.checkpoint.files import CheckpointError
from ddtree.models.checkpoint.loader import load_target
from ddtree.models.checkpoint.random import DEFAULT_TARGET_CONFIG, write_random_target


def _with_extra(src, dst, extra: dict[str, torch.Tensor]):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file({**load_file(str(src / "model.safetensors")), **extra}, str(dst / "model.safetensors"))
    return dst


def test_zero_size_shared_experts_load(tmp_path):
    config = copy.deepcopy(dict(DEFAULT_TARGET_CONFIG))
    config["n_shared_experts"] = 0
    plain = write_random_target(tmp_path / "plain", config, seed=3)
    hidden = config["hidden_size"]
    zero = {}
    for layer in range(config["first_k_dense_replace"], config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.shared_experts"
        zero[f"{prefix}.gate_proj.weight"] = torch.empty(0, hidden)
        zero[f"{prefix}.up_proj.weight"] = torch.empty(0, hidden)
        zero[f"{prefix}.down_proj.weight"] = torch.empty(hidden, 0)
    saved = _with_extra(plain, tmp_path / "transformers-saved", zero)

    want, got = load_target(plain).state_dict(), load_target(saved).state_dict()
    assert got.keys() == want.keys() and not any("shared_experts" in k for k in got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)

    stray = _with_extra(
        plain, tmp_path / "stray", {"model.layers.1.mlp.shared_experts.up_proj.weight": torch.ones(2, hidden)}
    )
    with pytest.raises(CheckpointError, match="unexpected tensors"):
        load_target(stray)

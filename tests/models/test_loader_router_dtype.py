"""The router's weight is held in the dtype its checkpoint stores (bf16 in Kimi / DeepSeek checkpoints): no
fp32 copy (services/models/checkpoint/loader.py). Its bias stays fp32. The router computes in fp32 from either, so a
bf16-stored router gives the logits of the same values stored in fp32."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from ddtree.models.checkpoint.loader import load_target
from tests.support.quantized_checkpoints import logits, state_dict_of, write_variant

ROUTER = "mlp.gate.weight"
IDS = [5, 17, 3, 99, 250, 7, 42, 1, 300, 11]


def _restore(root, dtype: torch.dtype) -> None:
    """Store every router weight of the checkpoint at `root` as `dtype` (values rounded to bf16 first)."""
    path = root / "model.safetensors"
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith(ROUTER)]:
        tensors[name] = tensors[name].to(torch.bfloat16).to(dtype)
    save_file(tensors, str(path))


def test_a_bf16_router_is_held_in_bf16_and_routes_as_its_fp32_copy(tmp_path):
    bf16, _ = write_variant(tmp_path / "bf16", "bf16")
    fp32, _ = write_variant(tmp_path / "fp32", "bf16")
    _restore(bf16, torch.bfloat16)
    _restore(fp32, torch.float32)
    a, b = load_target(bf16), load_target(fp32)
    routers = [n for n in state_dict_of(a) if n.endswith(ROUTER)]
    assert routers
    for n in routers:
        assert state_dict_of(a)[n].dtype == torch.bfloat16 and state_dict_of(b)[n].dtype == torch.float32, n
        assert torch.equal(state_dict_of(a)[n].float(), state_dict_of(b)[n]), n
    for n, t in state_dict_of(a).items():
        if n.endswith("e_score_correction_bias"):
            assert t.dtype == torch.float32, n
    assert torch.equal(logits(a, IDS), logits(b, IDS))

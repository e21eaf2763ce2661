"""The model with its layer kernels forced to Triton (interpreted on a CPU) against the torch path: RMSNorm,
fused residual add + RMSNorm, the one-launch router and SiLU-and-mul in every layer (layer_kernels.py). Both
models run the device path's GEMMs (kernels/gemm/dense.py, which the Triton kernels bring): the GEMMs are not
what is compared, and in bf16 theirs and BLAS's round differently."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ddtree.kernels.gemm.dense import head_gemm
from ddtree.models.checkpoint.random import DEFAULT_TARGET_CONFIG, random_target_state_dict
from ddtree.models.deepseek_v3.config import DeepseekV3Config
from ddtree.models.deepseek_v3.model import DeepseekV3ForCausalLM
from ddtree.models.layers.attention import AttentionMetadata, SeqAttention
from ddtree.models.layers.layer_kernels import make_layer_kernels
from ddtree.tools.selftest.compare import assert_close
from tests.support.triton_env import DEVICE, triton_interpret_env  # noqa: F401,I001  (before kernels are imported)

# 16 experts in 4 groups, 2 kept: the group limit matters; 2 MoE layers after a dense one
CONFIG = {**DEFAULT_TARGET_CONFIG, "n_routed_experts": 16, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3,
          "num_hidden_layers": 3}  # fmt: skip


@pytest.fixture(scope="module")
def models():
    config = DeepseekV3Config.from_dict(CONFIG)
    state = random_target_state_dict(config, seed=4)
    out = {}
    for kernels in ("torch", "triton"):
        m = DeepseekV3ForCausalLM(config, kernels=kernels)
        m.load_state_dict(state)
        m.layer_kernels = dataclasses.replace(m.layer_kernels, head_gemm=head_gemm)
        out[kernels] = m.eval().to(DEVICE)
    return out


def _two_forwards(model, dtype):
    """A prefill of 2 sequences (13 and 4 tokens) then a decode row and a 3-token extend; logits of every
    row, taps of layers 0 and 2."""
    model = model.to(dtype)
    cache = model.new_kv_cache(64)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 4000, (21,), generator=g).to(DEVICE)
    empty = torch.empty(0, dtype=torch.int64)
    a, b = torch.arange(0, 13), torch.arange(13, 17)
    meta = AttentionMetadata((SeqAttention(0, 13, empty, a), SeqAttention(13, 4, empty, b)))
    pos = torch.cat([torch.arange(13), torch.arange(4)]).to(DEVICE)
    first = model(ids[:17], pos, meta, cache, tap_layer_ids=(0, 2))
    meta = AttentionMetadata((SeqAttention(0, 1, a, torch.tensor([17])), SeqAttention(1, 3, b, torch.arange(18, 21))))
    pos = torch.tensor([13, 4, 5, 6]).to(DEVICE)
    rows = torch.tensor([0, 3, 2]).to(DEVICE)
    second = model(ids[17:], pos, meta, cache, logits_rows=rows, tap_layer_ids=(1,))
    return [first.logits, first.taps, second.logits, second.taps]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_layer_kernels_give_the_torch_logits(models, dtype):
    assert models["triton"].layer_kernels.name == "triton" and models["torch"].layer_kernels.name == "torch"
    got = _two_forwards(models["triton"], dtype)
    expected = _two_forwards(models["torch"], dtype)
    for name, g, e in zip(["prefill logits", "prefill taps", "extend logits", "extend taps"], got, expected):
        assert_close(f"{dtype} {name}", g, e)


def test_kernel_choice():
    config = DeepseekV3Config.from_dict(CONFIG)
    with torch.device("meta"):
        assert DeepseekV3ForCausalLM(config).layer_kernels.name == "torch"
        assert DeepseekV3ForCausalLM(config, attention_backend="triton").layer_kernels.name == "triton"
        assert DeepseekV3ForCausalLM(config, attention_backend="triton", kernels="torch").layer_kernels.name == "torch"
    with pytest.raises(ValueError, match="choices"):
        make_layer_kernels("cuda")

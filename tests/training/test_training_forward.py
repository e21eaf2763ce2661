"""The batched training forward (naive MLA + SDPA, grouped MoE) gives the serving forward's logits."""

from __future__ import annotations

import pytest
import torch

from ddtree.models.checkpoint.random import DEFAULT_TARGET_CONFIG, random_target_state_dict
from ddtree.models.deepseek_v3.config import DeepseekV3Config
from ddtree.models.deepseek_v3.model import DeepseekV3ForCausalLM
from ddtree.models.deepseek_v3.training_forward import training_forward, update_expert_bias
from ddtree.models.layers.attention import AttentionMetadata, SeqAttention
from ddtree.tools.selftest.compare import assert_close

SMALL = {**DEFAULT_TARGET_CONFIG, "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
         "moe_intermediate_size": 32, "num_hidden_layers": 3, "q_lora_rank": 32, "kv_lora_rank": 16,
         "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
         "rope_scaling": {**DEFAULT_TARGET_CONFIG["rope_scaling"], "factor": 8.0,
                          "original_max_position_embeddings": 16}}  # fmt: skip
EMPTY = torch.empty(0, dtype=torch.int64)


def _model(cfg: dict, seed: int = 0) -> DeepseekV3ForCausalLM:
    config = DeepseekV3Config.from_dict(cfg)
    model = DeepseekV3ForCausalLM(config)
    model.load_state_dict(random_target_state_dict(config, seed))
    return model.eval()


def _serving_logits(model: DeepseekV3ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    T = ids.shape[0]
    meta = AttentionMetadata((SeqAttention(0, T, EMPTY, torch.arange(T)),))
    return model(ids, torch.arange(T), meta, model.new_kv_cache(T)).logits  # [T, V]


@pytest.mark.parametrize("q_lora_rank", [32, None])
def test_training_logits_equal_serving_logits(q_lora_rank):
    model = _model({**SMALL, "q_lora_rank": q_lora_rank})
    ids = torch.randint(0, SMALL["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = training_forward(model, ids)  # 40 tokens: past original_max_position_embeddings (16)
    assert out.logits.shape == (2, 40, SMALL["vocab_size"])
    for b in range(2):
        assert_close(f"logits[{b}]", out.logits[b], _serving_logits(model, ids[b]))
    moe_layers = [i for i in range(SMALL["num_hidden_layers"]) if i >= SMALL["first_k_dense_replace"]]
    assert sorted(out.expert_load) == moe_layers
    for load in out.expert_load.values():
        assert int(load.sum()) == 2 * 40 * SMALL["num_experts_per_tok"]


def test_training_forward_has_gradients_for_every_weight():
    model = _model(SMALL).train()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(2))
    out = training_forward(model, ids)
    out.logits.logsumexp(-1).mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    # an expert that got no token this batch has no gradient; every other weight must
    assert all(".experts." in n for n in missing), missing


def test_expert_bias_update_moves_towards_balance():
    model = _model(SMALL)
    gate = model.model.layers[1].mlp.gate
    before = gate.e_score_correction_bias.clone()
    load = torch.tensor([10, 0, 0, 0, 0, 0, 0, 6])  # mean 2
    update_expert_bias(model, {1: load}, gamma=0.01)
    delta = gate.e_score_correction_bias - before
    assert delta[0] == pytest.approx(-0.01) and delta[1] == pytest.approx(0.01) and delta[7] == pytest.approx(-0.01)

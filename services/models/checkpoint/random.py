"""Reproducible random target checkpoints in the HF layout, for the CPU demo and tests.

`write_random_target(dir, config_dict, seed)` writes `config.json` (HF style, legacy `rope_theta` +
`rope_scaling` keys, loadable by transformers `DeepseekV3ForCausalLM.from_pretrained` and by our loader)
and `model.safetensors` with one tensor per name of our model's state_dict (== the hub names).
Init: linears and embeddings N(0, 0.02), norm weights 1, router weight N(0, 0.02),
e_score_correction_bias N(0, 0.05) (so the bias actually changes routing). Same seed -> same bytes.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ddtree.models.deepseek_v3.config import DeepseekV3Config
from ddtree.models.deepseek_v3.model import DeepseekV3ForCausalLM

# Small Kimi-K2-shaped config for the CPU demo (~5M parameters). HF config.json spelling.
# Copy before modifying, e.g. {**DEFAULT_TARGET_CONFIG, "eos_token_id": [7, 8]}.
DEFAULT_TARGET_CONFIG: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 96,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 8192,
    "rope_theta": 50000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 32.0,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    },
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "num_nextn_predict_layers": 0,
    "initializer_range": 0.02,
}

BIAS_STD = 0.05


def random_target_state_dict(
    config: DeepseekV3Config, seed: int, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """name -> tensor, generated in state_dict order from one seeded CPU generator."""
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in DeepseekV3ForCausalLM(config).state_dict().items()}
    gen = torch.Generator(device="cpu").manual_seed(seed)
    std = config.initializer_range
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if name.endswith("e_score_correction_bias"):
            t = torch.randn(shape, generator=gen) * BIAS_STD
        elif name.endswith("norm.weight"):  # every RMSNorm: input/post_attention/q_a/kv_a/final
            t = torch.ones(shape)
        elif name.endswith(".bias"):  # only with attention_bias
            t = torch.zeros(shape)
        else:
            t = torch.randn(shape, generator=gen) * std
        keep_fp32 = name.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias"))
        out[name] = t.to(torch.float32 if keep_fp32 else dtype).contiguous()
    return out


def write_random_target(
    dir: str | Path,
    config_dict: Mapping[str, Any] | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write config.json + model.safetensors into `dir` (created if needed); returns the directory."""
    root = Path(dir)
    root.mkdir(parents=True, exist_ok=True)
    config = DeepseekV3Config.from_dict(copy.deepcopy(dict(config_dict or DEFAULT_TARGET_CONFIG)))
    hf = config.to_hf_dict()
    hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    with open(root / "config.json", "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
    save_file(random_target_state_dict(config, seed, dtype), str(root / "model.safetensors"), metadata={"format": "pt"})
    return root

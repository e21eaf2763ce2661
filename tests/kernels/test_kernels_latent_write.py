"""Fused latent KV write (kernels/mla/latent_write.py) against its torch reference and against mla.py itself."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ddtree.kernels.mla.latent_write import write_latent
from ddtree.kernels.reference import write_latent_ref
from ddtree.models.checkpoint.random import DEFAULT_TARGET_CONFIG
from ddtree.models.deepseek_v3.config import DeepseekV3Config
from ddtree.models.deepseek_v3.mla import DeepseekV3Attention
from ddtree.models.layers.rope import RotaryEmbedding
from ddtree.tools.selftest.compare import assert_close
from tests.support.triton_env import DEVICE, triton_interpret_env  # noqa: F401,I001  (before kernels are imported)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    tokens: int
    r: int = 64
    dr: int = 16
    dtype: torch.dtype = torch.float32
    attention_factor: float = 1.0

    def __str__(self) -> str:
        return self.name


CASES = [
    Case("one_token", 1),
    Case("tree17_fp32", 17, attention_factor=0.9),
    Case("tree17_bf16", 17, dtype=torch.bfloat16),
    Case("tree17_fp16", 17, dtype=torch.float16),
    Case("kimi_512_64_bf16", 65, r=512, dr=64, dtype=torch.bfloat16),
    Case("width_48_8", 9, r=48, dr=8),
]


def _inputs(case: Case, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    S = 3 * case.tokens + 5
    latent = (torch.randn(case.tokens, case.r + case.dr, generator=gen) * 3).to(case.dtype)
    weight = (1 + 0.2 * torch.randn(case.r, generator=gen)).to(case.dtype)
    positions = torch.randint(0, 32768, (case.tokens,), generator=gen)
    slots = torch.randperm(S, generator=gen)[: case.tokens]
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, case.dr, 2, dtype=torch.float32) / case.dr)
    kv = torch.randn(S, case.r + case.dr, generator=gen).to(case.dtype)
    return [t.to(DEVICE) for t in (kv, latent, slots, positions, weight, inv_freq)]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_write_latent_matches_reference(case):
    kv, latent, slots, positions, weight, inv_freq = _inputs(case)
    expected = kv.clone()
    write_latent_ref(expected, latent, slots, positions, weight, 1e-6, inv_freq, case.attention_factor)
    write_latent(kv, latent, slots, positions, weight, 1e-6, inv_freq, case.attention_factor)
    assert_close(case.name, kv, expected)  # untouched slots must stay as they were, too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_write_latent_matches_the_model(dtype):
    """Same cache rows as DeepseekV3Attention.project_latent + the scatter in its forward (YaRN RoPE)."""
    cfg = DeepseekV3Config.from_dict(DEFAULT_TARGET_CONFIG)
    torch.manual_seed(0)
    attn = DeepseekV3Attention(cfg).to(dtype)
    with torch.no_grad():
        attn.kv_a_layernorm.weight.add_(0.1 * torch.randn(cfg.kv_lora_rank).to(dtype))
    rope = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim)
    T, S = 11, 40
    h = torch.randn(T, cfg.hidden_size).to(dtype)
    positions = torch.arange(5000, 5000 + T)
    slots = torch.randperm(S)[:T]
    expected = torch.zeros(S, cfg.kv_cache_width, dtype=dtype)
    got = expected.clone().to(DEVICE)
    with torch.no_grad():
        expected[slots] = attn.project_latent(h, positions, rope).to(dtype)
        latent = attn.project_a(h)[1].contiguous()  # the kv_a output (one GEMM with q_a when merged)
    norm = attn.kv_a_layernorm
    write_latent(got, latent.to(DEVICE), slots.to(DEVICE), positions.to(DEVICE), norm.weight.detach().to(DEVICE),
                 norm.eps, rope.inv_freq.to(DEVICE), rope.attention_factor)  # fmt: skip
    assert_close(f"latent write {dtype}", got, expected)


def test_write_latent_rejects_bad_inputs():
    case = Case("err", 5)
    kv, latent, slots, positions, weight, inv_freq = _inputs(case)
    ok = dict(kv=kv, latent=latent, slots=slots, positions=positions, norm_weight=weight, eps=1e-6,
              inv_freq=inv_freq)  # fmt: skip
    bad = [
        (dict(latent=latent[:, :-1]), "must be \\[T, W\\] / \\[S, W\\]"),
        (dict(slots=slots[:-1]), "slots / positions must be int64 \\[5\\]"),
        (dict(positions=positions.int()), "slots / positions must be int64"),
        (dict(slots=slots.clone().fill_(kv.shape[0])), "slots out of range"),
        (dict(latent=latent.to(torch.float16)), "dtypes differ"),
        (dict(inv_freq=inv_freq[:-1]), "inv_freq fp32 \\[8\\]"),
        (dict(latent=latent.t().contiguous().t()), "contiguous in its last dim"),
        (dict(kv=kv[:, :-2], latent=latent[:, :-2], inv_freq=inv_freq[:-1]), "even power of two"),
    ]
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            write_latent(**{**ok, **change})

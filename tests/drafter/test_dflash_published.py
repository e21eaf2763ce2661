"""Drafters in the published DFlash layout (z-lab on the Hugging Face hub, e.g. z-lab/Kimi-K2.5-DFlash).

The synthetic checkpoint here has the Kimi-K2.5 drafter's shape at reduced width: a Qwen3-style config.json
(model_type qwen3, architectures ["DFlashDraftModel"]) with `block_size` 8, `num_target_layers` 61 and a
`dflash_config{}` of 6 taps [1, 12, 24, 35, 47, 58] and mask id 163838 (vocab 163840), YaRN RoPE (theta
50000, factor 64 over 4096, mscale = mscale_all_dim = 1), and bf16 safetensors whose names are written out
here by hand, without a `model.` prefix and without embed_tokens / lm_head. Hidden 64 instead of 7168: the
drafter holds no vocab-sized tensor, so the 163840-token vocabulary costs nothing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ddtree.models.checkpoint.files import CheckpointError
from ddtree.models.dflash.checkpoint import load_drafter
from ddtree.models.dflash.config import DFlashConfig
from ddtree.models.dflash.model import DFlashDraftModel, rope_inv_freq
from tests.support.dflash_reference import naive_block

TAPS = [1, 12, 24, 35, 47, 58]
VOCAB, MASK, BLOCK, TARGET_LAYERS = 163840, 163838, 8, 61
H, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 2, 4, 2, 24, 160  # head_dim != H / heads, as in Qwen3
KIMI_YARN = {
    "rope_type": "yarn",
    "factor": 64.0,
    "original_max_position_embeddings": 4096,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
STANDARD_MSCALE = 1 + 0.1 * math.log(64.0)  # YaRN's m(f) = 1 + 0.1 ln f, what SGLang / vLLM <= 0.29 use


def published_config(rope_scaling: dict | None = KIMI_YARN, **changes) -> dict:
    """config.json in the published layout (the fields a transformers Qwen3Config save writes, plus DFlash's)."""
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": BLOCK,
        "bos_token_id": 163584,
        "eos_token_id": 163585,
        "dflash_config": {"mask_token_id": MASK, "target_layer_ids": list(TAPS)},
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": FFN,
        "layer_types": ["full_attention"] * LAYERS,
        "max_position_embeddings": 262144,
        "max_window_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "num_target_layers": TARGET_LAYERS,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None if rope_scaling is None else dict(rope_scaling),
        "rope_theta": 50000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    }
    cfg.update(changes)
    return cfg


def published_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16 weights under the published names, written out independently of DFlashDraftModel's modules."""
    g = torch.Generator().manual_seed(seed)

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return (torch.randn(out_features, in_features, generator=g) / math.sqrt(in_features)).bfloat16()

    def norm(n: int) -> torch.Tensor:
        return (1 + 0.1 * torch.randn(n, generator=g)).bfloat16()

    state = {"fc.weight": linear(H, len(TAPS) * H), "hidden_norm.weight": norm(H), "norm.weight": norm(H)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        state |= {
            p + "input_layernorm.weight": norm(H),
            p + "post_attention_layernorm.weight": norm(H),
            p + "self_attn.q_proj.weight": linear(HEADS * HEAD_DIM, H),
            p + "self_attn.k_proj.weight": linear(KV_HEADS * HEAD_DIM, H),
            p + "self_attn.v_proj.weight": linear(KV_HEADS * HEAD_DIM, H),
            p + "self_attn.o_proj.weight": linear(H, HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": norm(HEAD_DIM),
            p + "self_attn.k_norm.weight": norm(HEAD_DIM),
            p + "mlp.gate_proj.weight": linear(FFN, H),
            p + "mlp.up_proj.weight": linear(FFN, H),
            p + "mlp.down_proj.weight": linear(H, FFN),
        }
    return state


def write_published(path: Path, config: dict | None = None, state: dict | None = None) -> Path:
    """A drafter directory as published: config.json + one model.safetensors."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or published_config(), indent=2))
    save_file(published_tensors() if state is None else state, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory) -> Path:
    return write_published(tmp_path_factory.mktemp("kimi_dflash"))


def feats(n: int, f: int, seed: int) -> torch.Tensor:
    return torch.randn(n, f, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- the layout loads


def test_taps_block_and_mask_read(kimi_dir: Path) -> None:
    model = load_drafter(kimi_dir)
    cfg = model.config
    assert cfg.target_layer_ids == tuple(TAPS) and cfg.num_target_layers == TARGET_LAYERS
    assert cfg.block_size == BLOCK and cfg.mask_token_id == MASK and cfg.vocab_size == VOCAB
    assert cfg.hidden_size == cfg.target_hidden_size == H and cfg.feature_size == 6 * H
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (LAYERS, HEADS, KV_HEADS)
    assert cfg.head_dim == HEAD_DIM and cfg.intermediate_size == FFN and cfg.rms_norm_eps == 1e-5
    assert cfg.rope.rope_type == "yarn" and cfg.rope.theta == 50000.0 and cfg.rope.factor == 64.0
    assert cfg.rope.original_max_position_embeddings == 4096 and cfg.max_position_embeddings == 262144
    assert model.dtype == torch.bfloat16  # the stored dtype
    assert tuple(model.fc.weight.shape) == (H, 6 * H)
    # no vocab-sized tensor: the target's embedding and LM head are used
    assert all(VOCAB not in p.shape for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) < 200_000
    assert set(model.state_dict()) == set(load_file(str(kimi_dir / "model.safetensors")))
    # what we write back reads the same
    assert DFlashConfig.from_dict(cfg.to_dict()) == cfg


def test_taps_block_and_mask_at_the_top_level() -> None:
    """Older DFlash configs keep mask_token_id / target_layer_ids at the top level; dflash_config{} wins."""
    top = published_config(mask_token_id=MASK, target_layer_ids=TAPS)
    del top["dflash_config"]
    assert DFlashConfig.from_dict(top) == DFlashConfig.from_dict(published_config())
    both = published_config(mask_token_id=5, target_layer_ids=[0, 1, 2, 3, 4, 5])
    cfg = DFlashConfig.from_dict(both)
    assert cfg.mask_token_id == MASK and cfg.target_layer_ids == tuple(TAPS)


def test_published_layout_matches_naive_reference(tmp_path: Path) -> None:
    """The published layout with default RoPE (the naive reference's), loaded in float64: its block forward
    equals tests/drafter/test_dflash.py's from-scratch reference on the stored bf16 weights."""
    path = write_published(tmp_path / "d", published_config(rope_scaling=None))
    model = load_drafter(path, dtype=torch.float64)
    cfg = model.config
    state = load_file(str(path / "model.safetensors"))
    n, start = 9, 40  # small positions: the RoPE angles are fp32 (as in HF), the reference's float64
    f = feats(n, cfg.feature_size, 1)
    ctx_pos = torch.arange(start, start + n)
    blk_pos = torch.arange(start + n, start + n + BLOCK)
    block = feats(BLOCK, H, 2)  # stands for the target's embeddings of [root, MASK x 7]
    ref = naive_block(state, cfg, f, ctx_pos, block, blk_pos)
    got = model.forward_block(block, blk_pos, model.context_kv(f, ctx_pos))
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
    # each tap's slice of fc matters: dropping the last tap's features changes the answer
    f2 = f.clone()
    f2[:, 5 * H :] = 0
    assert (model.forward_block(block, blk_pos, model.context_kv(f2, ctx_pos)) - ref).abs().max() > 1e-3


def test_sharded_published_checkpoint_loads_the_same(tmp_path: Path, kimi_dir: Path) -> None:
    state = published_tensors()
    names = sorted(state)
    path = tmp_path / "sharded"
    path.mkdir()
    (path / "config.json").write_text((kimi_dir / "config.json").read_text())
    save_file({k: state[k] for k in names[:10]}, str(path / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in names[10:]}, str(path / "model-00002-of-00002.safetensors"))
    a, b = load_drafter(kimi_dir).state_dict(), load_drafter(path).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- the YaRN attention factor


@pytest.mark.parametrize(
    "scaling, want",
    [
        # the published Kimi section: transformers' rule gives mscale(64, 1) / mscale(64, 1) = 1
        (KIMI_YARN, 1.0),
        # no mscales: YaRN's own m(f) = 1 + 0.1 ln f
        ({k: v for k, v in KIMI_YARN.items() if not k.startswith("mscale")}, STANDARD_MSCALE),
        # only one of the two: transformers ignores it
        ({k: v for k, v in KIMI_YARN.items() if k != "mscale_all_dim"}, STANDARD_MSCALE),
        # DeepSeek-style mscales
        (
            dict(KIMI_YARN, mscale=0.707, mscale_all_dim=1.0),
            (1 + 0.1 * 0.707 * math.log(64.0)) / (1 + 0.1 * math.log(64.0)),
        ),
        # the override: what SGLang / vLLM <= 0.29 run the Kimi drafter with, and any other value
        (dict(KIMI_YARN, attention_factor=STANDARD_MSCALE), STANDARD_MSCALE),
        (dict(KIMI_YARN, attention_factor=1.25), 1.25),
        (dict(KIMI_YARN, attention_factor=2), 2.0),
        # not YaRN: no factor, whatever the section says
        ({"rope_type": "linear", "factor": 4.0, "attention_factor": 3.0}, 1.0),
    ],
)
def test_yarn_attention_factor(scaling: dict, want: float) -> None:
    cfg = DFlashConfig.from_dict(published_config(rope_scaling=scaling))
    inv_freq, scale = rope_inv_freq(cfg)
    assert scale == pytest.approx(want, rel=1e-12)
    # the transformers >= 5 layout (rope_parameters, theta inside) reads the same
    params = published_config(rope_scaling=None, rope_parameters=dict(scaling, rope_theta=50000.0))
    del params["rope_theta"]
    assert rope_inv_freq(DFlashConfig.from_dict(params))[1] == pytest.approx(want, rel=1e-12)
    # cos/sin of q and k carry the factor: cos_sin(p) = factor * (cos, sin)(p * inv_freq), rotate-half layout
    model = DFlashDraftModel(cfg).double()
    pos = torch.tensor([0, 1, 4095, 4096, 100_000])
    angles = (pos.float()[:, None] * inv_freq[None, :]).double()  # the angles are fp32, as in HF
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = model.cos_sin(pos)
    torch.testing.assert_close(cos, want * angles.cos(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sin, want * angles.sin(), atol=1e-6, rtol=1e-6)


def test_yarn_attention_factor_matches_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for scaling in (KIMI_YARN, dict(KIMI_YARN, attention_factor=STANDARD_MSCALE)):
        hf = transformers.Qwen3Config(
            hidden_size=H,
            num_attention_heads=HEADS,
            head_dim=HEAD_DIM,
            max_position_embeddings=262144,
            rope_parameters=dict(scaling, rope_theta=50000.0),
        )
        ref_inv, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
        inv, scale = rope_inv_freq(DFlashConfig.from_dict(published_config(rope_scaling=scaling)))
        torch.testing.assert_close(inv, ref_inv)
        assert scale == pytest.approx(ref_scale)


def test_attention_factor_scales_the_logits(tmp_path: Path) -> None:
    """The factor multiplies q and k after their norms, so a drafter with factor a computes what the same
    weights with factor 1 compute when q_norm and k_norm are a times larger (logits x a²); and it matters."""
    a = STANDARD_MSCALE
    base = dict(KIMI_YARN, attention_factor=1.0)
    plain = load_drafter(write_published(tmp_path / "one", published_config(base)), dtype=torch.float64)
    scaled = load_drafter(
        write_published(tmp_path / "a", published_config(dict(base, attention_factor=a))), dtype=torch.float64
    )
    assert plain._rope_scale == 1.0 and scaled._rope_scale == a
    torch.testing.assert_close(plain._inv_freq, scaled._inv_freq)
    state = plain.state_dict()
    for k in state:
        if k.endswith(("q_norm.weight", "k_norm.weight")):
            state[k] = state[k] * a
    folded = DFlashDraftModel(plain.config).double()
    folded.load_state_dict(state)
    f, block = feats(7, 6 * H, 3), feats(BLOCK, H, 4)
    ctx_pos, blk_pos = torch.arange(5000, 5007), torch.arange(5007, 5007 + BLOCK)  # past the 4096 original
    got = scaled.forward_block(block, blk_pos, scaled.context_kv(f, ctx_pos))
    want = folded.forward_block(block, blk_pos, folded.context_kv(f, ctx_pos))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # RMSNorm and the RoPE angles run in fp32
    unscaled = plain.forward_block(block, blk_pos, plain.context_kv(f, ctx_pos))
    assert (got - unscaled).abs().max() > 1e-2


@pytest.mark.parametrize("bad", [0, -1.0, "1.4", True, float("inf")])
def test_bad_attention_factor_is_explained(bad) -> None:
    with pytest.raises(ValueError, match="rope_scaling.attention_factor must be a positive number") as err:
        DFlashConfig.from_dict(published_config(dict(KIMI_YARN, attention_factor=bad)))
    assert "1 + 0.1 ln(factor)" in str(err.value) and "mscale_all_dim" in str(err.value)


# ---------------------------------------------------------------- extra and missing tensors


def _load_edited(path: Path, edit, extra_file: dict | None = None) -> str:
    """Write the published checkpoint with `edit` applied (and an optional second file); the load error."""
    state = published_tensors()
    edit(state)
    write_published(path, state=state)
    if extra_file:
        save_file(extra_file, str(path / "extra.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_drafter(path)
    return str(err.value)


def test_extra_attention_bias_is_named_with_its_file(tmp_path: Path) -> None:
    msg = _load_edited(tmp_path / "d", lambda s: s.update({"layers.0.self_attn.o_proj.bias": torch.zeros(H)}))
    assert "unexpected keys ['layers.0.self_attn.o_proj.bias']" in msg
    assert "unexpected tensor layers.0.self_attn.o_proj.bias in model.safetensors" in msg
    assert "config.json has attention_bias false" in msg
    assert "missing keys []" in msg and "shape mismatches []" in msg


def test_embedding_or_lm_head_is_refused(tmp_path: Path) -> None:
    """A drafter that ships its own embedding / LM head (here in a second file): named, file and all."""
    small = {"embed_tokens.weight": torch.zeros(4, H), "lm_head.weight": torch.zeros(4, H)}
    msg = _load_edited(tmp_path / "d", lambda s: None, extra_file=small)
    assert "unexpected keys ['embed_tokens.weight', 'lm_head.weight']" in msg
    for name in small:
        assert f"unexpected tensor {name} in extra.safetensors: the drafter has no embedding or LM head" in msg
    assert "it uses the target's" in msg


def test_missing_tensor_is_named_with_the_files_read(tmp_path: Path) -> None:
    msg = _load_edited(tmp_path / "d", lambda s: s.pop("layers.1.self_attn.k_norm.weight"))
    assert "missing keys ['layers.1.self_attn.k_norm.weight']" in msg
    assert "missing tensor layers.1.self_attn.k_norm.weight (files read: model.safetensors)" in msg


def test_prefixed_names_get_a_hint(tmp_path: Path) -> None:
    def prefix(s: dict) -> None:
        for k in list(s):
            s["model." + k] = s.pop(k)

    msg = _load_edited(tmp_path / "d", prefix)
    n = len(published_tensors())
    assert f"and {n - 10} more" in msg  # long lists are cut
    assert "without a 'model.' prefix" in msg and "missing tensor fc.weight" in msg


def test_extra_layer_and_wrong_tap_count(tmp_path: Path) -> None:
    msg = _load_edited(tmp_path / "d", lambda s: s.update({"layers.2.input_layernorm.weight": torch.ones(H)}))
    assert "layers.2.input_layernorm.weight in model.safetensors: config.json has num_hidden_layers 2" in msg
    # a config that names 5 taps for a checkpoint trained on 6
    path = tmp_path / "taps"
    cfg = published_config()
    cfg["dflash_config"]["target_layer_ids"] = TAPS[:5]
    write_published(path, cfg)
    with pytest.raises(CheckpointError, match=r"shape mismatches \['fc.weight \(64, 384\) != \(64, 320\)'\]") as err:
        load_drafter(path)
    assert "tensor fc.weight in model.safetensors is (64, 384), config.json makes it (64, 320)" in str(err.value)
    assert "[hidden_size, len(target_layer_ids) * target_hidden_size] = [64, 5 * 64]" in str(err.value)

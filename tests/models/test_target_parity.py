"""Parity of our DeepSeek-V3 target (absorbed MLA over a latent cache) with transformers, fp32, eager.

Tiny random configs cover every path the code has (docs/design.md §5). Checkpoints are written by transformers `save_pretrained` and
read by OUR loader; HF reloads the same directory with attn_implementation="eager".
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ddtree.models.checkpoint.loader import CheckpointError, load_target, load_tensors
from ddtree.models.checkpoint.random import DEFAULT_TARGET_CONFIG, write_random_target
from ddtree.models.deepseek_v3.config import DeepseekV3Config
from ddtree.models.deepseek_v3.mla import naive_mla
from ddtree.models.layers.attention import AttentionMetadata, SeqAttention, make_attention_backend
from ddtree.models.layers.rope import apply_rope_interleaved, rope_attention_factor, yarn_inv_freq
from ddtree.tools.selftest.compare import assert_close

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config as HFConfig  # noqa: E402
from transformers import DeepseekV3ForCausalLM as HFModel  # noqa: E402

BASE = dict(
    model_type="deepseek_v3", vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, first_k_dense_replace=1, moe_layer_freq=1, n_group=2, topk_group=1, norm_topk_prob=True,
    routed_scaling_factor=2.827, scoring_func="sigmoid", topk_method="noaux_tc", hidden_act="silu",
    rms_norm_eps=1e-6, max_position_embeddings=1024, rope_theta=50000.0,
    rope_scaling=dict(type="yarn", factor=32.0, beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                      original_max_position_embeddings=32),
    tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, num_nextn_predict_layers=0,
)  # fmt: skip
CONFIGS = {
    # q_a/q_b bottleneck, 2 expert groups with 1 allowed (the group limit matters); eps 1e-5 as in later
    # Kimi copies: the q_a/kv_a layernorms must still use 1e-6
    "qlora_group2": {**BASE, "rms_norm_eps": 1e-5},
    # plain q_proj, no group limit, every layer MoE
    "qproj_allmoe": {**BASE, "q_lora_rank": None, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0,
                     "rms_norm_eps": 1e-5, "eos_token_id": [1, 2]},
}  # fmt: skip
EMPTY = torch.empty(0, dtype=torch.int64)


def save_hf_checkpoint(cfg: dict, path: Path, seed: int = 0, **save_kwargs) -> Path:
    torch.manual_seed(seed)
    model = HFModel(HFConfig(**cfg)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)  # routing depends on the bias
    model.save_pretrained(path, **save_kwargs)
    return path


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    path = save_hf_checkpoint(CONFIGS[request.param], tmp_path_factory.mktemp(request.param))
    hf = HFModel.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    ours = load_target(path)
    return hf, ours, path


@torch.no_grad()
def hf_logits(hf, ids: list[int] | torch.Tensor) -> torch.Tensor:  # [N, vocab]
    return hf(torch.as_tensor(ids)[None]).logits[0].float()


def run(model, kv, seqs: list[tuple[list[int], list[int], torch.Tensor, torch.Tensor, torch.Tensor | None]], **kw):
    """seqs: (token ids, positions, prefix_slots, new_slots, new_mask) -> ForwardOutput of one batched call."""
    metas, row = [], 0
    for ids, _, prefix, new, mask in seqs:
        metas.append(SeqAttention(row, len(ids), prefix, new, mask))
        row += len(ids)
    ids = torch.tensor([t for s in seqs for t in s[0]])
    pos = torch.tensor([p for s in seqs for p in s[1]])
    return model(ids, pos, AttentionMetadata(tuple(metas)), kv, **kw)


def prefill(model, kv, ids: list[int], slots: torch.Tensor, **kw):
    """Fresh sequence: positions 0..N-1, no prefix."""
    return run(model, kv, [(ids, list(range(len(ids))), EMPTY, slots, None)], **kw)


def root_path(tokens: list[int], parents: list[int], i: int) -> list[int]:
    """The tokens from the tree's first node down to node i."""
    path = []
    while i >= 0:
        path.insert(0, tokens[i])
        i = parents[i]
    return path


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


# ---- end-to-end logits ------------------------------------------------------------------------------
def test_prefill_logits(pair):
    hf, ours, _ = pair
    ids = torch.randint(0, 512, (11,), generator=torch.Generator().manual_seed(1)).tolist()
    slots = torch.randperm(40)[:11]  # scattered cache slots
    out = prefill(ours, ours.new_kv_cache(40), ids, slots)
    assert out.logits.dtype == torch.float32 and out.taps is None
    assert_close("prefill logits", out.logits, hf_logits(hf, ids))
    rows = torch.tensor([10, 3])
    sub = prefill(ours, ours.new_kv_cache(40), ids, slots, logits_rows=rows)
    assert_close("logits_rows", sub.logits, out.logits[rows])


def test_decode_step_by_step(pair):
    hf, ours, _ = pair
    ids = torch.randint(0, 512, (10,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = hf_logits(hf, ids)
    kv, slots = ours.new_kv_cache(64), torch.randperm(64)[:10]
    got = [prefill(ours, kv, ids[:4], slots[:4]).logits]
    for t in range(4, 10):
        got.append(run(ours, kv, [([ids[t]], [t], slots[:t], slots[t : t + 1], None)]).logits)
    assert_close("decode logits", torch.cat(got), ref)


def test_tree_verify(pair):
    hf, ours, _ = pair
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 512, (6,), generator=g).tolist()
    parents = [-1, 0, 0, 1, 1, 2, 3, 5]  # root (last committed token) + 7 nodes with siblings
    tokens = torch.randint(0, 512, (len(parents),), generator=g).tolist()
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    kv, slots = ours.new_kv_cache(32), torch.randperm(32)
    prefill(ours, kv, prefix, slots[:6])
    P = len(prefix)
    out = run(ours, kv, [(tokens, [P + d for d in depth], slots[:6], slots[6:14], ancestor_mask(parents))])
    for i in range(len(parents)):
        assert_close(f"tree node {i}", out.logits[i], hf_logits(hf, prefix + root_path(tokens, parents, i))[-1])


def test_batched_equals_separate(pair):
    hf, ours, _ = pair
    g = torch.Generator().manual_seed(4)
    a = torch.randint(0, 512, (8,), generator=g).tolist()  # prefix 5, extend by 3
    b = torch.randint(0, 512, (10,), generator=g).tolist()  # prefix 9, decode 1
    c = torch.randint(0, 512, (4,), generator=g).tolist()  # fresh prefill of 4
    t = torch.randint(0, 512, (7,), generator=g).tolist()  # prefix 3, then a tree root + 3 nodes
    slots = torch.randperm(48)
    sa, sb, sc, st = slots[:8], slots[8:18], slots[18:22], slots[22:29]
    kv = ours.new_kv_cache(48)
    prefill(ours, kv, a[:5], sa[:5])
    prefill(ours, kv, b[:9], sb[:9])
    prefill(ours, kv, t[:3], st[:3])
    kv_sep = kv.clone()
    seqs = [
        (a[5:], [5, 6, 7], sa[:5], sa[5:], None),
        (t[3:], [3, 4, 4, 5], st[:3], st[3:], ancestor_mask([-1, 0, 0, 1])),
        (b[9:], [9], sb[:9], sb[9:], None),
        (c, [0, 1, 2, 3], EMPTY, sc, None),
    ]
    batched = run(ours, kv, seqs).logits
    separate = torch.cat([run(ours, kv_sep, [s]).logits for s in seqs])
    assert_close("batched vs separate", batched, separate)
    assert_close("batched vs separate cache", kv, kv_sep)  # not bitwise: GEMM row blocking differs
    ref = torch.cat([hf_logits(hf, a)[5:], hf_logits(hf, t[:5])[3:], hf_logits(hf, t[:3] + [t[3], t[5]])[-1:],
                     hf_logits(hf, t[:5] + [t[6]])[-1:], hf_logits(hf, b)[9:], hf_logits(hf, c)])  # fmt: skip
    assert_close("batched vs HF", batched, ref)


def test_taps_match_hf_hidden_states(pair):
    hf, ours, _ = pair
    L = ours.config.num_hidden_layers
    ids = torch.randint(0, 512, (7,), generator=torch.Generator().manual_seed(5)).tolist()
    taps_ids = (L - 1, 0, 1)
    out = prefill(ours, ours.new_kv_cache(8), ids, torch.arange(7), tap_layer_ids=taps_ids)
    with torch.no_grad():
        hs = hf(torch.tensor(ids)[None], output_hidden_states=True).hidden_states
    d = ours.config.hidden_size
    assert out.taps.shape == (7, len(taps_ids) * d)
    for k, i in enumerate(taps_ids):
        tap = out.taps[:, k * d : (k + 1) * d]
        if i == L - 1:  # HF overwrites its last hidden state with the final-normed one; ours is pre-norm
            assert_close(f"tap {i} (normed)", ours.model.norm(tap), hs[i + 1][0])
        else:
            assert_close(f"tap {i}", tap, hs[i + 1][0])


def test_absorbed_equals_naive_mla(pair):
    _, ours, _ = pair
    g = torch.Generator().manual_seed(6)
    N, rope = 9, ours.model.rotary_emb
    backend = make_attention_backend("torch")
    for layer in ours.model.layers:
        attn = layer.self_attn
        h = torch.randn(N, ours.config.hidden_size, generator=g)
        pos = torch.arange(100, 100 + N)
        with torch.no_grad():
            naive = naive_mla(attn, h, pos, torch.ones(N, N, dtype=torch.bool).tril(), rope)
            meta = AttentionMetadata((SeqAttention(0, N, EMPTY, torch.arange(N), None),))
            absorbed = attn(h, pos, meta, torch.zeros(N, ours.config.kv_cache_width), backend, rope)
        assert_close("absorbed vs naive", absorbed, naive)


def test_attention_layer_matches_hf_on_small_inputs(pair):
    """Per-layer MLA vs HF on tiny activations, where the q_a/kv_a layernorm eps (1e-6) is visible."""
    hf, ours, _ = pair
    N, d = 6, ours.config.hidden_size
    g = torch.Generator().manual_seed(11)
    pos = torch.arange(20, 20 + N)
    causal = torch.full((N, N), float("-inf")).triu(1)[None, None]
    meta = AttentionMetadata((SeqAttention(0, N, EMPTY, torch.arange(N), None),))
    for hf_layer, layer in zip(hf.model.layers, ours.model.layers, strict=True):
        h = torch.randn(N, d, generator=g) * 3e-3
        with torch.no_grad():
            cos_sin = hf.model.rotary_emb(h[None], pos[None])
            ref = hf_layer.self_attn(hidden_states=h[None], position_embeddings=cos_sin, attention_mask=causal)[0][0]
            got = layer.self_attn(h, pos, meta, ours.new_kv_cache(N)[0], ours.attn_backend, ours.model.rotary_emb)
        assert_close("attention layer", got, ref, abs_tol=1e-5 * ref.abs().max().item())


def test_attention_errors():
    with pytest.raises(ValueError, match=r"'flash'.*choices.*torch"):
        make_attention_backend("flash")
    with pytest.raises(ValueError, match="q_start"):
        AttentionMetadata((SeqAttention(1, 2, EMPTY, torch.arange(2)),))


def test_router_matches_hf_with_negative_biased_scores():
    """Masked groups must be -inf, not 0: visible only when every biased score s + bias is negative."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter as HFRouter

    from ddtree.models.deepseek_v3.moe import DeepseekV3TopkRouter

    cfg = {**BASE, "n_routed_experts": 16, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3}
    g = torch.Generator().manual_seed(10)
    hf = HFRouter(HFConfig(**cfg))
    ours = DeepseekV3TopkRouter(DeepseekV3Config.from_dict(cfg))
    with torch.no_grad():
        hf.weight.copy_(torch.randn(16, 128, generator=g) * 0.1)
        hf.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.05 - 1.5)
        ours.weight.copy_(hf.weight)
        ours.e_score_correction_bias.copy_(hf.e_score_correction_bias)
        x = torch.randn(64, 128, generator=g)
        _, ref_w, ref_idx = hf(x)
        w, idx = ours(x)
    ref_idx, order = ref_idx.sort(dim=-1)
    idx, our_order = idx.sort(dim=-1)
    assert torch.equal(idx, ref_idx)
    assert_close("router weights", w.gather(1, our_order), ref_w.gather(1, order))


# ---- loader -------------------------------------------------------------------------------------------
def test_sharded_checkpoint_loads_identically(tmp_path):
    single = save_hf_checkpoint(CONFIGS["qlora_group2"], tmp_path / "single")
    sharded = save_hf_checkpoint(CONFIGS["qlora_group2"], tmp_path / "sharded", max_shard_size="100KB")
    assert not (sharded / "model.safetensors").exists()
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 2
    ours, other = load_target(single), load_target(sharded)
    a, b = ours.state_dict(), other.state_dict()
    assert set(a) == set(b) == set(weight_map)  # our module names are exactly the saved names
    for k in a:
        assert torch.equal(a[k], b[k]), k
    picked = load_tensors(sharded, ["lm_head.weight", "model.embed_tokens.weight"])
    assert torch.equal(picked["lm_head.weight"], ours.lm_head.weight)
    assert torch.equal(picked["model.embed_tokens.weight"], ours.embed_tokens.weight)


def _rewrite(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    with safe_open(src / "model.safetensors", framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_loader_errors_name_the_tensor(pair, tmp_path):
    _, ours, path = pair
    name = "model.layers.1.self_attn.kv_b_proj.weight"

    bad = _rewrite(path, tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"missing tensors: 1 \[" + name):
        load_target(bad)

    extra = "model.layers.0.self_attn.extra.weight"
    bad = _rewrite(path, tmp_path / "extra", lambda t: t.__setitem__(extra, torch.zeros(2)))
    with pytest.raises(CheckpointError, match="unexpected tensors: 1 \\[" + extra):
        load_target(bad)

    def shrink(t):
        t[name] = t[name][:-1].contiguous()

    bad = _rewrite(path, tmp_path / "shape", shrink)
    shape = list(ours.state_dict()[name].shape)
    rows, cols = shape
    msg = rf"{name}: checkpoint shape \[{rows - 1}, {cols}\] != model shape \[{rows}, {cols}\]"
    with pytest.raises(CheckpointError, match=msg):
        load_target(bad)

    L = ours.config.num_hidden_layers  # MTP layer after the last decoder layer: skipped
    ok = _rewrite(path, tmp_path / "mtp", lambda t: t.__setitem__(f"model.layers.{L}.eh_proj.weight", torch.ones(3)))
    assert torch.equal(load_target(ok).lm_head.weight, ours.lm_head.weight)

    with pytest.raises(CheckpointError, match="nope.weight"):
        load_tensors(path, ["nope.weight"])


def test_loader_dtype_and_quantization(pair, tmp_path):
    _, ours, path = pair
    m = load_target(path, dtype=torch.bfloat16)
    gate = "model.layers.1.mlp.gate"
    assert m.get_submodule(gate).weight.dtype == torch.float32
    assert m.get_submodule(gate).e_score_correction_bias.dtype == torch.float32
    assert m.lm_head.weight.dtype == torch.bfloat16 and m.new_kv_cache(4).dtype == torch.bfloat16
    ids = list(range(5, 13))
    out16 = prefill(m, m.new_kv_cache(8), ids, torch.arange(8), tap_layer_ids=(0,))
    out32 = prefill(ours, ours.new_kv_cache(8), ids, torch.arange(8))
    assert out16.logits.dtype == torch.float32 and out16.taps.dtype == torch.bfloat16
    assert_close("bf16 vs fp32 logits", out16.logits, out32.logits, abs_tol=0.05, rel_tol=0.05, cos_tol=1e-3)
    q = tmp_path / "fp8"
    q.mkdir()
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (q / "config.json").write_text(json.dumps(cfg))
    shutil.copy(path / "model.safetensors", q / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"quantization: fp8.*missing tensors: .*weight_scale_inv"):
        load_target(q)  # an fp8 config over unquantized weights


# ---- config -------------------------------------------------------------------------------------------
def test_both_rope_spellings(pair, tmp_path):
    hf, ours, path = pair
    saved = json.loads((path / "config.json").read_text())
    assert "rope_parameters" in saved and "rope_scaling" not in saved  # HF 5.x spelling
    assert saved["head_dim"] == 8  # the RoPE width, not the head size
    cfg = DeepseekV3Config.from_dict(saved)
    assert cfg.qk_head_dim == 24 and cfg.kv_cache_width == 40
    assert math.isclose(cfg.softmax_scale, 24**-0.5 * (0.1 * math.log(32) + 1) ** 2)
    assert abs(cfg.softmax_scale - 0.370130) < 1e-6
    legacy = tmp_path / "legacy"
    shutil.copytree(path, legacy)
    src = CONFIGS["qlora_group2" if cfg.q_lora_rank else "qproj_allmoe"]
    (legacy / "config.json").write_text(json.dumps(src))
    assert DeepseekV3Config.from_dict(src) == cfg
    ids = list(range(3, 12))
    out = prefill(load_target(legacy), ours.new_kv_cache(9), ids, torch.arange(9))
    assert_close("legacy-config logits", out.logits, hf_logits(hf, ids))


def test_config_variants_and_validation():
    cfg = DeepseekV3Config.from_dict(BASE)
    assert cfg.eos_token_ids == (1,) and cfg.eos_token_id == 1
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert DeepseekV3Config.from_dict({**BASE, "eos_token_id": [5, 6]}).eos_token_ids == (5, 6)
    kimi = DeepseekV3Config.from_dict({**BASE, "model_type": "kimi_k2"})
    assert kimi.model_type == "kimi_k2" and kimi.softmax_scale == cfg.softmax_scale
    wrapped = DeepseekV3Config.from_dict({"model_type": "kimi_k25", "text_config": {**BASE, "model_type": "kimi_k2"}})
    assert wrapped.hidden_size == 128 and wrapped.rope == cfg.rope
    assert DeepseekV3Config.from_dict(cfg.to_hf_dict()) == cfg
    assert DeepseekV3Config.from_dict({**BASE, "rope_scaling": None}).softmax_scale == 24**-0.5
    for key, value in [("qk_rope_head_dim", 7), ("hidden_size", 0), ("topk_group", 3), ("n_group", 3),
                       ("num_key_value_heads", 2), ("scoring_func", "softmax"), ("kv_lora_rank", None)]:  # fmt: skip
        with pytest.raises(ValueError, match=key):
            DeepseekV3Config.from_dict({**BASE, key: value})
    with pytest.raises(ValueError, match="model_type"):
        DeepseekV3Config.from_dict({**BASE, "model_type": "llama"})
    # quantization_config is a storage detail for the loader, not part of the architecture
    assert DeepseekV3Config.from_dict({**BASE, "quantization_config": {"quant_method": "compressed-tensors"}}) == cfg


# ---- RoPE -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,theta,factor,beta_fast,dr", [("kimi", 50000.0, 32.0, 1.0, 64), ("dsv3", 1e4, 40.0, 32.0, 64)]
)
def test_yarn_inv_freq_matches_hf(name, theta, factor, beta_fast, dr):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = dict(type="yarn", factor=factor, beta_fast=beta_fast, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                   original_max_position_embeddings=4096)  # fmt: skip
    d = {**BASE, "qk_rope_head_dim": dr, "rope_theta": theta, "rope_scaling": scaling,
         "max_position_embeddings": 163840}  # fmt: skip
    ref, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](HFConfig(**d))
    cfg = DeepseekV3Config.from_dict(d)
    ours = yarn_inv_freq(cfg.rope, dr)
    assert torch.equal(ours, ref), name
    assert rope_attention_factor(cfg.rope) == ref_factor == 1.0
    base = 1.0 / theta ** (torch.arange(0, dr, 2, dtype=torch.float32) / dr)
    kept = (ours == base).sum().item()
    assert kept == (20 if name == "kimi" else 11)  # Kimi: hard switch at pair 19/20; DeepSeek: ramp from 10


def test_interleaved_rope_matches_hf_after_permutation():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    dr, T, H = 8, 5, 3
    cfg = DeepseekV3Config.from_dict(BASE)
    inv = yarn_inv_freq(cfg.rope, dr)
    pos = torch.tensor([0, 1, 7, 300, 1000])
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(T, H, dr, generator=g), torch.randn(T, dr, generator=g)
    freqs = pos[:, None].float() * inv
    emb = torch.cat([freqs, freqs], dim=-1)
    q_ref, k_ref = apply_rotary_pos_emb_interleave(
        q.transpose(0, 1)[None], k[None, None], emb.cos()[None], emb.sin()[None]
    )  # [1, H, T, dr], [1, 1, T, dr]
    perm = torch.cat([torch.arange(0, dr, 2), torch.arange(1, dr, 2)])  # HF returns pairs de-interleaved
    assert_close("q_pe", apply_rope_interleaved(q, pos, inv)[..., perm], q_ref[0].transpose(0, 1))
    assert_close("k_pe", apply_rope_interleaved(k, pos, inv)[..., perm], k_ref[0, 0])


# ---- random checkpoint --------------------------------------------------------------------------------
def test_random_target_is_reproducible_and_hf_loadable(tmp_path):
    small = {**DEFAULT_TARGET_CONFIG, "num_hidden_layers": 2, "vocab_size": 1024}
    a = write_random_target(tmp_path / "a", small, seed=3)
    b = write_random_target(tmp_path / "b", small, seed=3)
    c = write_random_target(tmp_path / "c", small, seed=4)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["rope_scaling"]["type"] == "yarn" and "rope_parameters" not in cfg
    ours = load_target(a)
    bias = ours.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().max() > 0
    hf = HFModel.from_pretrained(a, attn_implementation="eager", dtype=torch.float32).eval()
    ids = torch.randint(0, 1024, (6,), generator=torch.Generator().manual_seed(8)).tolist()
    out = prefill(ours, ours.new_kv_cache(6), ids, torch.arange(6))
    assert_close("random target vs HF", out.logits, hf_logits(hf, ids))


def test_default_target_config_shape():
    cfg = DeepseekV3Config.from_dict(DEFAULT_TARGET_CONFIG)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.kv_cache_width) == (256, 4, 80)
    assert abs(cfg.softmax_scale - 48**-0.5 * (0.1 * math.log(32) + 1) ** 2) < 1e-12


# ---- the comparator itself ----------------------------------------------------------------------------
def test_comparator_catches_mismatches():
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(9))
    assert_close("same", x, x.clone())
    assert_close("tiny fp32 noise", x, x * (1 + 1e-6))
    y = x.clone()
    y[2, 3] += 1e-3
    with pytest.raises(AssertionError, match=r"95\.0000% of 20 .*worst at \(2, 3\)"):
        assert_close("one off", y, x)
    with pytest.raises(AssertionError, match="NaN"):
        assert_close("nan", torch.where(x > 0, x, float("nan")), x)
    with pytest.raises(AssertionError, match="inf"):
        assert_close("inf sign", torch.tensor([float("inf")]), torch.tensor([float("-inf")]))
    with pytest.raises(AssertionError, match="shape"):
        assert_close("shape", x, x.T)
    with pytest.raises(AssertionError, match="cosine"):
        assert_close("scaled", x * 1.05, x, abs_tol=1.0, rel_tol=1.0, cos_tol=1e-5)
    xb = x.bfloat16()
    assert_close("bf16 rounding passes bf16 defaults", xb, x)
    with pytest.raises(AssertionError):
        assert_close("bf16 rounding fails fp32 tolerances", xb.float(), x)

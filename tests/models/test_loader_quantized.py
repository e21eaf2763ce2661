"""Loading FP8 block-scaled, INT4 pack-quantized, sharded and kimi_k25-wrapped checkpoints, whole and sliced.

Quantized weights load packed (the stored bytes as they are, in Int4Linear / Fp8Linear / stacked int4 /
fp8 experts) or, with dequantize=True, dequantized into plain modules; both give the same logits.
References: FP8 against transformers' own FP8 loader (it dequantizes on the CPU; it needs block-divisible
shapes, so that case uses 8x8 blocks) and against an independent repeat_interleave dequant with ragged
16x32 blocks; INT4 against compressed-tensors' `unpack_from_int32` (when installed) and a brute-force
bit-by-bit unpack written here.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from ddtree.models.checkpoint.files import CheckpointFiles
from ddtree.models.checkpoint.loader import CheckpointError, TensorSlice, load_target, load_tensors
from ddtree.models.deepseek_v3.model import DeepseekV3ForCausalLM
from ddtree.models.quantization import unpack_int4
from ddtree.tools.selftest.compare import assert_close
from tests.support.quantized_checkpoints import (
    FP8_BLOCK,
    FP32_KEPT,
    INT4_GROUP,
    TINY,
    apply_slice,
    dense_weights,
    dequant_fp8_reference,
    is_routed_expert,
    logits,
    odd_slices,
    shrink_to_slices,
    state_dict_of,
    write_variant,
)  # fmt: skip

IDS = [5, 17, 3, 99, 250, 7, 42, 1, 300, 11]


def reference_model(tmp, name, tensors):
    """Our model loaded from a plain fp32 checkpoint of `tensors` (the independently dequantized weights)."""
    root, _ = write_variant(tmp / name, "fp32")
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(root / "model.safetensors"))
    return load_target(root)


# ---- FP8 ---------------------------------------------------------------------------------------------
def test_fp8_matches_independent_dequant(tmp_path):
    root, source = write_variant(tmp_path / "fp8", "fp8", shards=3, fp8_skip=("model.layers.1.mlp.shared_experts",))
    stored = {}
    for f in root.glob("*.safetensors"):
        stored.update(load_file(f))
    assert stored["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.1.mlp.shared_experts.up_proj.weight"].dtype == torch.float32  # ignored module
    expect = {}
    for n, t in source.items():
        scale = stored.get(n + "_scale_inv")
        expect[n] = t if scale is None else dequant_fp8_reference(stored[n], scale)
    got = _loads_as(root, expect, stored, tmp_path, "fp8", "dequantized")
    # the quantization itself is real: fp8 weights differ from the source but stay close
    w = "model.layers.2.self_attn.q_b_proj.weight"
    assert not torch.equal(got[w], source[w])
    assert_close("fp8 vs source weight", got[w], source[w], abs_tol=0.1 * source[w].abs().max().item(), rel_tol=0.07,
                 cos_tol=1e-3)  # fmt: skip


def test_fp8_matches_transformers(tmp_path):
    pytest.importorskip("accelerate")  # transformers' FP8 loader needs it
    from transformers import DeepseekV3ForCausalLM as HFModel

    # transformers' CPU dequant needs every dimension divisible by the block
    cfg = {**TINY, "hidden_size": 128, "q_lora_rank": 48, "moe_intermediate_size": 64, "intermediate_size": 192}
    root, _ = write_variant(tmp_path / "fp8hf", "fp8", cfg=cfg, fp8_block=(8, 8))
    config = json.loads((root / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [8, 8]
    hf = HFModel.from_pretrained(root, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(IDS)[None]).logits[0].float()
    ours = load_target(root)
    assert_close("fp8 logits vs transformers", logits(ours, IDS), ref)


# ---- INT4 --------------------------------------------------------------------------------------------
def brute_force_unpack(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """Bit by bit: column 8w+k = ((word >> 4k) & 15) - 8, on the unsigned 32-bit value of each word."""
    u = packed.to(torch.int64) % (1 << 32)
    out = torch.empty(packed.shape[0], packed.shape[1] * 8, dtype=torch.int64)
    for k in range(8):
        out[:, k::8] = ((u >> (4 * k)) & 15) - 8
    return out[:, :cols]


def test_int4_unpack_matches_compressed_tensors():
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(-(2**31), 2**31 - 1, (5, 7), dtype=torch.int32, generator=g)
    assert torch.equal(unpack_int4(packed).long(), brute_force_unpack(packed, 56))
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    assert torch.equal(unpack_int4(packed)[:, :53], ct.unpack_from_int32(packed, 4, torch.Size([5, 53])))
    q = torch.randint(-8, 8, (6, 44), dtype=torch.int8, generator=g)
    assert torch.equal(unpack_int4(ct.pack_to_int32(q, 4))[:, :44], q)  # their packing, our unpacking


def test_int4_matches_unpacked_reference(tmp_path):
    root, source = write_variant(tmp_path / "int4", "int4", shards=2)
    stored = {}
    for f in root.glob("*.safetensors"):
        stored.update(load_file(f))
    ct = None
    try:
        from compressed_tensors.compressors.pack_quantized import helpers as ct
    except ImportError:
        pass
    expect = {}
    for n, t in source.items():
        if not is_routed_expert(n):
            assert n in stored and stored[n].dtype == torch.float32
            expect[n] = t
            continue
        stem = n.removesuffix(".weight")
        packed, scale, shape = (stored[stem + s] for s in (".weight_packed", ".weight_scale", ".weight_shape"))
        assert scale.dtype == torch.bfloat16 and shape.tolist() == list(t.shape)
        q = brute_force_unpack(packed, t.shape[1])
        if ct is not None:
            assert torch.equal(ct.unpack_from_int32(packed, 4, torch.Size(t.shape)).long(), q), n
        expect[n] = q.float() * scale.float().repeat_interleave(INT4_GROUP, 1)[:, : t.shape[1]]
    got = _loads_as(root, expect, stored, tmp_path, "int4", "unpacked")
    w = "model.layers.1.mlp.experts.3.down_proj.weight"  # in = 44: a ragged last group and word
    assert_close("int4 vs source", got[w], source[w], abs_tol=0.25 * source[w].abs().max().item(), rel_tol=0.3,
                 cos_tol=1e-2)  # fmt: skip


# ---- sharded, sliced, kimi_k25 -------------------------------------------------------------------------
def test_sharded_bf16_equals_single(tmp_path):
    single, source = write_variant(tmp_path / "one", "bf16")
    sharded, _ = write_variant(tmp_path / "many", "bf16", shards=4)
    assert not (sharded / "model.safetensors").exists()
    a, b = state_dict_of(load_target(single)), state_dict_of(load_target(sharded))
    assert set(a) == set(b) == set(source)
    for n in a:
        want = torch.float32 if n.endswith(FP32_KEPT) else torch.bfloat16
        assert a[n].dtype == want, n  # dtype=None: the stored dtype of embed_tokens; the router stays fp32
        assert torch.equal(a[n], b[n]) and torch.equal(a[n], source[n].to(want)), n
    assert_close("bf16 logits, sharded vs single", logits(load_target(sharded), IDS), logits(load_target(single), IDS))
    fp32 = load_target(sharded, dtype=torch.float32)
    assert fp32.lm_head.weight.dtype == torch.float32


@pytest.mark.parametrize("kind", ["bf16", "fp8", "int4"])
def test_slice_of_gives_exact_slices(tmp_path, kind):
    """Dequantizing loads (and plain weights) take any slice, unaligned ones included."""
    root, _ = write_variant(tmp_path / kind, kind, shards=2)
    full = state_dict_of(load_target(root, dtype=torch.bfloat16, dequantize=True))
    slice_of = odd_slices({n: tuple(t.shape) for n, t in full.items()})
    dims = {slice_of(n).dim for n in full if slice_of(n) is not None and full[n].dim() == 2}
    assert dims == {0, 1}
    build = lambda c: shrink_to_slices(DeepseekV3ForCausalLM(c), slice_of)  # noqa: E731
    part = load_target(root, dtype=torch.bfloat16, slice_of=slice_of, build_model=build, dequantize=True)
    got = state_dict_of(part)
    for n, t in full.items():
        assert torch.equal(got[n], apply_slice(t, slice_of(n))), n


def whole_block_slices(shapes: dict[str, tuple[int, ...]], unit: tuple[int, int]):
    """A slice_of that cuts every 2-D weight from its second block (rows / cols in `unit`) to the edge,
    alternating dims by name (all experts of one layer and projection alike)."""

    def slice_of(name: str) -> TensorSlice | None:
        shape = shapes[name]
        if len(shape) != 2 or "norm" in name:
            return None
        dim = sum(map(ord, re.sub(r"experts\.\d+\.", "", name))) % 2
        return TensorSlice(dim, unit[dim], shape[dim]) if shape[dim] > unit[dim] else None

    return slice_of


@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_packed_slices_cut_whole_blocks(tmp_path, kind):
    """Packed weights load sliced on whole FP8 blocks / INT4 groups: the rank's packed tensors dequantize to
    exactly the slice of the whole weight; a cut through a block or group is refused by name."""
    root, _ = write_variant(tmp_path / kind, kind, shards=2)
    whole = load_target(root, dtype=torch.bfloat16)
    full = dense_weights(whole)
    unit = FP8_BLOCK if kind == "fp8" else (7, INT4_GROUP)  # INT4 scales are per row: any row bound
    slice_of = whole_block_slices({n: tuple(t.shape) for n, t in full.items()}, unit)
    build = lambda c: shrink_to_slices(DeepseekV3ForCausalLM(c), slice_of)  # noqa: E731
    part = load_target(root, dtype=torch.bfloat16, slice_of=slice_of, build_model=build)
    got = dense_weights(part)
    packed = [n for n in full if ".mlp.experts." in n or (kind == "fp8" and "_proj" in n)]
    assert packed and {slice_of(n).dim for n in packed if slice_of(n)} == {0, 1}
    dequantized = state_dict_of(load_target(root, dtype=torch.float32, dequantize=True))
    for n, t in full.items():
        assert torch.equal(got[n], apply_slice(t, slice_of(n))), n
        if n in packed:  # the modules' own dequantization == the loader's
            assert torch.equal(got[n], apply_slice(dequantized[n], slice_of(n))), n
    shapes = {n: t.tolist() for n, t in part.state_dict().items() if n.endswith(".weight_shape")}
    assert len(shapes) == (48 if kind == "int4" else 0)  # 2 MoE layers x 8 experts x 3 projections
    for n, shape in shapes.items():  # the rank's own [rows, cols], not the checkpoint's
        assert shape == list(got[n.removesuffix("_shape")].shape), n
    assert kind == "fp8" or shapes["model.layers.1.mlp.experts.5.down_proj.weight_shape"] != [96, 44]

    cut = "model.layers.1.mlp.experts.0.up_proj.weight" if kind == "int4" else "model.layers.2.self_attn.o_proj.weight"

    def bad(n: str) -> TensorSlice | None:  # columns from 8: inside the first FP8 block / INT4 group
        same = re.sub(r"experts\.\d+", "e", n) == re.sub(r"experts\.\d+", "e", cut)
        return TensorSlice(1, 8, full[cut].shape[1]) if same else None

    with pytest.raises(CheckpointError, match="whole"):
        load_target(root, slice_of=bad, build_model=lambda c: shrink_to_slices(DeepseekV3ForCausalLM(c), bad))


def test_kimi_k25_wrapped_int4(tmp_path):
    plain, _ = write_variant(tmp_path / "plain", "int4")
    wrapped, _ = write_variant(tmp_path / "k25", "int4", kimi_k25=True)
    cfg = json.loads((wrapped / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k25" and "quantization_config" in cfg["text_config"]
    a, b = state_dict_of(load_target(plain)), state_dict_of(load_target(wrapped))
    assert set(a) == set(b)
    for n in a:
        assert torch.equal(a[n], b[n]), n
    assert torch.equal(load_tensors(wrapped, ["lm_head.weight"])["lm_head.weight"], a["lm_head.weight"])


def test_skip_drops_experts_without_reading_them(tmp_path):
    root, source = write_variant(tmp_path / "ep", "fp8")
    mine = lambda name: ".mlp.experts." not in name or int(name.split(".mlp.experts.")[1].split(".")[0]) < 4  # noqa: E731

    def build(config):
        model = DeepseekV3ForCausalLM(config)
        for layer in model.model.layers[config.first_k_dense_replace :]:
            layer.mlp.keep_experts(0, 4)  # this rank holds experts 0..3
        return model

    full = state_dict_of(load_target(root))
    tensors = load_file(root / "model.safetensors")  # break every tensor of the skipped experts: never read
    for n in tensors:
        if ".mlp.experts." in n and not mine(n.removesuffix("_scale_inv")):
            tensors[n] = torch.zeros(1, dtype=tensors[n].dtype)
    del tensors["model.layers.2.mlp.experts.7.up_proj.weight_scale_inv"]
    save_file(tensors, str(root / "model.safetensors"))
    part = state_dict_of(load_target(root, build_model=build, skip=lambda n: not mine(n)))
    assert set(part) == {n for n in full if mine(n)} and len(part) < len(full)
    for n, t in part.items():
        assert torch.equal(t, full[n]), n


def test_both_rope_spellings_give_the_same_model(tmp_path):
    legacy, _ = write_variant(tmp_path / "legacy", "fp32")
    cfg = json.loads((legacy / "config.json").read_text())
    modern = tmp_path / "modern"
    modern.mkdir()
    scaling = cfg.pop("rope_scaling")
    cfg["rope_parameters"] = {**{k: v for k, v in scaling.items() if k != "type"}, "rope_type": "yarn",
                              "rope_theta": cfg.pop("rope_theta")}  # fmt: skip
    cfg["head_dim"] = cfg["qk_rope_head_dim"]  # as transformers writes it
    (modern / "config.json").write_text(json.dumps(cfg))
    (modern / "model.safetensors").symlink_to(legacy / "model.safetensors")
    a, b = load_target(legacy), load_target(modern)
    assert a.config == b.config
    assert torch.equal(a.model.rotary_emb.inv_freq, b.model.rotary_emb.inv_freq)
    assert torch.equal(logits(a, IDS), logits(b, IDS))


def test_slices_read_only_the_covering_blocks(tmp_path, monkeypatch):
    """FP8: a slice reads its rows/cols of the weight and only the scale blocks covering them; INT4: the
    packed words and scales of the covering groups. Dequantizing, unaligned slices still equal the full
    load's slice; packed, whole-block slices read the same bytes and dequantize to the same values."""
    reads = []
    real_read = CheckpointFiles.read

    def spy(self, name, rows=None, cols=None):
        reads.append((name, rows, cols))
        return real_read(self, name, rows, cols)

    monkeypatch.setattr(CheckpointFiles, "read", spy)
    fp8, _ = write_variant(tmp_path / "fp8", "fp8")
    int4, _ = write_variant(tmp_path / "int4", "int4")
    kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"  # [40, 96], blocks 16x32: rows 32..39 ragged
    down = "model.layers.1.mlp.experts.2.down_proj.weight"  # [96, 44]: groups 0..31, 32..43; words of 8
    dequantizing = [
        (fp8, kv_a, TensorSlice(0, 37, 38), {kv_a + "_scale_inv": (slice(2, 3), slice(0, 3)), kv_a: (slice(37, 38), slice(0, 96))}),
        (fp8, kv_a, TensorSlice(1, 31, 33), {kv_a + "_scale_inv": (slice(0, 3), slice(0, 2)), kv_a: (slice(0, 40), slice(31, 33))}),
        (fp8, kv_a, TensorSlice(1, 95, 96), {kv_a + "_scale_inv": (slice(0, 3), slice(2, 3))}),
        (int4, down, TensorSlice(1, 33, 40), {down + "_packed": (slice(0, 96), slice(4, 6)), down + "_scale": (slice(0, 96), slice(1, 2))}),
        (int4, down, TensorSlice(1, 5, 36), {down + "_packed": (slice(0, 96), slice(0, 6)), down + "_scale": (slice(0, 96), slice(0, 2))}),
        (int4, down, TensorSlice(0, 10, 20), {down + "_packed": (slice(10, 20), slice(0, 6))}),
    ]  # fmt: skip
    packed = [
        (fp8, kv_a, TensorSlice(0, 32, 40), {kv_a + "_scale_inv": (slice(2, 3), slice(0, 3)), kv_a: (slice(32, 40), slice(0, 96))}),
        (fp8, kv_a, TensorSlice(1, 32, 64), {kv_a + "_scale_inv": (slice(0, 3), slice(1, 2)), kv_a: (slice(0, 40), slice(32, 64))}),
        (int4, down, TensorSlice(1, 32, 44), {down + "_packed": (slice(0, 96), slice(4, 6)), down + "_scale": (slice(0, 96), slice(1, 2))}),
        (int4, down, TensorSlice(0, 10, 20), {down + "_packed": (slice(10, 20), slice(0, 6)),
                                               down + "_scale": (slice(10, 20), slice(0, 2))}),
    ]  # fmt: skip
    for dequantize, cases in ((True, dequantizing), (False, packed)):
        for root, name, sl, expected_reads in cases:
            full = dense_weights(load_target(root, dequantize=dequantize))[name]
            same = re.sub(r"experts\.\d+\.", "", name)  # stacked experts: all of the layer's projection
            pick = lambda n, sl=sl, same=same: sl if re.sub(r"experts\.\d+\.", "", n) == same else None  # noqa: E731
            reads.clear()
            part = load_target(
                root,
                slice_of=pick,
                build_model=lambda c, p=pick: shrink_to_slices(DeepseekV3ForCausalLM(c), p),
                dequantize=dequantize,
            )
            assert torch.equal(dense_weights(part)[name], apply_slice(full, sl)), (name, sl)
            seen = {n: (r, c) for n, r, c in reads if n.startswith(name.removesuffix("weight"))}
            for stored, (rows, cols) in expected_reads.items():
                assert seen[stored] == (rows, cols), (dequantize, sl, stored, seen[stored])


def _loads_as(root, expect: dict, stored: dict, tmp_path, name: str, how: str) -> dict:
    """load_target(root, dequantize=True) holds exactly `expect` (the independently decoded weights), the
    packed load_target(root) exactly the `stored` tensors (quantized ones as stored, same dtypes), and both
    give the logits of a plain model built from `expect`; returns the dequantized state dict."""
    deq = load_target(root, dequantize=True)
    got = state_dict_of(deq)
    for n, t in expect.items():
        assert torch.equal(got[n], t), n
    packed = load_target(root)
    held = state_dict_of(packed)
    assert set(held) == set(stored)
    for n, t in held.items():
        assert t.dtype == stored[n].dtype and torch.equal(t, stored[n]), n
    ref = logits(reference_model(tmp_path, f"{name}-ref", expect), IDS)
    assert_close(f"{name} logits vs {how} reference", logits(deq, IDS), ref)
    assert_close(f"{name} packed logits vs {how} reference", logits(packed, IDS), ref)
    return got

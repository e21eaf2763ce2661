"""Tiny INT4 and FP8 checkpoints served with packed weights: the logits equal those of the same checkpoint
loaded with dequantized weights (dequantize=True) within dtype tolerance, at TP 1 (fp32 and bf16) and,
over 2 gloo ranks (tests/models/test_tp_model.py's worker, the real rank-0 handle and worker loop), at TP 2 and
TP 2 with expert parallelism, eagerly and through every rank's static step: prefill, decode, a tree verify and
a logits-row subset."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as tmp

from ddtree.models.checkpoint.loader import load_target
from ddtree.models.deepseek_v3.moe import DeepseekV3MLP
from ddtree.models.deepseek_v3.moe_experts import StackedExperts
from ddtree.models.layers.packed_linear import Fp8Linear, Int4Linear
from ddtree.tools.selftest.compare import assert_close
from tests.support.quantized_checkpoints import TINY, logits, write_variant
from tests.support.tp_ranks import NUM_SLOTS, WORLD, rank_main, scenario

# widths that cut on whole FP8 16x32 blocks and INT4 groups of 32 at TP 2
CFG = {**TINY, "moe_intermediate_size": 64, "intermediate_size": 192}
IDS = [5, 17, 3, 99, 250, 7, 42, 1, 300, 11, 64, 2]


@pytest.fixture(scope="module", params=["int4", "fp8"])
def ckpt(request, tmp_path_factory):
    root, _ = write_variant(tmp_path_factory.mktemp(request.param) / "ckpt", request.param, cfg=CFG, shards=2)
    return request.param, root


def test_the_model_holds_packed_modules(ckpt):
    kind, root = ckpt
    model = load_target(root)
    experts = [m for m in model.modules() if isinstance(m, StackedExperts)]
    assert experts and all(p.kind == kind for e in experts for p in e.projections())
    linears = [m for m in model.modules() if isinstance(m, (Int4Linear, Fp8Linear))]
    if kind == "fp8":  # every projection outside the experts (lm_head and the embedding stay plain)
        # gate + up of the dense and the 2 shared-expert MLPs (I = 192 / 64: whole 16-row blocks) are one merged
        # Fp8Linear each; q_a (40 rows) cuts a block, so q_a and kv_a stay two
        assert len(linears) == 3 * 5 + 3 * 3 - 3 and all(isinstance(m, Fp8Linear) for m in linears)
        mlps = [m for m in model.modules() if isinstance(m, DeepseekV3MLP)]
        assert len(mlps) == 3 and all(isinstance(m.gate_up_proj, Fp8Linear) for m in mlps)
        assert all(isinstance(m.self_attn.q_a_proj, Fp8Linear) for m in model.model.layers)
    else:  # Kimi's ignore list: only the routed experts are INT4
        assert linears == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_logits_equal_the_dequantized_model(ckpt, dtype):
    kind, root = ckpt
    packed, ref = load_target(root, dtype=dtype), load_target(root, dtype=dtype, dequantize=True)
    assert_close(f"{kind} {dtype} packed vs dequantized", logits(packed, IDS), logits(ref, IDS))


@pytest.fixture(scope="module")
def tp_results(ckpt, tmp_path_factory):
    kind, root = ckpt
    out = tmp_path_factory.mktemp(f"tp-{kind}") / "tp.pt"
    tmp.spawn(rank_main, args=(str(root), str(out)), nprocs=WORLD, join=True)
    model = load_target(root, dtype=torch.float32, dequantize=True)  # the TP 1 reference, dequantized
    kv = model.new_kv_cache(NUM_SLOTS)
    ref = []
    for s in scenario(model.config.vocab_size):
        o = model.forward(s.input_ids, s.positions, s.meta, kv, s.logits_rows, s.tap_layer_ids)
        ref.append((o.logits, o.taps))
    return ref, torch.load(out)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("ep", [False, True], ids=["tensor", "expert"])
def test_tp2_packed_matches_tp1_dequantized(tp_results, ep, static):
    ref, results = tp_results
    if static:  # packed experts through every rank's static step: prefill, decode, verify; the chunk eagerly
        assert results[("replays", ep)] == (3, 1)
    names = ["prefill", "decode", "tree verify", "chunk"]
    for name, (want, taps), (got, argmax, got_taps) in zip(names, ref, results[(ep, static)], strict=True):
        if got is not None:
            assert_close(f"{name} logits", got, want, abs_tol=1e-4)
        assert torch.equal(argmax, want.argmax(dim=-1)), name
        if taps is not None:
            assert_close(f"{name} taps", got_taps, taps, abs_tol=1e-4)


def test_fp8_kv_b_proj_is_dequantized_once_and_again_when_it_changes(ckpt, monkeypatch):
    """Absorbed MLA reads W_UK / W_UV every forward: an FP8 kv_b_proj is dequantized on the first forward
    only, and a change to its packed tensors (in place, as the loader fills them) makes a fresh copy."""
    kind, root = ckpt
    if kind != "fp8":
        pytest.skip("Kimi's INT4 checkpoints keep kv_b_proj in bf16")
    model = load_target(root, dtype=torch.float32)
    calls: list[int] = []
    real = Fp8Linear.dequantized
    monkeypatch.setattr(Fp8Linear, "dequantized", lambda self, dtype=None: calls.append(1) or real(self, dtype))
    layers = model.config.num_hidden_layers
    first = logits(model, IDS)
    assert len(calls) == layers
    assert torch.equal(logits(model, IDS), first) and len(calls) == layers  # the copies were reused
    kv_b = model.model.layers[0].self_attn.kv_b_proj
    with torch.no_grad():
        kv_b.weight_scale_inv.mul_(2.0)  # in place: the key's version changes
    changed = logits(model, IDS)
    assert len(calls) == layers + 1 and not torch.allclose(changed, first)
    with torch.no_grad():
        kv_b.weight_scale_inv.div_(2.0)
    ref = load_target(root, dtype=torch.float32, dequantize=True)
    assert_close("fp8 after the change back", logits(model, IDS), logits(ref, IDS))

"""DFlash drafter (services/models/dflash*.py: config, model, checkpoint), draft context and draft engine."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ddtree.drafter.context import DraftContext
from ddtree.drafter.engine import DraftEngine, SeqDraftInput
from ddtree.models.dflash.checkpoint import load_drafter, write_random_drafter
from ddtree.models.dflash.config import DFlashConfig, default_target_layer_ids
from ddtree.models.dflash.model import DFlashDraftModel, rope_inv_freq
from ddtree.tree.best_first import build_tree, topk_logprobs
from tests.support.dflash_reference import naive_block

TARGET = {"hidden_size": 32, "num_hidden_layers": 6, "vocab_size": 64, "rope_theta": 10000.0}
BLOCK = 5


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_random_drafter(
        tmp_path_factory.mktemp("drafter"),
        TARGET,
        seed=3,
        block_size=BLOCK,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


@pytest.fixture(scope="module")
def model(ckpt: Path) -> DFlashDraftModel:
    return load_drafter(ckpt)


def target_weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g) / 4


def feats(n: int, f: int, seed: int) -> torch.Tensor:
    return torch.randn(n, f, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- naive reference (float64, explicit)


def test_model_matches_naive_reference(ckpt: Path) -> None:
    model = load_drafter(ckpt, dtype=torch.float64)
    cfg = model.config
    state = load_file(str(ckpt / "model.safetensors"))
    n, start = 11, 37
    f = feats(n, cfg.feature_size, 1)
    ctx_pos = torch.arange(start, start + n)
    blk_pos = torch.arange(start + n, start + n + BLOCK)
    embeds = feats(BLOCK, cfg.hidden_size, 2)
    ref = naive_block(state, cfg, f, ctx_pos, embeds, blk_pos)
    got = model.forward_block(embeds, blk_pos, model.context_kv(f, ctx_pos))
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
    # context built incrementally in a DraftContext gives the same result
    ctx = DraftContext()
    for a, b in ((0, 4), (4, 5), (5, 11)):
        ctx.append(model.context_kv(f[a:b], ctx_pos[a:b]), ctx_pos[a:b])
    torch.testing.assert_close(model.forward_block(embeds, blk_pos, ctx.kv), ref, atol=1e-6, rtol=1e-6)
    # the reference has power: shifted positions or a dropped context token change the answer
    assert (model.forward_block(embeds, blk_pos + 1, model.context_kv(f, ctx_pos + 1)) - ref).abs().max() < 1e-6
    assert (model.forward_block(embeds, blk_pos, model.context_kv(f[1:], ctx_pos[1:])) - ref).abs().max() > 1e-3
    assert (model.forward_block(embeds, blk_pos, model.context_kv(f, ctx_pos - 1)) - ref).abs().max() > 1e-3


def test_float32_model_close_to_reference(model: DFlashDraftModel, ckpt: Path) -> None:
    cfg = model.config
    f, e = feats(6, cfg.feature_size, 3), feats(BLOCK, cfg.hidden_size, 4)
    pos = torch.arange(0, 6 + BLOCK)
    ref = naive_block(load_file(str(ckpt / "model.safetensors")), cfg, f, pos[:6], e, pos[6:])
    got = model.forward_block(e, pos[6:], model.context_kv(f, pos[:6]))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-4)


def test_windowed_context_equals_fresh(model: DFlashDraftModel) -> None:
    cfg, window = model.config, 7
    f = feats(20, cfg.feature_size, 5)
    pos = torch.arange(100, 120)
    ctx = DraftContext(window)
    for a, b in ((0, 3), (3, 12), (12, 13), (13, 20)):
        ctx.append(model.context_kv(f[a:b], pos[a:b]), pos[a:b])
        assert ctx.length == min(b, window) and ctx.end == 100 + b and ctx.start == 100 + b - ctx.length
    fresh = model.context_kv(f[-window:], pos[-window:])
    for (k, v), (fk, fv) in zip(ctx.kv, fresh):
        torch.testing.assert_close(k, fk)
        torch.testing.assert_close(v, fv)
    blk_pos, e = torch.arange(120, 120 + BLOCK), feats(BLOCK, cfg.hidden_size, 6)
    torch.testing.assert_close(model.forward_block(e, blk_pos, ctx.kv), model.forward_block(e, blk_pos, fresh))
    full = model.forward_block(e, blk_pos, model.context_kv(f, pos))
    assert (full - model.forward_block(e, blk_pos, ctx.kv)).abs().max() > 1e-4  # the window matters
    assert ctx.nbytes == 2 * cfg.num_hidden_layers * window * cfg.num_key_value_heads * cfg.head_dim * 4


def test_draft_context_errors(model: DFlashDraftModel) -> None:
    f = feats(4, model.config.feature_size, 0)
    ctx = DraftContext(0)
    with pytest.raises(ValueError, match="positions must be contiguous"):
        ctx.append(model.context_kv(f, torch.tensor([0, 1, 3, 4])), torch.tensor([0, 1, 3, 4]))
    ctx.append(model.context_kv(f, torch.arange(4)), torch.arange(4))
    with pytest.raises(ValueError, match="positions start at 5, the context ends at 4"):
        ctx.append(model.context_kv(f, torch.arange(5, 9)), torch.arange(5, 9))
    with pytest.raises(ValueError, match="got K/V for 1 layers, the context holds 2"):
        ctx.append(model.context_kv(f, torch.arange(4, 8))[:1], torch.arange(4, 8))
    with pytest.raises(ValueError, match="K/V have 4/4 rows for 3 positions"):
        ctx.append(model.context_kv(f, torch.arange(4, 8)), torch.arange(4, 7))
    with pytest.raises(ValueError, match="window must be >= 0"):
        DraftContext(-1)


# ---------------------------------------------------------------- config, checkpoint format, loading


def test_default_target_layer_ids() -> None:
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(36, 1) == (18,)
    assert default_target_layer_ids(61, 3) == (1, 30, 58)
    d = {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 5,
        "num_attention_heads": 4,
        "vocab_size": 300,
        "num_target_layers": 36,
        "block_size": 16,
        "dflash_config": {"mask_token_id": 299},
    }
    cfg = DFlashConfig.from_dict(d)
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33) and cfg.feature_size == 5 * 64
    assert cfg.head_dim == 16 and cfg.num_key_value_heads == 4 and cfg.target_hidden_size == 64


def test_checkpoint_format(ckpt: Path, model: DFlashDraftModel) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == BLOCK
    assert cfg["dflash_config"] == {"mask_token_id": 63, "target_layer_ids": [1, 3]}
    keys = set(load_file(str(ckpt / "model.safetensors")))
    assert {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "layers.1.self_attn.q_norm.weight",
        "layers.0.mlp.down_proj.weight",
        "layers.0.post_attention_layernorm.weight",
    } <= keys
    assert not any("embed" in k or "lm_head" in k for k in keys)
    assert tuple(model.fc.weight.shape) == (32, 2 * 32)
    assert DFlashConfig.from_dict(model.config.to_dict()) == model.config


def test_write_is_reproducible(tmp_path: Path) -> None:
    def digest(p: Path) -> str:
        return hashlib.sha256((p / "model.safetensors").read_bytes() + (p / "config.json").read_bytes()).hexdigest()

    a = write_random_drafter(tmp_path / "a", TARGET, seed=1)
    b = write_random_drafter(tmp_path / "b", TARGET, seed=1)
    c = write_random_drafter(tmp_path / "c", TARGET, seed=2)
    assert digest(a) == digest(b) != digest(c)
    tiny = write_random_drafter(tmp_path / "t", {"hidden_size": 16, "num_hidden_layers": 2, "vocab_size": 10})
    assert load_drafter(tiny).config.target_layer_ids == (0, 1)


def _copy(ckpt: Path, dst: Path, edit) -> Path:
    shutil.copytree(ckpt, dst)
    state = load_file(str(dst / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize(
    "name, edit, msg",
    [
        ("missing", lambda s: s.pop("layers.1.mlp.up_proj.weight"), r"missing keys \['layers.1.mlp.up_proj.weight'\]"),
        (
            "unexpected",
            lambda s: s.update({"lm_head.weight": torch.zeros(64, 32)}),
            r"unexpected keys \['lm_head.weight'\]",
        ),
        (
            "shape",
            lambda s: s.update({"fc.weight": torch.zeros(32, 96)}),
            r"shape mismatches \['fc.weight \(32, 96\) != \(32, 64\)'\]",
        ),
    ],
)
def test_strict_loading(ckpt: Path, tmp_path: Path, name: str, edit, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        load_drafter(_copy(ckpt, tmp_path / name, edit))


@pytest.mark.parametrize(
    "edit, msg",
    [
        (lambda c: c.pop("hidden_size"), "missing required field 'hidden_size'"),
        (lambda c: c["dflash_config"].pop("mask_token_id"), "missing required field 'mask_token_id'"),
        (
            lambda c: c.update(layer_types=["full_attention", "sliding_attention"]),
            r"^config.json: sliding_window must be a positive integer for sliding_attention layers, got None$",
        ),
        (
            lambda c: c.update(layer_types=["full_attention", "linear_attention"]),
            r"^config.json: layer_types \['linear_attention'\] not supported",
        ),
        (lambda c: c.update(layer_types=["full_attention"]), "layer_types has 1 entries for num_hidden_layers=2"),
        (
            lambda c: c["dflash_config"].update(draft_shift=2),
            r"^config.json: dflash_config.draft_shift must be true or false, got 2$",
        ),
        (
            lambda c: c["dflash_config"].update(causal_head="yes"),
            r"^config.json: dflash_config.causal_head must be true or false, got 'yes'$",
        ),
        (
            lambda c: c.update(rope_scaling={"type": "dynamic", "factor": 2.0}),
            "unsupported rope_scaling type 'dynamic'",
        ),
        (lambda c: c["dflash_config"].update(target_layer_ids=[1, 9]), r"id 9 outside \[0, num_target_layers=6\)"),
        (lambda c: c.update(num_key_value_heads=3), "not a multiple of num_key_value_heads 3"),
    ],
)
def test_config_errors(ckpt: Path, tmp_path: Path, edit, msg: str) -> None:
    dst = tmp_path / "bad"
    shutil.copytree(ckpt, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=msg):
        load_drafter(dst)
    with pytest.raises(ValueError, match="no config.json"):
        load_drafter(tmp_path)


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    ],
)
def test_rope_scaling_matches_transformers(scaling: dict) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    d = {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "head_dim": 16,
        "vocab_size": 10,
        "max_position_embeddings": 163840,
        "rope_theta": 50000.0,
        "rope_scaling": dict(scaling),
        "dflash_config": {"mask_token_id": 9, "target_layer_ids": [0]},
    }
    inv, scale = rope_inv_freq(DFlashConfig.from_dict(d))
    hf_cfg = transformers.Qwen3Config(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        max_position_embeddings=163840,
        rope_parameters=dict(scaling, rope_theta=50000.0),
    )
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_cfg, "cpu")
    torch.testing.assert_close(inv, ref_inv)
    assert scale == pytest.approx(ref_scale)


def test_load_dtype(ckpt: Path) -> None:
    m = load_drafter(ckpt, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    ctx = m.context_kv(torch.randn(3, 64), torch.arange(3))
    out = m.forward_block(torch.randn(BLOCK, 32), torch.arange(BLOCK), ctx)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


# ---------------------------------------------------------------- engine


def seq(seq_id="s", n=4, start=0, root=5, budget=0, reset=True, f=None, ids=None, fseed=0):
    return SeqDraftInput(
        seq_id=seq_id,
        commit_token_ids=tuple(ids if ids is not None else range(1, n + 1)),
        commit_start=start,
        commit_features=feats(n, 64, fseed) if f is None else f,
        root_token_id=root,
        budget=budget,
        reset=reset,
    )


def test_engine_tree_equals_manual_pipeline(model: DFlashDraftModel) -> None:
    emb, head = target_weights()
    eng = DraftEngine(model, emb, head, window=16)
    s = seq(n=6, start=3, root=7, budget=12)
    tree = eng.draft([s])[0]
    cfg = model.config
    pos = torch.arange(3, 9)
    block = torch.tensor([7] + [cfg.mask_token_id] * (BLOCK - 1))
    hidden = model.forward_block(emb[block], torch.arange(9, 9 + BLOCK), model.context_kv(s.commit_features, pos))
    lp, ids = topk_logprobs(hidden[1:] @ head.T, 12)
    assert tree == build_tree(lp, ids, 12)
    assert tree.n == 12 and tree.max_depth <= BLOCK - 1
    assert eng.context_end("s") == 9 and eng.active_sequences == 1
    # default budget = block_size - 1
    assert eng.draft([seq(n=1, start=9, reset=False)])[0].n == BLOCK - 1
    assert eng.default_budget == BLOCK - 1
    info = eng.info()
    assert info["block_size"] == BLOCK and info["mask_token_id"] == 63 and info["target_layer_ids"] == [1, 3]
    assert info["window"] == 16 and info["hidden_size"] == 32 and info["active_sequences"] == 1


def test_engine_deterministic(ckpt: Path) -> None:
    emb, head = target_weights()
    steps = [
        seq(n=5, budget=9),
        seq(n=3, start=5, reset=False, fseed=1, budget=20),
        seq(n=2, start=8, reset=False, fseed=2, budget=3),
    ]
    a = DraftEngine(load_drafter(ckpt), emb, head)
    b = DraftEngine(load_drafter(ckpt), emb, head)
    ta = [a.draft([s])[0] for s in steps]
    assert ta == [b.draft([s])[0] for s in steps]
    assert a.release(["s", "nope"]) == 1 and a.active_sequences == 0 and a.context_bytes == 0
    assert [a.draft([s])[0] for s in steps] == ta  # after release + reset
    assert len({t.token_ids for t in ta}) == 3


def test_bf16_engine_keeps_an_fp32_context_with_the_same_trees(ckpt: Path) -> None:
    """On the CPU a bf16 drafter keeps its context in fp32 (each row converted once, exactly): same trees
    and scores as a context kept in bf16 and converted at every draft."""
    emb, head = (w.bfloat16() for w in target_weights())
    steps = [
        seq(n=5, budget=9),
        seq(n=3, start=5, reset=False, fseed=1, budget=20),
        seq(n=2, start=8, reset=False, fseed=2, budget=12),
    ]
    fp32_ctx = DraftEngine(load_drafter(ckpt, dtype=torch.bfloat16), emb, head)
    bf16_ctx = DraftEngine(load_drafter(ckpt, dtype=torch.bfloat16), emb, head)
    bf16_ctx._context_dtype = None  # the buffers take the K/V's dtype, as on a GPU
    for s in steps:
        a, b = fp32_ctx.draft([s])[0], bf16_ctx.draft([s])[0]
        assert a == b and a.scores == b.scores
    assert fp32_ctx._contexts["s"].kv[0][0].dtype == torch.float32
    assert bf16_ctx._contexts["s"].kv[0][0].dtype == torch.bfloat16
    assert fp32_ctx.context_bytes == 2 * bf16_ctx.context_bytes


def test_warm_up_leaves_no_state_and_changes_no_tree(ckpt: Path) -> None:
    emb, head = target_weights()
    steps = [seq(n=5, budget=9), seq(n=3, start=5, reset=False, fseed=1, budget=20)]
    cold = DraftEngine(load_drafter(ckpt), emb, head)
    warm = DraftEngine(load_drafter(ckpt), emb, head)
    assert warm.warm_up(3) > 0
    assert warm.active_sequences == 0 and warm.context_bytes == 0
    assert [warm.draft([s])[0] for s in steps] == [cold.draft([s])[0] for s in steps]


def test_engine_window_equals_fresh(model: DFlashDraftModel) -> None:
    emb, head = target_weights()
    w = 6
    windowed = DraftEngine(model, emb, head, window=w)
    fresh = DraftEngine(model, emb, head, window=0)
    all_f = feats(13, 64, 9)
    cuts = [(0, 5), (5, 9), (9, 13)]
    for a, b in cuts:
        t = windowed.draft([seq(n=b - a, start=a, reset=a == 0, f=all_f[a:b], budget=10)])[0]
    ref = fresh.draft([seq(n=w, start=13 - w, f=all_f[-w:], budget=10)])[0]
    assert t == ref
    assert windowed.context_bytes == fresh.context_bytes
    # a commit that alone fills the window may skip ahead (the verifier dropped tokens outside it)
    t2 = windowed.draft([seq(n=w, start=20, reset=False, f=all_f[:w], budget=10)])[0]
    assert t2 == fresh.draft([seq(n=w, start=20, f=all_f[:w], budget=10)])[0]
    assert windowed.context_end("s") == 26
    # a contiguous commit longer than the window: only its last w rows matter
    long_f = feats(w + 3, 64, 5)
    t3 = windowed.draft([seq(n=w + 3, start=26, reset=False, f=long_f, budget=10)])[0]
    assert t3 == fresh.draft([seq(n=w, start=29, f=long_f[-w:], budget=10)])[0]
    assert windowed.context_end("s") == 26 + w + 3


ENGINE_ERRORS = [
    ("unknown_seq", lambda: [seq(reset=False)], "seq_id='s'.*unknown sequence; send its first commit with reset=True"),
    ("duplicate", lambda: [seq(), seq()], r"seqs\[1\] \(seq_id='s'\): duplicate seq_id"),
    ("empty_reset", lambda: [seq(n=0)], "reset needs a non-empty commit"),
    ("empty_id", lambda: [seq(seq_id="")], "seq_id must be a non-empty string"),
    ("neg_start", lambda: [seq(start=-1)], "commit_start must be >= 0"),
    ("budget_neg", lambda: [seq(budget=-1)], r"budget must be in \[0, 64\]"),
    ("budget_big", lambda: [seq(budget=65)], r"budget must be in \[0, 64\].*got 65"),
    ("token_oov", lambda: [seq(ids=(1, 2, 64, 3))], r"commit_token_ids has ids outside \[0, 64\): \[64\]"),
    ("token_neg", lambda: [seq(ids=(1, -2, 3, 4))], r"outside \[0, 64\): \[-2\]"),
    ("root_oov", lambda: [seq(root=64)], r"root_token_id 64 outside \[0, 64\)"),
    ("feat_rows", lambda: [seq(f=feats(3, 64, 0))], r"commit_features shape \(3, 64\) != .* = \[4, 64\]"),
    ("feat_width", lambda: [seq(f=feats(4, 32, 0))], r"commit_features shape \(4, 32\)"),
    ("feat_dtype", lambda: [seq(f=torch.zeros(4, 64, dtype=torch.int32))], "dtype torch.int32 is not a float"),
    ("feat_nan", lambda: [seq(f=torch.full((4, 64), float("nan")))], "non-finite"),
    ("second_bad", lambda: [seq(seq_id="ok"), seq(seq_id="bad", root=99)], r"seqs\[1\] \(seq_id='bad'\): root"),
]


@pytest.mark.parametrize("name, make, msg", ENGINE_ERRORS, ids=[e[0] for e in ENGINE_ERRORS])
def test_engine_validation(model: DFlashDraftModel, name: str, make, msg: str) -> None:
    eng = DraftEngine(model, *target_weights(), max_budget=64)
    with pytest.raises(ValueError, match=msg):
        eng.draft(make())
    assert eng.active_sequences == 0  # validation runs before any state change


def test_engine_commit_start_mismatch(model: DFlashDraftModel) -> None:
    eng = DraftEngine(model, *target_weights(), window=8)
    eng.draft([seq(n=4)])
    with pytest.raises(ValueError, match="commit_start 5 != context end 4"):
        eng.draft([seq(n=2, start=5, reset=False)])
    with pytest.raises(ValueError, match="commit_start 3 != context end 4"):
        eng.draft([seq(n=8, start=3, reset=False)])  # going back is never allowed
    assert eng.context_end("s") == 4


def test_engine_construction_errors(model: DFlashDraftModel) -> None:
    emb, head = target_weights()
    with pytest.raises(ValueError, match=r"embed_weight must be \[vocab_size=64, hidden_size=32\]"):
        DraftEngine(model, emb[:, :16], head)
    with pytest.raises(ValueError, match="lm_head_weight must be"):
        DraftEngine(model, emb, head[:10])
    with pytest.raises(ValueError, match="default_budget"):
        DraftEngine(model, emb, head, default_budget=2000)
    with pytest.raises(ValueError, match="window must be >= 0"):
        DraftEngine(model, emb, head, window=-3)


def test_batched_draft_equals_one_sequence_at_a_time(ckpt: Path) -> None:
    """One Draft call for several sequences (one forward over all blocks) gives each the tree it gets alone:
    contexts of different lengths, windowed and not, a reset among continuations, a chain request; the
    batched call builds its trees with tensor ops (tree/device_build.py, forced on the CPU) or by the heap, the
    single calls by the heap."""
    emb, head = target_weights()
    for window, tree_on_device in ((0, False), (5, False), (0, True), (5, True)):
        together = DraftEngine(load_drafter(ckpt), emb, head, window=window)
        together.tree_on_device = tree_on_device
        alone = DraftEngine(load_drafter(ckpt), emb, head, window=window)
        rounds = [
            [
                seq("a", n=3, budget=9),
                seq("b", n=9, start=2, root=11, fseed=1, budget=20),
                seq("c", n=1, root=3, fseed=2),
            ],
            [
                seq("a", n=2, start=3, reset=False, fseed=3, budget=9),
                seq("b", n=1, start=11, reset=False, fseed=4, budget=20),
                seq("c", n=7, start=40, root=9, fseed=5, budget=4),
            ],  # a fresh context at another position
            [
                SeqDraftInput("c", (4,), 47, feats(1, 64, 6), 2, 6, False, chain=True),
                seq("a", n=4, start=5, reset=False, fseed=7, budget=1),
            ],
        ]
        for batch in rounds:
            got = together.draft(batch)
            want = [alone.draft([s])[0] for s in batch]
            assert got == want, (window, tree_on_device, [s.seq_id for s in batch])
        assert together.context_bytes == alone.context_bytes


def test_drafter_dtype_auto() -> None:
    from ddtree.config import DrafterConfig, VerifierConfig
    from ddtree.drafter.factory import drafter_dtype

    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert drafter_dtype(DrafterConfig()) == (torch.bfloat16 if native else torch.float32)
    assert drafter_dtype(DrafterConfig(dtype="float16")) == torch.float16
    with pytest.raises(ValueError, match="auto"):
        VerifierConfig(dtype="auto").validate()  # the verifier's dtype is the output's: always explicit


@pytest.mark.parametrize("n,dtype", [(1, torch.float32), (37, torch.float32), (300, torch.bfloat16)])
def test_grouped_attention_matches_sdpa(n, dtype):
    """The drafter's bmm attention equals torch's SDPA with enable_gqa (fp32 reference)."""
    from ddtree.models.dflash.model import grouped_attention

    g = torch.Generator().manual_seed(n)
    q = torch.randn(8, 4, 16, generator=g).to(dtype)  # [B, nh, hd]
    k = torch.randn(n, 2, 16, generator=g).to(dtype)  # [n, kvh, hd]
    v = torch.randn(n, 2, 16, generator=g).to(dtype)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1), scale=0.25, enable_gqa=True
    ).transpose(0, 1)
    got = grouped_attention(q, (k,), (v,), 0.25)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    # the same keys in parts (a context and a block, the context in fp32 as the engine keeps it, one part
    # possibly empty): attention over their concatenation
    for cut in (0, n // 3, n):
        parts = grouped_attention(q, (k[:cut].float(), k[cut:]), (v[:cut].float(), v[cut:]), 0.25)
        torch.testing.assert_close(parts.float(), want, atol=tol, rtol=tol)

"""Causal heads (JetSpec), draft_shift and sliding-window layers in the DFlash drafter, against a brute-force
reference written from the published description (tests/support/block_attention_reference.py).

Random heads over a grid of (causal_head, draft_shift, layer_types): the engine's per-depth tables (eager and
static path) and the training forward's blocks equal the reference's log-probs on ragged contexts; a causal
slot never sees a later slot; the training mask is the serving rule, key by key.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from ddtree.drafter.engine import DraftEngine, SeqDraftInput
from ddtree.drafter.static_draft import StaticDraft, draft_buckets
from ddtree.models.dflash.checkpoint import load_drafter, write_random_drafter
from ddtree.models.dflash.config import DFlashConfig
from ddtree.training.drafter_forward import block_attention_mask, block_hidden
from tests.support.block_attention_reference import reference_logits

TARGET = {"hidden_size": 32, "num_hidden_layers": 6, "vocab_size": 64, "rope_theta": 10000.0}
BLOCK = 5
SLIDING = {"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 4}
CASES = {
    "causal": {"causal_head": True},
    "causal-shift": {"causal_head": True, "draft_shift": True},
    "causal-shift-sliding": {"causal_head": True, "draft_shift": True, **SLIDING},
    "bidirectional-sliding": SLIDING,
    "causal-sliding": {"causal_head": True, **SLIDING},
}
LENGTHS = (1, 6, 13)  # ragged contexts; 6 and 13 reach past the sliding window


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one thread is faster, and much faster on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _head(tmp_path, attention: dict, seed: int = 7):
    path = write_random_drafter(
        tmp_path / "head", TARGET, seed=seed, block_size=BLOCK, num_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attention=attention,
    )  # fmt: skip
    return path, load_drafter(path)


def _target(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g) / 4


def _calls(cfg, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(n, cfg.feature_size, generator=g), int(torch.randint(0, 63, (), generator=g)), 3 * i)
        for i, n in enumerate(LENGTHS)
    ]  # (features, root token, commit start) per sequence


def _reference(path, cfg, calls, embed, lm_head) -> list[torch.Tensor]:
    state = load_file(str(path / "model.safetensors"))
    out = []
    for feats, root, start in calls:
        ids = torch.full((BLOCK,), cfg.mask_token_id)
        ids[0] = root
        logits = reference_logits(state, cfg, feats, embed[ids], start + feats.shape[0], lm_head)
        out.append(torch.log_softmax(logits, dim=-1))  # [B-1, V] float64
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """name -> (head, the reference's log-probs per sequence), each computed once."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            path, model = _head(tmp_path_factory.mktemp(name), CASES[name])
            cache[name] = (model, _reference(path, model.config, _calls(model.config), *_target()))
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("static", [False, True])
def test_engine_tables_match_reference(reference, name: str, static: bool) -> None:
    model, refs = reference(name)
    cfg = model.config
    embed, lm_head = _target()
    engine = DraftEngine(model, embed, lm_head, window=32)
    if static:
        engine.static = StaticDraft(model, draft_buckets(4, 32, 16), BLOCK, engine.context_dtype, graphs=False)
    calls = _calls(cfg)
    seqs = [
        SeqDraftInput(f"s{i}", tuple(range(f.shape[0])), start, f, root, reset=True, table_width=8)
        for i, (f, root, start) in enumerate(calls)
    ]
    tables = engine.draft(seqs)
    if static:
        assert engine.static.replays == 1 and engine.static.fallbacks == 0
    for table, ref in zip(tables, refs):
        vals, ids = ref.topk(8, dim=-1)
        torch.testing.assert_close(table.logprobs.double(), vals, atol=2e-5, rtol=0)
        assert torch.equal(table.token_ids, ids)


@pytest.mark.parametrize(
    "name, flip",
    [
        ("causal", {"causal_head": False}),
        ("causal-shift", {"draft_shift": False}),
        ("causal-sliding", {"layer_types": ()}),
    ],
)
def test_reference_has_power(tmp_path, reference, name: str, flip: dict) -> None:
    """Each field changes the reference's answer: the tables above test the mask, not a no-op."""
    path, model = _head(tmp_path, CASES[name])
    cfg = model.config
    other = DFlashConfig(**{**cfg.__dict__, **flip})
    a = reference(name)[1]
    b = _reference(path, other, _calls(cfg), *_target())
    assert max((x - y).abs().max().item() for x, y in zip(a, b)) > 1e-3


def test_causal_slot_never_sees_later_slots(tmp_path) -> None:
    _, model = _head(tmp_path, CASES["causal-sliding"])
    cfg = model.config
    g = torch.Generator().manual_seed(4)
    ctx = model.context_kv(torch.randn(9, cfg.feature_size, generator=g), torch.arange(9))
    embeds = torch.randn(1, BLOCK, cfg.hidden_size, generator=g)
    pos = 9 + torch.arange(BLOCK)[None]
    base = model.forward_blocks(embeds, pos, [ctx])
    for j in range(1, BLOCK):
        moved = embeds.clone()
        moved[0, j:] += torch.randn(BLOCK - j, cfg.hidden_size, generator=g)
        out = model.forward_blocks(moved, pos, [ctx])
        assert torch.equal(out[0, :j], base[0, :j])  # masked keys weigh exactly 0
        assert (out[0, j] - base[0, j]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["causal-shift-sliding", "bidirectional-sliding"])
def test_training_blocks_match_reference(tmp_path, name: str) -> None:
    path, model = _head(tmp_path, CASES[name])
    cfg = model.config
    embed, lm_head = _target()
    g = torch.Generator().manual_seed(5)
    T = 16
    feats = torch.randn(1, T, cfg.feature_size, generator=g)
    anchors = torch.tensor([[2, 7, 11]])
    ids = torch.full((1, 3, BLOCK), cfg.mask_token_id)
    ids[0, :, 0] = torch.tensor([5, 9, 13])
    with torch.no_grad():
        hidden = block_hidden(model, feats, embed[ids], anchors)  # [1, m, B, H]
        logits = model.compute_logits(hidden[0][:, cfg.prediction_slots].reshape(-1, 32), lm_head).view(
            3, BLOCK - 1, -1
        )
    state = load_file(str(path / "model.safetensors"))
    for j, a in enumerate(anchors[0].tolist()):
        ref = reference_logits(state, cfg, feats[0, :a], embed[ids[0, j]], a, lm_head)
        torch.testing.assert_close(logits[j].double(), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("causal, layer_window, window", [(True, 0, 0), (True, 3, 0), (False, 3, 5), (True, 6, 4)])
def test_training_mask_is_the_serving_rule(causal: bool, layer_window: int, window: int) -> None:
    anchors = torch.tensor([[1, 4, 9], [0, 2, 3]])
    T, B = 12, 4
    got = block_attention_mask(anchors, T, B, window, causal, layer_window)
    S, m = anchors.shape
    for s in range(S):
        for j in range(m):
            a = int(anchors[s, j])
            for i in range(B):
                row = got[s, j * B + i]
                for p in range(T):  # context key at position p
                    want = p < a and (window == 0 or p >= a - window)
                    want = want and (layer_window == 0 or (a + i) - p < layer_window)
                    assert bool(row[p]) == want, (s, j, i, p)
                for j2 in range(m):
                    for i2 in range(B):
                        want = j2 == j and not (causal and i2 > i) and (layer_window == 0 or abs(i - i2) < layer_window)
                        assert bool(row[T + j2 * B + i2]) == want, (s, j, i, j2, i2)


def test_config_round_trip_and_qwen3_derivation() -> None:
    base = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, block_size=16, dflash_config={"mask_token_id": 63, "target_layer_ids": [1],
        "causal_head": True, "draft_shift": True},
    )  # fmt: skip
    cfg = DFlashConfig.from_dict({**base, "use_sliding_window": True, "max_window_layers": 1, "sliding_window": 8})
    assert cfg.layer_types == ("full_attention", "sliding_attention", "sliding_attention")
    assert [cfg.layer_window(i) for i in range(3)] == [0, 8, 8]
    assert cfg.causal_head and cfg.draft_shift and cfg.prediction_slots == slice(0, 15)
    assert DFlashConfig.from_dict(cfg.to_dict()) == cfg
    plain = DFlashConfig.from_dict({**base, "layer_types": ["full_attention"] * 3, "sliding_window": None})
    assert plain.layer_types == () and plain.layer_window(2) == 0

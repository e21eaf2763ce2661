"""The drafter's static-shape block forward (services/drafter/static_draft.py, models/dflash/static.py), CPU.

At every bucket edge (1 and the most sequences; no context, a context exactly at a bucket's size, one row
past it, the window) the static forward through the shared buffers agrees with forward_blocks (fp32,
allclose, the same top-K ids per slot), and is bit for bit the static forward on fresh tensors at that
bucket whatever a larger call left in the buffers (what a CUDA graph replay must reproduce). A call
outside every bucket falls back; an engine with the static step drafts the same trees as without it.
"""

from __future__ import annotations

import pytest
import torch

from ddtree.config import DrafterConfig
from ddtree.drafter.engine import DraftEngine, SeqDraftInput
from ddtree.drafter.factory import make_static_draft
from ddtree.drafter.static_draft import DraftBucket, StaticDraft, draft_buckets, plan_static_draft
from ddtree.models.dflash.checkpoint import load_drafter, write_random_drafter
from ddtree.models.dflash.static import static_forward_blocks

TARGET = {"hidden_size": 32, "num_hidden_layers": 6, "vocab_size": 64, "rope_theta": 10000.0}
BLOCK = 5
WINDOW = 24
BUCKETS = draft_buckets(4, WINDOW, context_block=8)  # seqs 1, 2, 4 x contexts 8, 16, 24


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_random_drafter(
        tmp_path_factory.mktemp("drafter"), TARGET, seed=5, block_size=BLOCK, num_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    return load_drafter(path)  # fp32


def _call(model, lengths: list[int], seed: int):
    """S blocks (one per length) with contexts of those lengths: embeds, positions, per-sequence contexts."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    embeds = torch.randn(len(lengths), BLOCK, cfg.hidden_size, generator=g)
    contexts = []
    for n in lengths:
        feats = torch.randn(n, cfg.feature_size, generator=g)
        contexts.append(model.context_kv(feats, torch.arange(n)) if n else [])
    positions = torch.tensor(lengths)[:, None] + torch.arange(BLOCK)[None, :]
    return embeds, positions, contexts


def test_buckets() -> None:
    assert [(b.seqs, b.context) for b in draft_buckets(4, 24, 8)] == [(s, c) for s in (1, 2, 4) for c in (8, 16, 24)]
    assert {b.context for b in draft_buckets(3, 2048)} == {256, 512, 1024, 2048}
    assert {b.seqs for b in draft_buckets(3, 2048)} == {1, 2, 3}
    with pytest.raises(ValueError, match="must be >= 1"):
        draft_buckets(0, 2048)


EDGES = [
    ([0], DraftBucket(1, 8)),  # no context at all
    ([8], DraftBucket(1, 8)),  # exactly a bucket's size
    ([9], DraftBucket(1, 16)),  # one row past it
    ([WINDOW], DraftBucket(1, WINDOW)),  # the window
    ([3, 0], DraftBucket(2, 8)),
    ([1, 24, 7], DraftBucket(4, WINDOW)),  # 3 sequences: a pad block
    ([16, 2, 5, 24], DraftBucket(4, WINDOW)),  # the most sequences
]


@pytest.mark.parametrize("lengths, bucket", EDGES)
def test_static_equals_forward_blocks(model, lengths: list[int], bucket: DraftBucket) -> None:
    static = StaticDraft(model, BUCKETS, BLOCK, torch.float32, graphs=False)
    embeds, positions, contexts = _call(model, lengths, seed=len(lengths) * 100 + sum(lengths))
    assert static.bucket_for(len(lengths), max(lengths)) == bucket
    with torch.inference_mode():
        # A larger call first, so the shared buffers hold another call's rows where this one pads.
        static.run(*_call(model, [WINDOW] * 4, seed=1))
        got = static.run(embeds, positions, contexts)
        want = model.forward_blocks(embeds, positions, contexts)
        fresh = StaticDraft(model, (bucket,), BLOCK, torch.float32, graphs=False)
        fresh.buffers.fill(bucket, embeds, positions, contexts)
        again = static_forward_blocks(model, *fresh.buffers.views(bucket))[: len(lengths)]
    assert got.shape == want.shape == (len(lengths), BLOCK, model.config.hidden_size)
    assert torch.equal(got, again)  # stale rows in the padding change no bit
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.topk(4, dim=-1).indices, want.topk(4, dim=-1).indices)
    assert static.replays == 2 and static.fallbacks == 0


def test_outside_every_bucket_falls_back(model) -> None:
    static = StaticDraft(model, BUCKETS, BLOCK, torch.float32, graphs=False)
    with torch.inference_mode():
        assert static.run(*_call(model, [1] * 5, seed=2)) is None  # more sequences than the largest bucket
        assert static.run(*_call(model, [WINDOW + 1], seed=3)) is None  # a context past the largest bucket
    assert static.fallbacks == 2 and static.replays == 0


def _seq(seq_id: str, start: int, n: int, root: int, reset: bool, seed: int) -> SeqDraftInput:
    feats = torch.randn(n, 64, generator=torch.Generator().manual_seed(seed))
    return SeqDraftInput(
        seq_id=seq_id, commit_token_ids=tuple(range(1, n + 1)), commit_start=start, commit_features=feats,
        root_token_id=root, budget=12, reset=reset,
    )  # fmt: skip


def _draft_side_by_side(model, static_draft) -> StaticDraft:
    """Eight Draft calls (one or two sequences, contexts growing past the window) on an eager engine and on
    one with `static_draft(engine)` as its static step: the same trees every time."""
    g = torch.Generator().manual_seed(0)
    emb, head = torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g) / 4
    eager = DraftEngine(model, emb, head, window=WINDOW)
    static = DraftEngine(model, emb, head, window=WINDOW)
    static.static = static_draft(static)
    ends = {"a": 0, "b": 0}
    for step in range(8):
        names = ["a", "b"] if step % 3 else ["a"]
        calls = []
        for k, name in enumerate(names):
            n = 7 if step == 0 else 1 + (step + k) % BLOCK
            calls.append(_seq(name, ends[name], n, root=step + 3, reset=ends[name] == 0, seed=10 * step + k))
            ends[name] += n
        assert eager.draft(calls) == static.draft(calls)
    return static.static


def test_engine_with_static_drafts_the_same_trees(model) -> None:
    static = _draft_side_by_side(
        model, lambda eng: make_static_draft(DrafterConfig(cuda_graphs="on", window=WINDOW), eng)
    )
    assert not static.graphs  # the CPU: buffers, no graphs
    assert static.replays == 8 and static.fallbacks == 0


def test_calls_outside_the_buckets_draft_eagerly_the_same_trees(model) -> None:
    # Buckets of at most one sequence and 8 context rows: most calls fall back to forward_blocks.
    static = _draft_side_by_side(
        model, lambda eng: StaticDraft(model, (DraftBucket(1, 8),), BLOCK, torch.float32, False)
    )
    assert static.replays >= 1 and static.fallbacks >= 5 and static.replays + static.fallbacks == 8


def test_plan_and_config() -> None:
    assert plan_static_draft("auto", "cpu", 2048) is None  # CUDA graphs are for CUDA
    assert plan_static_draft("off", "cuda", 2048) is None
    assert plan_static_draft("auto", "cuda", 0) is None  # an unlimited window has no largest bucket
    assert plan_static_draft("on", "cpu", 512) == draft_buckets(16, 512)
    with pytest.raises(ValueError, match="--cuda-graphs on needs a bounded --window"):
        DrafterConfig(cuda_graphs="on", window=0).validate()
    with pytest.raises(ValueError, match="cuda_graphs must be auto, on or off, got 'yes'"):
        DrafterConfig(cuda_graphs="yes").validate()


def test_the_window_auto_default_by_device():
    """--window -1 (the default) is 512 on the CPU and 2048 on CUDA; a window given is kept."""
    assert DrafterConfig().window == -1 and DrafterConfig().resolved_window() == 512
    assert DrafterConfig(device="cuda:1").resolved_window() == 2048
    assert DrafterConfig(window=0).resolved_window() == 0 and DrafterConfig(window=96).resolved_window() == 96
    with pytest.raises(ValueError, match="window must be >= -1"):
        DrafterConfig(window=-2).validate()

"""The drafter's memory is bounded (issue 20 point 6): on the CPU a bf16 / fp16 matmul keeps a kernel per
shape (oneDNN's and ideep's caches, ~0.3 MB an entry), so the drafter must run a bounded set of shapes,
all built by warm_up, however varied the prompts. Commits run through context_kv in pieces of at most
KV_ROWS_PER_CALL rows (engine.py); the pieces give the same K/V bits and the same trees as one call where the
machine's kernels give a row the same bits whatever the row count, and the same K/V to within rounding where they
do not (oneDNN's AMX kernels).
RSS itself is measured by scripts/bench/measure_drafter_rss.py (a drafter process, thousands of requests)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ddtree.drafter.engine import KV_ROWS_PER_CALL, DraftEngine, SeqDraftInput
from ddtree.models.dflash.checkpoint import load_drafter, write_random_drafter

# Wide enough that bf16 matmuls take oneDNN (ATen keeps tiny ones, m * n * k <= 16^3, to itself).
TARGET = {"hidden_size": 256, "num_hidden_layers": 6, "vocab_size": 512, "rope_theta": 10000.0}
BLOCK = 8


def rows_get_the_same_bits(model: torch.nn.Module) -> bool:
    """Whether this machine's matmul gives a row the same bits whatever the row count of the call, for each of the
    model's linear weights (the premise of bit-identical pieces). oneDNN's AVX512-BF16 kernels do; its AMX kernels
    (brgemm, Sapphire Rapids and later) split rows differently by row count for some shapes and do not, so there
    the pieces can only match to within rounding."""
    g = torch.Generator().manual_seed(7)
    with torch.inference_mode():
        for linear in (m for m in model.modules() if isinstance(m, torch.nn.Linear)):
            w = linear.weight
            a = torch.randn(2 * KV_ROWS_PER_CALL, w.shape[1], generator=g).to(w.dtype)
            first = F.linear(a[:KV_ROWS_PER_CALL], w)
            for r in range(1, KV_ROWS_PER_CALL + 1):  # a full piece and a last piece of every size
                whole = F.linear(a[: KV_ROWS_PER_CALL + r], w)
                if not torch.equal(whole, torch.cat([first, F.linear(a[KV_ROWS_PER_CALL : KV_ROWS_PER_CALL + r], w)])):
                    return False
    return True


def assert_same_kv(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, exact: bool, where) -> None:
    """Bit-identical where the kernels give every row the same bits; else equal to within two units of rounding in
    the compute dtype at the tensor's scale (a dot product rounded in another order differs by rounding of its
    terms, not of its result; wrong rows, positions or pieces would differ by the values themselves)."""
    if exact:
        assert torch.equal(got, want), where
    else:
        eps = torch.finfo(dtype).eps
        scale = float(want.abs().amax())
        torch.testing.assert_close(got, want, rtol=2 * eps, atol=2 * eps * scale, msg=lambda m: f"{where}: {m}")


@pytest.fixture
def one_thread():
    """One intra-op thread for the many-call tests: on a loaded host every parallel region waits on the scheduler
    (test_pieces_give_every_row_the_same_bits runs at the default thread count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_random_drafter(tmp_path_factory.mktemp("drafter"), TARGET, seed=5, block_size=BLOCK, head_dim=64)


def engine(ckpt: Path, dtype: torch.dtype, window: int = 2048) -> DraftEngine:
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(TARGET["vocab_size"], TARGET["hidden_size"], generator=g)
    head = torch.randn(TARGET["vocab_size"], TARGET["hidden_size"], generator=g) / 16
    return DraftEngine(load_drafter(ckpt, dtype=dtype), emb.to(dtype), head.to(dtype), window=window)


def lifetimes(eng: DraftEngine, seed: int, groups: int, max_group: int, max_prompt: int):
    """Mixed request lifetimes, as a verifier sends them: per group of 1..max_group sequences, a Draft with the
    prompt commits (reset), then 1..4 Drafts committing 1..block_size tokens each. Yields (Draft call, the
    group's seq ids when this is its last call, else None): the caller releases them."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    feature_size, vocab = eng.config.feature_size, eng.vocab_size
    for group in range(groups):
        ids = [f"g{group}s{i}" for i in range(rng.randint(1, max_group))]
        ends = [rng.randint(1, max_prompt) for _ in ids]
        budgets = [rng.choice((4, 16, 64)) for _ in ids]
        steps = rng.randint(2, 5)
        for step in range(steps):
            call = []
            for i, seq_id in enumerate(ids):
                n = ends[i] if step == 0 else rng.randint(1, BLOCK)
                start = 0 if step == 0 else ends[i]
                call.append(
                    SeqDraftInput(
                        seq_id,
                        tuple(rng.randrange(vocab) for _ in range(n)),
                        start,
                        torch.randn(n, feature_size, generator=g),
                        rng.randrange(vocab),
                        budget=budgets[i],
                        reset=step == 0,
                        chain=rng.random() < 0.1,
                    )
                )
                ends[i] = start + n
            yield call, ids if step == steps - 1 else None


def record_linear_shapes(model: torch.nn.Module) -> set[tuple[int, int, int]]:
    """(rows, in, out) of every nn.Linear call from now on, into the returned set (hooks stay on)."""
    shapes: set[tuple[int, int, int]] = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(
                lambda m, args: shapes.add((args[0].reshape(-1, m.in_features).shape[0], m.in_features, m.out_features))
            )
    return shapes


def test_commits_run_in_pieces_only_where_kernels_are_cached_per_shape(ckpt: Path) -> None:
    assert engine(ckpt, torch.bfloat16).kv_rows_per_call == KV_ROWS_PER_CALL
    assert engine(ckpt, torch.float16).kv_rows_per_call == KV_ROWS_PER_CALL
    assert engine(ckpt, torch.float32).kv_rows_per_call == 0  # MKL: nothing kept per shape, bits depend on it


def test_mixed_requests_run_only_the_shapes_warm_up_built(ckpt: Path, one_thread) -> None:
    """After warm_up(max_seqs), Draft calls of up to max_seqs sequences with any prompt lengths run no matmul
    shape that warm_up did not run, so the per-shape kernel caches hold a fixed set; and no sequence state
    is left after Release."""
    max_seqs = 8
    eng = engine(ckpt, torch.bfloat16)
    shapes = record_linear_shapes(eng.model)
    eng.warm_up(max_seqs)
    warmed = set(shapes)
    sent_rows: set[int] = set()
    for call, done in lifetimes(eng, seed=1, groups=24, max_group=max_seqs, max_prompt=600):
        sent_rows.add(sum(len(s.commit_token_ids) for s in call))
        assert len(eng.draft(call)) == len(call)
        if done:
            assert eng.release(done) == len(done)
    # the calls carried commits longer than one piece, of many lengths: each a new shape if run whole
    assert len({rows for rows in sent_rows if rows > KV_ROWS_PER_CALL}) >= 16
    new = shapes - warmed
    assert not new, f"{len(new)} matmul shapes after warm-up, e.g. {sorted(new)[:5]}"
    assert max(rows for rows, _, _ in shapes) <= max(KV_ROWS_PER_CALL, max_seqs * BLOCK)
    assert eng.active_sequences == 0 and eng.context_bytes == 0


@pytest.mark.parametrize("dtype, window", [(torch.bfloat16, 0), (torch.bfloat16, 200), (torch.float16, 200)])
def test_pieces_change_no_kv_and_no_tree(ckpt: Path, dtype: torch.dtype, window: int, one_thread) -> None:
    """The same calls through an engine that runs every commit in one context_kv call: where the kernels keep a
    row's bits whatever the row count, the same trees and scores and bit-identical context K/V; else (AMX) the
    same K/V to within rounding (assert_same_kv)."""
    pieces, whole = engine(ckpt, dtype, window), engine(ckpt, dtype, window)
    exact = rows_get_the_same_bits(pieces.model)
    whole.kv_rows_per_call = 0
    for call, done in lifetimes(pieces, seed=2, groups=8, max_group=6, max_prompt=400):
        got, want = pieces.draft(call), whole.draft(call)
        if exact:  # without bit-identical K/V a near-tie between two candidates may order them either way
            assert got == want and [t.scores for t in got] == [t.scores for t in want]
        for s in call:
            for (k1, v1), (k2, v2) in zip(pieces._contexts[s.seq_id].kv, whole._contexts[s.seq_id].kv, strict=True):
                assert_same_kv(k1, k2, dtype, exact, (s.seq_id, s.commit_start))
                assert_same_kv(v1, v2, dtype, exact, (s.seq_id, s.commit_start))
        if done:
            assert pieces.release(done) == whole.release(done) == len(done)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pieces_give_every_row_the_same_bits(ckpt: Path, dtype: torch.dtype) -> None:
    """Commits of many lengths (a last piece of every size 1..KV_ROWS_PER_CALL) in pieces and in one call, at the
    default thread count: the same K/V per layer (bit-identical where the kernels allow, assert_same_kv)."""
    eng = engine(ckpt, dtype)
    exact = rows_get_the_same_bits(eng.model)
    g = torch.Generator().manual_seed(3)
    features = torch.randn(3 * KV_ROWS_PER_CALL, eng.config.feature_size, generator=g).to(dtype)
    positions = torch.arange(11, 11 + features.shape[0])
    lengths = [1, KV_ROWS_PER_CALL, 2 * KV_ROWS_PER_CALL, 3 * KV_ROWS_PER_CALL]
    lengths += list(range(KV_ROWS_PER_CALL + 1, 3 * KV_ROWS_PER_CALL, 13))
    with torch.inference_mode():
        for n in lengths:
            whole = eng.model.context_kv(features[:n], positions[:n])
            pieces = eng._context_kv(features[:n], positions[:n])
            for layer, ((k1, v1), (k2, v2)) in enumerate(zip(pieces, whole, strict=True)):
                assert_same_kv(k1, k2, dtype, exact, (n, layer))
                assert_same_kv(v1, v2, dtype, exact, (n, layer))

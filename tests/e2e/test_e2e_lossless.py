"""Lossless end to end across real processes: DDTree greedy output == AR greedy output, token for token.

The services run as subprocesses and are called through real gRPC stubs. Two drafters: the random
DFlash drafter of the default checkpoint (accepts little), and the oracle drafter, which proposes the
target's own continuation with controlled noise, so zero, partial and full-depth acceptance, sibling
acceptance, KV compaction and positions are all exercised.
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from ddtree.tokenization.tokenizer import Tokenizer
from tests.support.stack_calls import MAX_NEW, PROMPTS, generate

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prompt_ids(default_ckpt):
    tok = Tokenizer(default_ckpt.target)
    return [tok.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def ar_reference(oracle_stack, prompt_ids):
    return [generate(oracle_stack.verifier, ids, no_spec=True)[0] for ids in prompt_ids]


def _run_all(address, prompt_ids, budget, concurrency):
    with cf.ThreadPoolExecutor(concurrency) as pool:
        futs = [pool.submit(generate, address, ids, no_spec=False, budget=budget) for ids in prompt_ids]
        return [f.result() for f in futs]


@pytest.mark.parametrize("concurrency", [1, 4])
@pytest.mark.parametrize("budget", [1, 8, 32])
def test_oracle_drafter_lossless(oracle_stack, prompt_ids, ar_reference, budget, concurrency):
    results = _run_all(oracle_stack.verifier, prompt_ids, budget, concurrency)
    for i, (tokens, steps, last) in enumerate(results):
        assert len(ar_reference[i]) == MAX_NEW
        assert tokens == ar_reference[i], f"prompt {i} budget {budget}: DDTree output differs from AR"
        assert last.finish_reason == "length"
        assert all(s.tree_nodes <= budget for s in steps)
        # one token from prefill, the rest from steps: root + matched nodes per step
        assert sum(s.accept_length for s in steps) >= MAX_NEW - 1
        assert last.usage.completion_tokens == MAX_NEW


def test_oracle_accept_histogram_covers_zero_partial_full(oracle_stack, prompt_ids, ar_reference):
    """Budget 32 lets the oracle's chain reach its full depth 7, so accept lengths span 1 (all
    rejected) .. 8 (all 7 drafted tokens + the root)."""
    lengths = []
    for ids, ref in zip(prompt_ids, ar_reference):
        tokens, steps, _ = generate(oracle_stack.verifier, ids, no_spec=False, budget=32, max_new=64)
        assert tokens[:MAX_NEW] == ref
        lengths += [s.accept_length for s in steps]
    assert 1 in lengths, "no step rejected every drafted token"
    assert any(2 <= n <= 7 for n in lengths), "no partial acceptance"
    assert 8 in lengths, "no step accepted the full depth"


@pytest.mark.parametrize("concurrency", [1, 4])
@pytest.mark.parametrize("budget", [1, 8, 32])
def test_dflash_drafter_lossless(dflash_stack, oracle_stack, prompt_ids, ar_reference, budget, concurrency):
    # Same checkpoint, other verifier process: its AR output must match the reference too.
    results = _run_all(dflash_stack.verifier, prompt_ids, budget, concurrency)
    for i, (tokens, steps, _last) in enumerate(results):
        assert tokens == ar_reference[i], f"prompt {i} budget {budget}: DDTree (DFlash) differs from AR"
        assert steps and all(0 < s.tree_nodes <= budget for s in steps)
        assert all(s.feature_bytes > 0 for s in steps), "features must travel to the drafter every step"


def test_step_records_are_consistent(oracle_stack, prompt_ids):
    tokens, steps, last = generate(oracle_stack.verifier, prompt_ids[0], no_spec=False, budget=8)
    ctx = len(prompt_ids[0])
    for i, s in enumerate(steps):
        assert s.step == i
        assert s.context_tokens == ctx, "context grows by exactly the committed tokens"
        ctx += s.accept_length
        assert s.total_ms >= s.verify_ms > 0
        assert s.draft_ms > 0 and s.transport_ms >= 0
    hist = list(last.usage.accept_histogram)
    assert sum(hist) == len(steps) == last.usage.verify_steps
    assert abs(last.usage.avg_accept_length - sum(s.accept_length for s in steps) / len(steps)) < 1e-4

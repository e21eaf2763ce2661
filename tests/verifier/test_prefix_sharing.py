"""Requests with the same prompt share one prefill (services/verifier/kv/prefix_cache.py `enter`,
services/verifier/kv/prefix_sharing.py): the first one admitted prefills it and enters it into the prefix
cache when its prefill completes; the others wait for that and take all but the last prompt token from
the cache. Checked by counting the rows of every target forward, against each request run alone on a
scheduler without a prefix cache (the reference: same tokens, greedy or seeded), with the KV accounting
(debug_checks) and the KV gauges (against the page tables) checked after every step: abort of the first
request mid-prefill, of later ones (waiting, and decoding on the shared prefix), eviction pressure from a
full cache, a prompt just past a chunk boundary (the first chunk computed all a match would give, but the
prompt enters only at the prefill's end), each waiting request's prompt compared once however long the
prefill, and the drafter's features of the shared prompt held once and equal to the target's own
(TargetRunner, no cache).

The scheduler is stepped by hand (`_loop_once` from the test thread, its own thread never started), so
the moment of each abort is exact.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from ddtree.config import VerifierConfig
from ddtree.contract.sampling_params import SamplingConfig
from ddtree.models.checkpoint.loader import load_target
from ddtree.tools.selftest.compare import assert_close
from ddtree.training.drafter_data import TargetRunner
from ddtree.verifier import metrics
from ddtree.verifier.engine import build_engine
from ddtree.verifier.sequence import GenerateParams, Phase, Sequence
from ddtree.verifier.step.scheduler import Scheduler

CHUNK = 64  # prefill tokens per step


@pytest.fixture(scope="module")
def model(default_ckpt):
    return load_target(default_ckpt.target).eval()


class _Rows:
    """Counts the rows of every target forward (prefill tokens + one per decoding sequence and step)."""

    def __init__(self, model):
        self.model, self.calls = model, []
        forward = model.forward

        def counting(input_ids, *args, **kwargs):
            self.calls.append(int(input_ids.shape[0]))
            return forward(input_ids, *args, **kwargs)

        model.forward = counting

    def close(self):
        del self.model.forward

    @property
    def total(self) -> int:
        return sum(self.calls)


def _scheduler(model, page_size=1, kv_tokens=4096, prefix_cache=True) -> Scheduler:
    vcfg = VerifierConfig(
        kv_tokens=kv_tokens,
        max_batch=8,
        prefill_chunk=CHUNK,
        debug_checks=True,
        prefix_cache=prefix_cache,
        page_size=page_size,
    )
    return build_engine(vcfg, model=model).scheduler


def _seq(rid, prompt, max_new, seed=None, page_size=1):
    sampling = SamplingConfig(temperature=0.0 if seed is None else 1.0, seed=seed)
    return Sequence(GenerateParams(rid, tuple(prompt), sampling, max_new, frozenset(), False, 0), page_size=page_size)


def _step(sched, seqs, until=None, limit=400):
    """Step the scheduler until every sequence finished (or `until()` holds); the KV gauges are checked
    after every step."""
    for _ in range(limit):
        if until() if until is not None else all(s.phase is Phase.FINISHED for s in seqs):
            return
        sched._loop_once()
        _check_gauges(sched)
    raise AssertionError("the sequences did not finish")


def _check_gauges(sched):
    """kv_used counts each slot the running sequences hold once, their shared (pinned) pages included;
    kv_cached is the rest of the pool in use (evictable), against the page tables themselves."""
    pages = (
        torch.cat([s.table.pages for s in sched._running]).unique()
        if sched._running
        else torch.empty(0, dtype=torch.int64)
    )
    state = sched.metric_state()
    assert state["kv_used"] == pages.numel() * sched.pool.page_size
    assert state["kv_used"] + state["kv_cached"] == sched.pool.num_used


_ALONE: dict[tuple, list[int]] = {}


def _alone(model, prompt, max_new, seed=None):
    """The reference: the request by itself, no prefix cache (computed once per request)."""
    key = (tuple(prompt), max_new, seed)
    if key not in _ALONE:
        _ALONE[key] = _run_alone(model, prompt, max_new, seed)
    return _ALONE[key]


def _run_alone(model, prompt, max_new, seed):
    sched = _scheduler(model, prefix_cache=False)
    seq = _seq("alone", prompt, max_new, seed)
    try:
        sched.submit(seq)
        _step(sched, [seq])
    finally:
        metrics.STATE.untrack(sched)
    return list(seq.generated)


def _drained(sched):
    """Nothing is running, nothing reserved, no pin left: evicting everything empties the pool."""
    assert sched.running_count == 0 and sched._reserved == 0
    sched.check_accounting()
    sched.cache.evict(sched.pool.num_slots)
    assert sched.cache.cached_slots == 0 and sched.pool.num_free == sched.pool.num_slots
    metrics.STATE.untrack(sched)


def _prompt(n, salt):
    g = torch.Generator().manual_seed(salt)
    return torch.randint(20, 4000, (n,), generator=g).tolist()


def _usable(length, page_size):
    """What a match gives a prompt: all but its last token, in whole pages."""
    return (length - 1) // page_size * page_size


@pytest.mark.parametrize(("page_size", "seeded"), [(1, True), (4, False)])
def test_n_identical_prompts_prefill_once(model, page_size, seeded):
    """Four requests with one prompt (the choices of n = 4) and an unrelated one behind them: the
    prompt is prefilled once, then each other choice its last page; the tokens are each one's alone."""
    L, N, MAX_NEW = 150, 4, 6
    prompt, other = _prompt(L, 1), _prompt(40, 2)
    seeds = [5 + i if seeded else None for i in range(N)]
    sched = _scheduler(model, page_size)
    choices = [_seq(f"c-{i}", prompt, MAX_NEW, seeds[i], page_size) for i in range(N)]
    unrelated = _seq("unrelated", other, MAX_NEW, page_size=page_size)
    rows = _Rows(model)
    try:
        for s in choices + [unrelated]:
            sched.submit(s)
        sched._loop_once()
        # the first choice prefills; the others wait for it, the unrelated request behind them does not
        assert choices[0].phase is Phase.PREFILL and choices[0].prefill_done == CHUNK
        assert all(s.phase is Phase.WAITING for s in choices[1:]) and unrelated.phase is Phase.PREFILL
        _step(sched, choices + [unrelated])
    finally:
        rows.close()
    usable = _usable(L, page_size)
    prefill = L + (N - 1) * (L - usable) + len(other)  # the prompt once, then each choice's last page
    assert rows.total == prefill + (N + 1) * (MAX_NEW - 1), rows.calls
    assert [s.cached_tokens for s in choices] == [0] + [usable] * (N - 1)
    assert [s.generated for s in choices] == [_alone(model, prompt, MAX_NEW, seed) for seed in seeds]
    assert unrelated.generated == _alone(model, other, MAX_NEW)
    # the entered prompt stays cached: a later request takes it (it is not waiting for anyone)
    again = _seq("again", prompt, MAX_NEW, seeds[0], page_size)
    sched.submit(again)
    _step(sched, [again])
    assert again.cached_tokens == usable and again.generated == choices[0].generated
    _drained(sched)


@pytest.mark.parametrize("page_size", [1, 4])
def test_abort_of_the_first_choice_mid_prefill(model, page_size):
    """Its prefilled chunk enters the cache at its abort; the next choice starts from there and is the
    one the last choice waits for."""
    L, MAX_NEW = 200, 5
    prompt = _prompt(L, 3)
    sched = _scheduler(model, page_size)
    first, second, third = (_seq(f"c-{i}", prompt, MAX_NEW, seed=11 + i, page_size=page_size) for i in range(3))
    rows = _Rows(model)
    try:
        for s in (first, second, third):
            sched.submit(s)
        sched._loop_once()
        assert first.prefill_done == CHUNK and second.phase is third.phase is Phase.WAITING
        sched.abort_sequence(first)
        sched._loop_once()
        assert first.finish_reason == "abort" and second.cached_tokens == CHUNK
        assert third.phase is Phase.WAITING  # now waiting for the second
        _step(sched, [first, second, third])
    finally:
        rows.close()
    usable = _usable(L, page_size)
    assert (second.cached_tokens, third.cached_tokens) == (CHUNK, usable)
    assert rows.total == CHUNK + (L - CHUNK) + (L - usable) + 2 * (MAX_NEW - 1), rows.calls
    assert second.generated == _alone(model, prompt, MAX_NEW, 12)
    assert third.generated == _alone(model, prompt, MAX_NEW, 13)
    _drained(sched)


def test_abort_of_later_choices(model):
    """A waiting choice aborted, one aborted while it decodes on the shared prefix, and the first one
    aborted after its prefill: the last choice, still on the shared prefix, is not disturbed."""
    L, MAX_NEW = 120, 8
    prompt = _prompt(L, 4)
    sched = _scheduler(model)
    a, b, c, d = (_seq(f"c-{i}", prompt, MAX_NEW) for i in range(4))
    for s in (a, b, c, d):
        sched.submit(s)
    sched._loop_once()
    sched.abort_sequence(b)  # waiting for a's prefill
    _step(sched, [], until=lambda: c.phase is Phase.DECODE and len(c.generated) >= 2)
    assert b.finish_reason == "abort" and b.cached_tokens == 0
    assert c.cached_tokens == d.cached_tokens == L - 1
    sched.abort_sequence(c)  # decoding on the shared prefix
    sched.abort_sequence(a)  # the one that entered the prompt
    _step(sched, [a, b, c, d])
    assert (a.finish_reason, c.finish_reason, d.finish_reason) == ("abort", "abort", "length")
    assert d.generated == _alone(model, prompt, MAX_NEW)
    _drained(sched)


def test_eviction_pressure_spares_the_shared_prompt(model):
    """A pool filled by the cache of earlier requests: every step that needs slots evicts them, never
    the prompt the running choices share (pinned), and the tokens stay those of each choice alone."""
    L, N, MAX_NEW, KV = 100, 4, 8, 512
    sched = _scheduler(model, kv_tokens=KV)
    earlier = [_seq(f"old-{i}", _prompt(200, 10 + i), 16) for i in range(2)]
    for s in earlier:
        sched.submit(s)
    _step(sched, earlier)
    assert sched.cache.cached_slots == 2 * (200 + 15) and sched.pool.num_free < L  # the cache fills the pool
    prompt = _prompt(L, 5)
    choices = [_seq(f"c-{i}", prompt, MAX_NEW, seed=20 + i) for i in range(N)]
    for s in choices:
        sched.submit(s)
    _step(sched, choices)
    assert [s.cached_tokens for s in choices] == [0] + [L - 1] * (N - 1)
    assert [s.generated for s in choices] == [_alone(model, prompt, MAX_NEW, 20 + i) for i in range(N)]
    assert sched.cache.cached_slots < 2 * (200 + 15)  # the earlier requests' cache made room
    # what is left of the cache: the shared prompt with the choices' answers, and what was not evicted
    still = sched.cache.match(prompt[:-1])
    assert still.length == L - 1
    sched.cache.release(still)
    _drained(sched)


@pytest.mark.parametrize(("page_size", "L"), [(1, CHUNK + 1), (4, CHUNK + 3)])
def test_a_prompt_just_past_a_chunk_waits_for_the_whole_prefill(model, page_size, L):
    """After the first chunk, the prefill has computed all a match would give (`usable`) but not entered
    the prompt yet (that happens at its end): the other choice still waits, then takes it from the cache."""
    MAX_NEW = 5
    prompt = _prompt(L, 6)
    usable = _usable(L, page_size)
    assert usable == CHUNK  # the window: the first chunk computed all a match would give
    sched = _scheduler(model, page_size)
    first, second = (_seq(f"c-{i}", prompt, MAX_NEW, seed=30 + i, page_size=page_size) for i in range(2))
    rows = _Rows(model)
    try:
        sched.submit(first)
        sched.submit(second)
        sched._loop_once()
        assert first.prefill_done == CHUNK and first.phase is Phase.PREFILL and second.phase is Phase.WAITING
        sched._loop_once()  # `second` is still waiting at its admission: the prompt is not in the cache yet
        assert first.phase is Phase.DECODE and second.phase is Phase.WAITING
        _step(sched, [first, second])
    finally:
        rows.close()
    assert (first.cached_tokens, second.cached_tokens) == (0, usable)
    assert rows.total == L + (L - usable) + 2 * (MAX_NEW - 1), rows.calls
    assert first.generated == _alone(model, prompt, MAX_NEW, 30)
    assert second.generated == _alone(model, prompt, MAX_NEW, 31)
    _drained(sched)


class _CountedPrompt(tuple):
    """A prompt that counts its comparisons with another prompt, element by element (what the scheduler
    spends finding the prefill a request waits for)."""

    compared = 0

    def __eq__(self, other):
        _CountedPrompt.compared += 1
        return tuple.__eq__(self, other)

    __hash__ = tuple.__hash__


def test_a_waiting_request_compares_its_prompt_once(model):
    """Choices waiting for a prefill of several steps: each waiting one is compared with the prompt being
    prefilled once, not once per admission pass (a prompt of 128k tokens costs about a millisecond)."""
    L, N, MAX_NEW = 3 * CHUNK + 10, 3, 2
    prompt = _prompt(L, 7)
    sched = _scheduler(model)
    choices = [
        Sequence(GenerateParams(f"c-{i}", _CountedPrompt(prompt), SamplingConfig(), MAX_NEW, frozenset(), False, 0))
        for i in range(N)
    ]
    _CountedPrompt.compared = 0
    for s in choices:
        sched.submit(s)
    passes = 0
    while choices[0].phase is not Phase.DECODE:
        sched._loop_once()
        passes += 1
        assert all(s.phase is Phase.WAITING for s in choices[1:])
    assert passes == 4 and _CountedPrompt.compared == N - 1  # one per waiting choice, over four passes
    _step(sched, choices)
    assert [s.cached_tokens for s in choices] == [0] + [L - 1] * (N - 1)
    assert all(s.generated == _alone(model, prompt, MAX_NEW) for s in choices)
    _drained(sched)


class _TapsOnly:
    """A drafter stand-in: the verifier taps these layers' features for it; every Draft fails (the
    sequences go on with AR steps, the same tokens)."""

    window = 0  # the whole context
    tap_layer_ids = (0, 2)

    def draft(self, *args):
        raise _Unavailable()

    def release(self, draft_ids):
        pass


class _Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "no drafter in this test"


def _feature_bytes(sched) -> int:
    """Host bytes of the features the cache and the running sequences keep (distinct storages; the
    pending commits, the drafter's next input, left out)."""
    tensors, stack = [], list(sched.cache.root.children.values())
    while stack:
        node = stack.pop()
        tensors.append(node.features)
        stack.extend(node.children.values())
    for s in sched._running:
        tensors += list(s.feature_log or []) + [s.prefix_match.features if s.prefix_match else None]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


@pytest.mark.parametrize("page_size", [1, 4])
def test_the_shared_prompt_features_are_held_once_and_lossless(model, page_size):
    """Speculative choices with the drafter's taps: once the prompt entered the cache, its features are
    held there alone (each sequence keeps the rows after its pinned prefix), the waiting choices' first
    drafter commit is the prompt with its features, and what the cache holds at the end is the target's
    own features of prompt + answer (TargetRunner: one forward per sequence, no cache)."""
    L, N, MAX_NEW = 150, 3, 6
    prompt = _prompt(L, 8)
    reference = TargetRunner(model, _TapsOnly.tap_layer_ids, torch.float32).generate(torch.tensor([prompt]), MAX_NEW)
    vcfg = VerifierConfig(kv_tokens=4096, max_batch=8, prefill_chunk=CHUNK, debug_checks=True, page_size=page_size)
    sched = build_engine(vcfg, model=model, drafter=_TapsOnly()).scheduler
    choices = [
        Sequence(
            GenerateParams(f"c-{i}", tuple(prompt), SamplingConfig(), MAX_NEW, frozenset(), True, 8),
            page_size=page_size,
        )
        for i in range(N)
    ]
    for s in choices:
        sched.submit(s)
    _step(sched, [], until=lambda: choices[0].phase is Phase.DECODE)
    sched._loop_once()  # the others are admitted on the entered prompt and prefill its last page
    usable = _usable(L, page_size)
    assert [s.cached_tokens for s in choices] == [0] + [usable] * (N - 1)
    row_bytes = reference.taps.shape[-1] * 4
    for s in choices:
        assert s.phase is Phase.DECODE and s.prefix_match.features is None
        assert sum(t.shape[0] for t in s.feature_log) == len(s.committed) - s.prefix_match.length < page_size + 1
    for s in choices[1:]:  # the drafter's first commit: the whole prompt, features from the cache + its own
        assert s.pending_commit.token_ids == prompt and s.pending_commit.start == 0
        assert_close("first commit", s.pending_commit.features, reference.taps[0, :L])
    held = sched.cache.cached_slots + sum(len(s.committed) - s.prefix_match.length for s in choices)
    assert _feature_bytes(sched) <= (held + N * page_size) * row_bytes, "features held twice"
    _step(sched, choices)
    assert all(s.generated == reference.ids[0, L:].tolist() for s in choices)
    match = sched.cache.match(choices[0].committed)
    assert match.length == len(choices[0].committed) // page_size * page_size > L - page_size
    assert_close("cached features", match.features, reference.taps[0, : match.length])
    sched.cache.release(match)
    _drained(sched)

"""Requests with the same prompt share one prefill (services/verifier/prefix_cache.py `enter`, the
scheduler's `_awaits_prefill` / `_enter_prompt`): the first one admitted prefills it and enters it into
the prefix cache when its prefill completes; the others wait for that and take all but the last prompt
token from the cache. Checked by counting the rows of every target forward, against each request run
alone on a scheduler without a prefix cache (the reference: same tokens, greedy or seeded), with the
KV accounting checked after every step (debug_checks): abort of the first request mid-prefill, of later
ones (waiting, and decoding on the shared prefix), and eviction pressure from a full cache.

The scheduler is stepped by hand (`_loop_once` from the test thread, its own thread never started), so
the moment of each abort is exact.
"""

from __future__ import annotations

import pytest
import torch

from ddtree.config import VerifierConfig
from ddtree.contract.sampling_params import SamplingConfig
from ddtree.models.loader import load_target
from ddtree.verifier import metrics
from ddtree.verifier.kv_pool import LatentKVPool
from ddtree.verifier.scheduler import Scheduler
from ddtree.verifier.sequence import GenerateParams, Phase, Sequence
from ddtree.verifier.target import LocalTarget

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
    c = model.config
    pool = LatentKVPool(c.num_hidden_layers, kv_tokens, c.kv_cache_width, torch.float32, "cpu", page_size=page_size)
    return Scheduler(LocalTarget(model), pool, vcfg, None)


def _seq(rid, prompt, max_new, seed=None):
    sampling = SamplingConfig(temperature=0.0 if seed is None else 1.0, seed=seed)
    return Sequence(GenerateParams(rid, tuple(prompt), sampling, max_new, frozenset(), False, 0))


def _step(sched, seqs, until=None, limit=400):
    """Step the scheduler until every sequence finished (or `until()` holds)."""
    for _ in range(limit):
        if until() if until is not None else all(s.phase is Phase.FINISHED for s in seqs):
            return
        sched._loop_once()
    raise AssertionError("the sequences did not finish")


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
    choices = [_seq(f"c-{i}", prompt, MAX_NEW, seeds[i]) for i in range(N)]
    unrelated = _seq("unrelated", other, MAX_NEW)
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
    again = _seq("again", prompt, MAX_NEW, seeds[0])
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
    first, second, third = (_seq(f"c-{i}", prompt, MAX_NEW, seed=11 + i) for i in range(3))
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

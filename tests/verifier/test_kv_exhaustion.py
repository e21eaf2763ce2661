"""KV exhaustion: admission reserves each request's worst case (prompt + max_new_tokens + one tree), so
requests beyond what the cache holds wait in the queue and then complete with the tokens they get alone;
beyond the queue they are refused with RESOURCE_EXHAUSTED, a request larger than the whole cache with
INVALID_ARGUMENT (it can never fit),
and the scheduler goes on serving."""

from __future__ import annotations

import time

import grpc
import pytest

from ddtree.config import VerifierConfig
from ddtree.contract.sampling_params import SamplingConfig
from ddtree.models.checkpoint.loader import load_target
from ddtree.verifier.engine import build_engine
from ddtree.verifier.sequence import GenerateParams, Sequence
from ddtree.verifier.step.scheduler import AdmissionError, Scheduler

PROMPT, NEW = 100, 40  # each request reserves 100 + 40 + 0 + 1 = 141 slots (AR: budget 0)


def _seq(i: int, prompt_len: int = PROMPT, new: int = NEW) -> Sequence:
    ids = tuple((13 * i + 7 * j) % 3000 + 20 for j in range(prompt_len))
    return Sequence(GenerateParams(f"r{i}", ids, SamplingConfig(temperature=0.0), new, frozenset(), False, 0))


def _drain(seqs: list[Sequence]) -> None:
    for seq in seqs:
        while not seq.events.get(timeout=120).finish_reason:
            pass


def _scheduler(model, kv_tokens: int, max_queue: int, max_batch: int = 8) -> Scheduler:
    vcfg = VerifierConfig(
        kv_tokens=kv_tokens,
        max_batch=max_batch,
        max_queue=max_queue,
        prefill_chunk=64,
        debug_checks=True,
        prefix_cache=False,
    )
    return build_engine(vcfg, model=model).scheduler


def test_requests_beyond_the_cache_queue_then_complete_and_a_full_queue_refuses(default_ckpt):
    model = load_target(default_ckpt.target).eval()
    alone = []
    for i in range(3):
        solo = _scheduler(model, 4096, 4)
        seq = _seq(i)
        solo.submit(seq)
        solo.start()
        _drain([seq])
        solo.stop()
        alone.append(list(seq.generated))

    # Room for two reservations of 141 at a time. Three batch places and no queue: the free places
    # admit a burst of three before the loop has moved any of them into the batch.
    sched = _scheduler(model, 300, 0, max_batch=3)
    seqs = [_seq(i) for i in range(3)]
    for seq in seqs:
        sched.submit(seq)  # all three wait: the loop has not started
    with pytest.raises(AdmissionError) as full:
        sched.submit(_seq(3))
    assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full (3 requests waiting, 0 running" in str(
        full.value
    )
    with pytest.raises(AdmissionError) as huge:
        sched.submit(_seq(4, prompt_len=250, new=60))  # 311 slots: more than the whole cache
    # It can never fit: a client error (400 through the gateway), not "retry later" (429).
    assert huge.value.code == grpc.StatusCode.INVALID_ARGUMENT and "the cache holds 300" in str(huge.value)
    sched.start()
    try:
        _drain(seqs)
        assert [list(s.generated) for s in seqs] == alone
        assert all(s.finish_reason == "length" for s in seqs)
        # the third request could only start once one of the first two had finished and released its KV
        assert seqs[2].first_token_time >= min(seqs[0].last_token_time, seqs[1].last_token_time)
        deadline = time.monotonic() + 10  # the finish event is sent just before the KV is released
        while sched.pool.num_used and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sched.pool.num_used == 0
        later = _seq(0)  # the server keeps serving
        sched.submit(later)
        _drain([later])
        assert list(later.generated) == alone[0]
    finally:
        sched.stop()

"""models/runtime/cpu/threads.py: the step thread keeps its thread count whatever other threads set later."""

from __future__ import annotations

import threading

import pytest
import torch

from ddtree.models.runtime.cpu import EngineThread, claim_for_steps, engine_threads, single_threaded


def _in_threads(first, second) -> int:
    """first() on thread A, then second() on thread B, then a parallel op on A: A's thread count after it
    (torch.get_num_threads is the calling thread's own count; nothing on A asks it before B has run)."""
    seen, a_ready, b_done = [], threading.Event(), threading.Event()

    def a():
        first()
        a_ready.set()
        b_done.wait(30)
        torch.zeros(1 << 17).add_(1.0)  # a parallel op: where torch's lazy per-thread set-up would happen
        seen.append(torch.get_num_threads())

    ta = threading.Thread(target=a)
    ta.start()
    a_ready.wait(30)
    tb = threading.Thread(target=second)
    tb.start()
    tb.join()
    b_done.set()
    ta.join()
    return seen[0]


def test_the_step_thread_keeps_its_count_when_a_helper_thread_goes_single():
    before = torch.get_num_threads()
    try:
        assert _in_threads(lambda: claim_for_steps(2), single_threaded) == 2
    finally:
        torch.set_num_threads(before)


def test_a_bare_set_num_threads_is_lost_to_a_later_helper():
    """Why claim_for_steps runs an op: without it the step thread takes the helper's count at its first op.
    (If torch ever keeps a thread's own count here, this fails and the op can go.)"""
    before = torch.get_num_threads()
    try:
        assert _in_threads(lambda: torch.set_num_threads(2), single_threaded) == 1
    finally:
        torch.set_num_threads(before)


def test_engine_threads():
    assert engine_threads(3) == 3
    assert engine_threads(0) == torch.get_num_threads()
    with pytest.raises(ValueError, match="threads must be >= 0"):
        engine_threads(-1)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        claim_for_steps(0)


def test_engine_thread_runs_every_call_on_one_claimed_thread_and_raises_what_it_raised():
    before = torch.get_num_threads()
    engine = EngineThread(2)
    try:
        seen = [engine.run(lambda: (threading.current_thread().name, torch.get_num_threads())) for _ in range(3)]
        assert len(set(seen)) == 1 and seen[0][0].startswith("engine") and seen[0][1] == 2
        with pytest.raises(ValueError, match="bad draft"):
            engine.run(_raise, "bad draft")
        assert engine.run(max, 3, 7) == 7
    finally:
        engine.close()
        torch.set_num_threads(before)


def _raise(message: str):
    raise ValueError(message)

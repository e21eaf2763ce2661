"""Which thread of a CPU engine process runs parallel torch work: one, the engine's step thread.

torch's CPU build parallelises ops with OpenMP (libgomp). Each thread that opens a parallel region gets
its own pool of worker threads, kept for the process's life. Once the pooled threads outnumber the cores,
libgomp stops spinning between regions and parks its workers, so every op pays a wake-up. A verifier's
forward is hundreds of small ops, so that wake-up would dominate it: with a second pool alive (the main
thread's, from loading), a step on 2 threads ran several times slower than on one.

So an engine process runs:
- start-up on the main thread with one thread (`main_thread_single`), since loading copies little;
- its steps on one thread that calls `claim_for_steps(n)` first: the verifier's scheduler thread, the
  drafter's `EngineThread`;
- helper threads that may touch big tensors (feature serialisation) with `single_threaded` as their
  initializer.

torch keeps one process-wide thread count that each thread copies on its first parallel op, besides its
own. So `claim_for_steps` sets n and then runs one parallel op, to take its copy at once.

The OpenMP spin count must be set before torch loads: that is models/runtime/openmp_spin.py, outside this
package (which imports torch).
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

# Elements of an op that torch runs in parallel (its grain size is 32768): the claim's own op.
_PARALLEL_OP_NUMEL = 1 << 17


def engine_threads(requested: int) -> int:
    """--threads as the step thread will use it: requested, or torch's default (the cores) for 0."""
    if requested < 0:
        raise ValueError(f"threads must be >= 0 (0 = torch's default), got {requested}")
    return requested or torch.get_num_threads()


def main_thread_single() -> None:
    """The calling (main) thread runs its torch ops on one thread: it never opens a pool of workers."""
    torch.set_num_threads(1)


def single_threaded() -> None:
    """A helper thread's initializer: its torch ops run on itself alone."""
    torch.set_num_threads(1)
    torch.zeros(_PARALLEL_OP_NUMEL).add_(1.0)  # take the count now, before another thread changes it


def claim_for_steps(threads: int) -> None:
    """The calling thread runs the engine's steps with `threads` threads (its own OpenMP pool)."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    torch.zeros(_PARALLEL_OP_NUMEL).add_(1.0)  # see the module docstring: take the count before anyone else


def run_on(engine_thread: EngineThread | None) -> Callable[..., object]:
    """How to run an engine's compute call: on `engine_thread` when there is one, else on the caller."""
    return engine_thread.run if engine_thread is not None else _call


def _call(fn, *args):
    return fn(*args)


class EngineThread:
    """One thread that runs every compute call of an engine whose callers are many threads (the drafter's
    gRPC handlers): its OpenMP pool is then the only one in the process. `run` blocks its caller until the
    call returns and raises what it raised."""

    def __init__(self, threads: int):
        self.threads = threads
        self._executor = cf.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="engine", initializer=claim_for_steps, initargs=(threads,)
        )

    def run(self, fn: Callable[..., T], *args) -> T:
        return self._executor.submit(fn, *args).result()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

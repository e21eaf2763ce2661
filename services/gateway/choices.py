"""OpenAI's `n`: n sequences for one request, run as n verifier requests side by side.

- Choice i is the request's job with request id `ID-i` (choice 0 keeps `ID`) and, when the request
  set a seed, seed + i (mod 2^64), so each choice has its own reproducible seed stream; without a
  seed every choice draws from the verifier's global RNG, independently.
- The n requests start together, so with one verifier they share its steps (one forward for all of
  them). The prefix cache enters a prompt when a request finishes: choices that run concurrently each
  prefill the prompt (in the same steps), and a later request with that prompt reuses it.
- `Choices` runs them as one: an iterator of (choice index, GenerateChunk) in arrival order, and
  `collect()` the n Results in index order. A failure of one cancels the others and is raised.
  With n = 1 it is the plain Generation, in the caller's thread.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Iterator

from ddtree.gateway.generation import Generation, Result, fold
from ddtree.gateway.pipeline import Invalid, Job
from ddtree.protocol.ddtree.v1 import gateway_pb2, verifier_pb2

MAX_N = 16
MAX_REQUEST_ID_CHARS = 256  # the verifier's limit
_END = object()


def check_n(n: int | None) -> int:
    if n is None:
        return 1
    if not 1 <= n <= MAX_N:
        raise Invalid(f"n: must be in [1, {MAX_N}], got {n}")
    return n


def choice_jobs(job: Job, n: int) -> list[Job]:
    """The job of each choice: the same prompt and options, its own request id and seed."""
    if n == 1:
        return [job]
    rid = job.request.request_id
    if len(f"{rid}-{n - 1}") > MAX_REQUEST_ID_CHARS:
        raise Invalid(f"request_id: with n = {n} at most {MAX_REQUEST_ID_CHARS - len(str(n - 1)) - 1} characters")
    jobs = [job]
    for i in range(1, n):
        request = verifier_pb2.GenerateRequest()
        request.CopyFrom(job.request)
        request.request_id = f"{rid}-{i}"
        if job.request.sampling.HasField("seed"):
            request.sampling.seed = (job.request.sampling.seed + i) % 2**64
        jobs.append(dataclasses.replace(job, request=request))
    return jobs


class Choices:
    """n Generations of one request as one (the interface http._GenerationResponse runs)."""

    def __init__(self, generations: list[Generation]):
        self.generations = generations
        self._queue: queue.Queue = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._left = len(generations)

    @property
    def n(self) -> int:
        return len(self.generations)

    @property
    def request_id(self) -> str:
        return self.generations[0].request_id

    def cancel(self) -> None:
        for g in self.generations:
            g.cancel()

    def close(self) -> None:
        self.cancel()
        for t in self._threads:
            t.join(timeout=5.0)  # a cancelled generation ends at once; close() must not race its thread
        for g in self.generations:
            g.close()

    def __iter__(self) -> Iterator[tuple[int, gateway_pb2.GenerateChunk]]:
        return self

    def __next__(self) -> tuple[int, gateway_pb2.GenerateChunk]:
        if self.n == 1:
            return 0, next(self.generations[0])
        if not self._threads:
            self._start()
        while self._left:
            index, item = self._queue.get()
            if item is _END:
                self._left -= 1
                continue
            if isinstance(item, BaseException):
                self._left = 0
                self.cancel()
                raise item
            return index, item
        raise StopIteration

    def _start(self) -> None:
        def run(index: int, gen: Generation) -> None:
            try:
                for chunk in gen:
                    self._queue.put((index, chunk))
                self._queue.put((index, _END))
            except BaseException as e:  # handed to the consumer, which raises it
                self._queue.put((index, e))

        for i, g in enumerate(self.generations):
            t = threading.Thread(target=run, args=(i, g), name=f"choice-{i}", daemon=True)
            self._threads.append(t)
            t.start()

    def collect(self) -> list[Result]:
        """Run every choice to its end: the n Results in index order."""
        chunks: list[list[gateway_pb2.GenerateChunk]] = [[] for _ in self.generations]
        for index, chunk in self:
            chunks[index].append(chunk)
        return [fold(c) for c in chunks]

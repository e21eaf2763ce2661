"""OpenAI's `n`: n sequences for one request, run as n verifier requests side by side.

- Choice i is the request's job with request id `ID-i` (choice 0 keeps `ID`) and, when the request
  set a seed, seed + i (mod 2^64), so each choice has its own reproducible seed stream; without a
  seed every choice draws from the verifier's global RNG, independently.
- The n requests start together, so with one verifier they share its steps (one forward for all of
  them) and one prefill of the prompt: the verifier prefills it for the first of them it admits and
  enters it into its prefix cache when that prefill completes; the others wait for it and take all
  but the last prompt token from the cache (services/verifier/kv/prefix_cache.py). Nothing here orders
  them: whichever the verifier admits first prefills. With several verifiers the router may send
  choices to different ones, which each prefill the prompt.
- prompt_logprobs: only choice 0 asks for them (`choice_jobs`). A request that reads the whole prompt
  never waits for a prefill nor takes from the cache, so were every choice to ask, each would prefill
  the prompt itself and run the LM head on every prompt row; this way choice 0 computes them once and
  the others share its prefill (they wait for it, or take the prompt from the cache, as above; when
  the verifier admits another choice first, that one prefills for the rest, beside choice 0). The
  answers show choice 0's entries for every choice (openai_responses.py).
- `Choices` runs them as one: an iterator of (choice index, GenerateChunk) in arrival order, and
  `collect()` the n Results in index order. A failure of one cancels the others and is raised.
  With n = 1 it is the plain Generation, in the caller's thread.
- `close()` (the HTTP response's `finally`, on the event loop) cancels every choice and returns at
  once, never raising: each choice's thread closes its own generation as it ends.
- Bounds: each choice is a verifier stream and (n > 1) a thread, so the HTTP API takes n of its
  max_workers + max_streams tokens for them (429 when they are not free: http.py), and a response
  that is not streamed holds at most MAX_RESPONSE_ENTRIES = n * max_tokens * (top_logprobs + 1)
  token entries (400 above: `check_size`); with prompt_logprobs, n * prompt tokens * (prompt_logprobs + 1)
  more, streamed or not (completions show choice 0's entries on each of the n choices), and a stream
  counts the output of the n - 1 choices it may hold until choice 0's entries are in.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable, Iterator

from ddtree.gateway.errors import Invalid
from ddtree.gateway.generation import Generation, Result, fold
from ddtree.gateway.pipeline import Job
from ddtree.protocol.ddtree.v1 import gateway_pb2, verifier_pb2
from ddtree.telemetry.logging import get_logger

MAX_N = 16
MAX_REQUEST_ID_CHARS = 256  # the verifier's limit
MAX_RESPONSE_ENTRIES = 2_000_000  # n * max_tokens * (top_logprobs + 1) of a response that is not streamed
_END = object()
_log = get_logger("gateway.choices")


def check_n(n: int | None) -> int:
    if n is None:
        return 1
    if not 1 <= n <= MAX_N:
        raise Invalid(f"n: must be in [1, {MAX_N}], got {n}")
    return n


def check_size(job: Job, n: int, stream: bool) -> None:
    """Invalid naming n, max_tokens and top_logprobs when a whole (not streamed) response could hold
    more than MAX_RESPONSE_ENTRIES token entries; naming prompt_logprobs when its prompt entries (held
    whole, streamed or not) take it over. A stream with prompt_logprobs and n > 1 may hold the other
    n - 1 choices' output until choice 0's entries are in (openai_responses.CompletionStream): counted."""
    top = job.request.top_logprobs if job.request.HasField("top_logprobs") else 0
    size = n * job.request.max_new_tokens * (top + 1)
    if not stream and size > MAX_RESPONSE_ENTRIES:
        raise Invalid(
            f"n: n * max_tokens * (top_logprobs + 1) = {n} * {job.request.max_new_tokens} * {top + 1} = {size} "
            f"is over {MAX_RESPONSE_ENTRIES} for a response that is not streamed (stream it, or ask for less)"
        )
    if job.request.HasField("prompt_logprobs"):
        k, prompt = job.request.prompt_logprobs, len(job.request.input_ids)
        out = (n - 1) * job.request.max_new_tokens * (top + 1) if stream else size
        held = n * prompt * (k + 1) + out
        if held > MAX_RESPONSE_ENTRIES:
            output = f" + {out} output entries" if out else ""
            raise Invalid(
                f"prompt_logprobs: n * prompt_tokens * (prompt_logprobs + 1) = {n} * {prompt} * {k + 1}{output} "
                f"= {held} entries is over {MAX_RESPONSE_ENTRIES} for one response (ask for less)"
            )


def choice_jobs(job: Job, n: int) -> list[Job]:
    """The job of each choice: the same prompt and options, its own request id and seed; prompt_logprobs
    on choice 0 alone (the others share its prefill)."""
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
        request.ClearField("prompt_logprobs")  # choice 0's entries serve every choice
        jobs.append(dataclasses.replace(job, request=request))
    return jobs


class Choices:
    """n Generations of one request as one (the interface http_response.GenerationResponse runs)."""

    def __init__(self, generations: list[Generation]):
        self.generations = generations
        self._queue: queue.Queue = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._left = len(generations)
        self._lock = threading.Lock()
        self._closed = False

    @property
    def n(self) -> int:
        return len(self.generations)

    @property
    def request_id(self) -> str:
        return self.generations[0].request_id

    def cancel(self) -> None:
        for g in self.generations:
            _quietly(g.cancel, g.request_id)

    def close(self) -> None:
        """Cancel every choice and release what is left, without waiting for a thread and without
        raising (it runs on the event loop): a started choice's thread closes its own generation."""
        with self._lock:
            self._closed = True
            started = bool(self._threads)
        self.cancel()
        if self.n == 1 or not started:  # n = 1 runs in the caller's thread, which is not inside next() now
            for g in self.generations:
                _quietly(g.close, g.request_id)

    def __iter__(self) -> Iterator[tuple[int, gateway_pb2.GenerateChunk]]:
        return self

    def __next__(self) -> tuple[int, gateway_pb2.GenerateChunk]:
        if self.n == 1:
            return 0, next(self.generations[0])
        with self._lock:
            if self._closed:
                raise StopIteration
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
            finally:
                _quietly(gen.close, gen.request_id)  # this thread's own generation: no race with next()

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


def _quietly(fn: Callable[[], None], request_id: str) -> None:
    try:
        fn()
    except Exception as e:  # close() must not raise; the log keeps the cause
        _log.warning("choice_close_failed", request_id=request_id, error=f"{type(e).__name__}: {e}")

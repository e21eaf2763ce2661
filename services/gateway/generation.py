"""One running request (`Generation`): route it, stream it from the verifier, turn token ids into
text, reasoning and tool-call deltas, stop it early, cancel it.

- Stop strings are matched on the raw text across chunk boundaries (`StopMatcher`); on a match the
  text is cut before it (after it with include_stop_str_in_output), the verifier request is aborted,
  and the answer finishes with "stop". With min_tokens, the text of the first min_tokens tokens is
  not searched (vLLM's rule: stop strings count once min_tokens tokens are out).
- Special tokens (skip_special_tokens, the default) render as nothing, except the markers the active
  reasoning and tool-call parsers read, which the parsers consume: no special token reaches content.
- Usage is the verifier's, passed on. When the gateway cut the stream itself it computes it by the
  same definition (`ddtree.contract.usage`) over the tokens and steps it passed on (ttft/decode on the
  gateway's clock).
- The token that stopped generation is reported in token_ids but not rendered into text.
- With options.top_logprobs, each chunk carries the verifier's TokenLogprobs of its token_ids, one per id.
  With options.prompt_logprobs, chunks without tokens carry the prompt's PromptLogprobs, before the first.
- `cancel()` (the client left) cancels the verifier call; the verifier aborts the request and frees
  its KV. The generation then ends quietly.
- Failures are `RequestError(grpc status code, message)`: the verifier's own status and message pass
  through; a verifier that is UNAVAILABLE before its first message is marked unhealthy and the request
  is retried on the next one.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc

from ddtree.contract.usage import usage_from_steps
from ddtree.gateway import metrics
from ddtree.gateway.detokenizer import IncrementalDetokenizer
from ddtree.gateway.errors import RequestError
from ddtree.gateway.parsers import ToolCall, merge_deltas, scan
from ddtree.gateway.parsers.registry import OutputParsers, parser_markers
from ddtree.gateway.routing import Endpoint, Router
from ddtree.protocol.ddtree.v1 import common_pb2, gateway_pb2, verifier_pb2
from ddtree.telemetry.logging import get_logger
from ddtree.tokenization.tokenizer import Tokenizer

if TYPE_CHECKING:
    from ddtree.gateway.pipeline import Job

ABORT_TIMEOUT_S = 2.0


@dataclasses.dataclass
class Result:
    """A whole answer, folded from its chunks (non-streaming clients)."""

    text: str
    reasoning: str
    tool_calls: list[ToolCall]
    token_ids: list[int]
    finish_reason: str
    usage: common_pb2.Usage
    logprobs: list[common_pb2.TokenLogprobs] = dataclasses.field(default_factory=list)  # one per token id
    prompt_logprobs: list[common_pb2.PromptLogprobs] = dataclasses.field(default_factory=list)  # in prompt order


def fold(chunks: list[gateway_pb2.GenerateChunk]) -> Result:
    """The chunks of one answer as one Result."""
    deltas = [d for c in chunks for d in c.tool_calls]
    return Result(
        text="".join(c.text_delta for c in chunks),
        reasoning="".join(c.reasoning_delta for c in chunks),
        tool_calls=merge_deltas(deltas),
        token_ids=[i for c in chunks for i in c.token_ids],
        finish_reason=chunks[-1].finish_reason if chunks else "abort",
        usage=chunks[-1].usage if chunks else common_pb2.Usage(),
        logprobs=[lp for c in chunks for lp in c.logprobs],
        prompt_logprobs=[c.prompt_logprobs for c in chunks if c.HasField("prompt_logprobs")],
    )


class StopMatcher:
    """Cuts a text stream at the first stop string, holding back a tail that may start one."""

    def __init__(self, stops: tuple[str, ...], include_stop: bool = False):
        self._stops = stops
        self._include = include_stop
        self._pending = ""

    def push(self, text: str, final: bool = False) -> tuple[str, bool]:
        """Returns (text safe to release, whether a stop string matched). After a match the stream
        is over: the text up to the match (and the stop string, with include_stop) is returned and
        the rest dropped."""
        pending = self._pending + text
        pos, stop = scan(pending, self._stops)
        if stop is not None:
            self._pending = ""
            return pending[: pos + (len(stop) if self._include else 0)], True
        if final:
            pos = len(pending)
        self._pending = pending[pos:]
        return pending[:pos], False


class Generation:
    """One running request: an iterator of GenerateChunk. Raises RequestError on failure; ends
    quietly after cancel(), which any thread may call at any time."""

    def __init__(
        self, job: Job, tokenizer: Tokenizer, router: Router, timeout: float | None = None, protocol: str = "grpc"
    ):
        self._tok = tokenizer
        self._router = router
        self._log = get_logger("gateway")
        self.job = job
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._protocol = protocol
        self._lock = threading.Lock()
        self._cancelled = False
        self._call = None
        self._endpoint: Endpoint | None = None
        self._it = self._run()

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> gateway_pb2.GenerateChunk:
        return next(self._it)

    @property
    def request_id(self) -> str:
        return self.job.request.request_id

    @property
    def endpoint(self) -> str:
        return self._endpoint.address if self._endpoint else ""

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            call = self._call
        if call is not None:
            call.cancel()

    def close(self) -> None:
        """Cancel and release everything now (instead of when the iterator is collected)."""
        self.cancel()
        self._it.close()

    def collect(self) -> Result:
        """Run to the end and fold the chunks into one Result."""
        return fold(list(self))

    def _timeout(self) -> float | None:
        return None if self._deadline is None else max(self._deadline - time.monotonic(), 0.001)

    def _open(self):
        """Route and start the verifier call; a verifier UNAVAILABLE before its first message is marked
        unhealthy and the next one is tried. Returns (call, first message or None)."""
        router, tried, errors = self._router, [], []
        while True:
            endpoint = router.acquire(exclude=tried)
            if endpoint is None:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, "; ".join(errors) or "no verifier")
            tried.append(endpoint)
            call = endpoint.stub.Generate(self.job.request, timeout=self._timeout())
            with self._lock:
                self._call, self._endpoint = call, endpoint
                cancelled = self._cancelled
            if cancelled:
                call.cancel()
            try:
                return call, next(call, None)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or self._cancelled:
                    raise
                with self._lock:
                    self._endpoint = None
                router.release(endpoint)
                router.mark_unhealthy(endpoint, e.details() or "")
                errors.append(f"verifier at {endpoint.address} is unavailable: {e.details()}")

    def _run(self) -> Iterator[gateway_pb2.GenerateChunk]:
        job, rid = self.job, self.job.request.request_id
        started = time.monotonic()
        outcome = "error"
        metrics.RUNNING.inc()
        try:
            call, first = self._open()
            messages = call if first is None else itertools.chain([first], call)
            for chunk in self._chunks(messages, call, started):
                outcome = chunk.finish_reason or outcome
                yield chunk
        except grpc.RpcError as e:
            if self._cancelled:
                outcome = "cancelled"
                return
            outcome = e.code().name
            raise RequestError(e.code(), e.details() or e.code().name) from None
        except RequestError as e:
            outcome = e.code.name
            raise
        except Exception as e:  # a bug or a protocol violation of the verifier, never silent
            self._log.exception("request_failed", request_id=rid)
            outcome = "INTERNAL"
            raise RequestError(grpc.StatusCode.INTERNAL, f"gateway: {type(e).__name__}: {e}") from None
        finally:
            metrics.RUNNING.dec()
            metrics.REQUESTS.labels(api=job.api, protocol=self._protocol, outcome=outcome).inc()
            metrics.E2E.observe(time.monotonic() - started)
            with self._lock:
                endpoint, self._endpoint = self._endpoint, None
                call, self._call = self._call, None
            if call is not None:
                call.cancel()  # no-op when it finished; frees the verifier when we stopped early
            if endpoint is not None:
                self._router.release(endpoint)

    def _chunks(self, messages, call, started: float) -> Iterator[gateway_pb2.GenerateChunk]:
        job, rid = self.job, self.job.request.request_id
        special = self._tok.special_tokens
        keep = frozenset(special[m] for m in parser_markers(job.reasoning_parser, job.tool_parser) if m in special)
        detok = IncrementalDetokenizer(self._tok, skip_special=job.skip_special, keep=keep)
        stops = StopMatcher(job.stop_strings, job.include_stop_str)
        parsers = OutputParsers(job.reasoning_parser, job.tool_parser, job.in_reasoning, job.tool_index_offset)
        steps: list[common_pb2.StepStats] = []
        completion = cached = 0
        first_token_at = last_token_at = None

        for msg in messages:
            ids = list(msg.token_ids)
            if ids:
                now = time.monotonic()
                if first_token_at is None:
                    first_token_at = now
                    metrics.TTFT.observe(now - started)
                else:
                    metrics.ITL.observe((now - last_token_at) / len(ids))
                last_token_at = now
            if msg.HasField("usage"):
                cached = msg.usage.cached_tokens or cached  # on the first message (and the last)
            free = max(job.min_tokens - completion, 0)  # leading ids whose text is not searched for stops
            completion += len(ids)
            steps.extend(msg.steps)
            final = bool(msg.finish_reason)
            text_ids = ids[:-1] if final and msg.finish_reason == "stop" and ids and ids[-1] in job.stop_ids else ids
            head = detok.push(text_ids[:free]) if free else ""
            text = detok.push(text_ids[free:]) + (detok.flush() if final else "")
            text, matched = stops.push(text, final=final)
            text = head + text
            chunk = gateway_pb2.GenerateChunk(request_id=rid, token_ids=ids, steps=msg.steps, logprobs=msg.logprobs)
            if msg.HasField("prompt_logprobs"):
                chunk.prompt_logprobs.CopyFrom(msg.prompt_logprobs)
            _fill_text(chunk, *parsers.push(text))
            if not (final or matched):
                yield chunk
                continue
            if matched and not final:
                self._abort()
                call.cancel()
            _fill_text(chunk, *parsers.finish())
            reason = "stop" if matched else msg.finish_reason
            chunk.finish_reason = "tool_calls" if reason == "stop" and parsers.called_tools else reason
            if final and msg.HasField("usage"):
                chunk.usage.CopyFrom(msg.usage)
            else:  # the gateway ended the request itself (stop string) or the verifier sent no usage
                ttft_ms = (first_token_at - started) * 1000.0 if first_token_at else 0.0
                decode_ms = (last_token_at - first_token_at) * 1000.0 if first_token_at else 0.0
                lengths = (s.accept_length for s in steps)
                chunk.usage.CopyFrom(
                    usage_from_steps(len(job.request.input_ids), completion, lengths, ttft_ms, decode_ms)
                )
                chunk.usage.cached_tokens = cached
            metrics.PROMPT_TOKENS.inc(chunk.usage.prompt_tokens)
            metrics.COMPLETION_TOKENS.inc(chunk.usage.completion_tokens)
            self._log.info(
                "request_done",
                request_id=rid,
                verifier=self.endpoint,
                api=job.api,
                protocol=self._protocol,
                prompt_tokens=len(job.request.input_ids),
                completion_tokens=completion,
                finish_reason=chunk.finish_reason,
                wall_ms=round((time.monotonic() - started) * 1000.0, 1),
            )
            yield chunk
            return
        raise RuntimeError(f"verifier stream of {rid} ended without a finish_reason")

    def _abort(self) -> None:
        """Tell the verifier to drop the request now (best effort: cancelling the stream, which
        follows, makes it abort as well)."""
        rid, endpoint = self.job.request.request_id, self._endpoint
        if endpoint is None:
            return
        try:
            endpoint.stub.Abort(verifier_pb2.AbortRequest(request_id=rid), timeout=ABORT_TIMEOUT_S)
        except grpc.RpcError as e:
            self._log.warning("abort_failed", request_id=rid, code=e.code().name, message=e.details())


def _fill_text(chunk: gateway_pb2.GenerateChunk, text: str, reasoning: str, calls) -> None:
    chunk.text_delta += text
    chunk.reasoning_delta += reasoning
    chunk.tool_calls.extend(
        gateway_pb2.ToolCallDelta(index=c.index, id=c.id, name=c.name, arguments_delta=c.arguments_delta) for c in calls
    )

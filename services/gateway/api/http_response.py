"""Answering an HTTP request with a generation: `GenerationResponse` runs one Generation (or n Choices)
and answers with server-sent events or one JSON body, watching the connection meanwhile (a disconnect
cancels the generation, and the verifier frees the request's KV at once).

- A failure before the first tokens is a plain error status (`error_answer`); once the stream started,
  it is finish_reason "error" on every unfinished choice and an error event, among the stream's last
  events (`last_events`). So a stream starts with the
  first chunk that carries tokens or a finish_reason: the prompt_logprobs chunks before it are held
  until then (bounded: choices.check_size) and go ahead of it.
- The verifier's gRPC status keeps its meaning over HTTP (STATUS: 400 bad input, 429 queue full, 503
  unavailable, 504 deadline, ...; anything else 500).
- The shapes are OpenAI's here (`data: {json}` events ending with `data: [DONE]`, OpenAI error JSON);
  the Anthropic routes override the four hooks of the protocol's shapes (anthropic_http.py).
- `n` > 1 borrows n tokens of the worker-thread limiter for the n choice threads (429 when fewer are free).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
import grpc
from starlette.responses import JSONResponse, Response

from ddtree.gateway import metrics
from ddtree.gateway.api.openai_responses import error_json, field_of
from ddtree.gateway.choices import Choices
from ddtree.gateway.context_length import CODE as CONTEXT_CODE
from ddtree.gateway.context_length import from_verifier
from ddtree.gateway.errors import RequestError
from ddtree.gateway.generation import Generation
from ddtree.telemetry.logging import get_logger

STATUS = {  # the verifier's (or the pipeline's) gRPC status -> the HTTP status of the answer
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_log = get_logger("gateway.http")


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None, code: str | None = None
) -> JSONResponse:
    """An OpenAI error answer (`{"error": {"message", "type", "param", "code"}}`), counted in the metrics."""
    metrics.HTTP_ERRORS.labels(status=str(status)).inc()
    if status >= 500:
        _log.warning("http_error", status=status, message=message)
    return JSONResponse(error_json(message, status, param, code), status_code=status, headers=headers)


def _sse(event: Any) -> bytes:
    data = event if isinstance(event, str) else json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class GenerationResponse(Response):
    """Runs one Generation and answers with SSE or one JSON body. Watches the connection meanwhile:
    a disconnect cancels the generation (the verifier frees the request's KV)."""

    def __init__(
        self,
        generation: Generation | Choices,
        limiter: anyio.CapacityLimiter,
        stream: bool,
        events: Any = None,  # the protocol's event builder: start(), events(chunk) (EventStream, MessageStream)
        build: Callable[[Any], dict] | None = None,
    ):
        self.generation, self.limiter, self.stream = generation, limiter, stream
        self.id_header = {"x-request-id": generation.request_id}
        self.events, self.build = events, build
        self.status_code = 200
        self.background = None
        self._answered = False  # the last byte is on its way: a disconnect now is the normal end

    # -- the protocol's shapes (OpenAI's; the Anthropic routes override them) ------------------------------
    def error_answer(self, status: int, message: str) -> Response:
        """The answer to a request that failed before anything was sent."""
        too_long = from_verifier(message) if status == 400 else None
        if too_long is not None:  # the verifier's own context check, in OpenAI's words
            return error_response(status, str(too_long), too_long.param, self.id_header, CONTEXT_CODE)
        param = field_of(message) if status == 400 else None
        if param == "grammar":  # the verifier's GenerateRequest.grammar (a grammar dead end), not a field of this
            param = None  # request, whose constraint is response_format, structured_outputs, guided_* or tool_choice
        return error_response(status, message, param, self.id_header)

    def stream_headers(self) -> list[tuple[bytes, bytes]]:
        return [*SSE_HEADERS, (b"x-request-id", self.generation.request_id.encode())]

    def encode(self, event: Any) -> bytes:
        """One server-sent event."""
        return _sse(event)

    def last_events(self, failure: tuple[int, str] | None) -> list:
        """The events that end a stream: after a failure (HTTP status, message) each unfinished choice's
        finish_reason "error" and the error event first."""
        if not failure:
            return ["[DONE]"]
        return [*self.events.failed(), error_json(failure[1], failure[0]), "[DONE]"]

    # -- running the generation ----------------------------------------------------------------------------
    def _borrow(self) -> list[object] | None:
        """n tokens of the limiter for the n choice threads (n > 1), and one left for the thread that
        reads them; None (nothing taken) when they are not free. Runs on the event loop: no await
        between the check and the takes."""
        n = getattr(self.generation, "n", 1)
        if n == 1:
            return []
        if self.limiter.available_tokens < n + 1:
            return None
        held = [object() for _ in range(n)]
        for borrower in held:
            self.limiter.acquire_on_behalf_of_nowait(borrower)
        return held

    async def __call__(self, scope, receive, send) -> None:
        gen = self.generation
        held = self._borrow()
        if held is None:
            gen.close()
            free, total = int(self.limiter.available_tokens), int(self.limiter.total_tokens)
            message = (
                f"n: {gen.n} choices need {gen.n + 1} of the gateway's {total} worker threads, {free} are free now"
            )
            await error_response(429, message, "n", self.id_header)(scope, receive, send)
            return
        try:
            await self._run(gen, scope, receive, send)
        finally:
            for borrower in held:
                self.limiter.release_on_behalf_of(borrower)

    async def _run(self, gen, scope, receive, send) -> None:
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                if not self._answered:
                    _log.info("client_disconnected", request_id=gen.request_id)
                    gen.cancel()
                    tg.cancel_scope.cancel()

            tg.start_soon(watch)
            try:
                if self.stream:
                    await self._stream(scope, send)
                else:
                    await self._whole(scope, send)
            except OSError:  # the connection broke while we wrote
                pass
            finally:
                gen.close()  # cancels what is left and releases the verifier slot now; never blocks
                tg.cancel_scope.cancel()

    async def _next(self):
        return await anyio.to_thread.run_sync(next, self.generation, None, limiter=self.limiter)

    async def _error(self, scope, send, e: RequestError) -> None:
        self._answered = True
        await self.error_answer(STATUS.get(e.code, 500), e.message)(scope, None, send)

    async def _whole(self, scope, send) -> None:
        try:
            result = await anyio.to_thread.run_sync(self.generation.collect, limiter=self.limiter)
        except RequestError as e:
            await self._error(scope, send, e)
            return
        self._answered = True
        await JSONResponse(self.build(result), headers=self.id_header)(scope, None, send)

    async def _stream(self, scope, send) -> None:
        held = []  # the prompt_logprobs chunks before the first tokens
        try:  # a failure before the first tokens is a plain error status
            chunk = await self._next()
            while chunk is not None and _prompt_only(chunk):
                held.append(chunk)
                chunk = await self._next()
        except RequestError as e:
            await self._error(scope, send, e)
            return
        await send({"type": "http.response.start", "status": 200, "headers": self.stream_headers()})
        events, failure = self.events.start(), None
        for item in held:
            events += self.events.events(item)
        try:
            while chunk is not None:
                events += self.events.events(chunk)
                if events:
                    body = b"".join(map(self.encode, events))
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                events = []
                chunk = await self._next()
        except RequestError as e:
            failure = (STATUS.get(e.code, 500), e.message)
            metrics.HTTP_ERRORS.labels(status=str(failure[0])).inc()
        self._answered = True
        body = b"".join(map(self.encode, self.last_events(failure)))
        await send({"type": "http.response.body", "body": body, "more_body": False})


def _prompt_only(item) -> bool:
    """A chunk (a Generation's, or Choices' (index, chunk)) that carries prompt_logprobs and nothing else."""
    chunk = item[1] if isinstance(item, tuple) else item
    return chunk.HasField("prompt_logprobs") and not (chunk.token_ids or chunk.finish_reason)

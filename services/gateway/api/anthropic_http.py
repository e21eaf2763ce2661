"""The Anthropic Messages routes of the gateway's HTTP API: `POST /v1/messages` (streaming or not) and
`POST /v1/messages/count_tokens`, over the same request path as the OpenAI routes (http_request.py's
body checks, `Pipeline.chat_job`, `Generation`, http_response.py's `GenerationResponse` with its
disconnect watch, in Anthropic's shapes).

- Keys: `x-api-key: KEY` (what Anthropic clients send) or `Authorization: Bearer KEY`, checked as on
  the OpenAI routes.
- Errors are Anthropic's `{"type": "error", "error": {"type", "message"}}`: 400 invalid_request_error for
  every bad or refused field (a wrong JSON type too, as Anthropic answers), 401 authentication_error,
  404 not_found_error (unknown model), 413 request_too_large, and the verifier's failures mapped as on
  the OpenAI routes (429 rate_limit_error, 503 overloaded_error, 504 timeout_error). A failure after
  the stream started is an `event: error`.
- Streams are `event: TYPE` + `data: {json}` pairs (anthropic_stream.py), with no [DONE].
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ddtree.gateway import metrics
from ddtree.gateway.api.anthropic_protocol import MessagesParams, parse_count_tokens, parse_messages
from ddtree.gateway.api.anthropic_stream import MessageStream, error_json, message_response, stop_reason
from ddtree.gateway.api.http_request import ApiError, read_json_body, served_model
from ddtree.gateway.api.http_response import SSE_HEADERS, GenerationResponse
from ddtree.gateway.auth import KeyPolicy, Unauthorized
from ddtree.gateway.context_length import ContextLengthExceeded, from_verifier
from ddtree.gateway.pipeline import Job
from ddtree.telemetry.logging import get_logger

if TYPE_CHECKING:
    from ddtree.gateway.api.http import OpenAIApi

_log = get_logger("gateway.anthropic")


def error_response(status: int, message: str) -> JSONResponse:
    metrics.HTTP_ERRORS.labels(status=str(status)).inc()
    if status >= 500:
        _log.warning("http_error", status=status, message=message)
    return JSONResponse(error_json(status, message), status_code=status)


def _sse(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


class _MessagesResponse(GenerationResponse):
    """The OpenAI routes' response runner (a disconnect cancels the generation) with Anthropic's
    error shape and event stream."""

    def error_answer(self, status: int, message: str) -> Response:
        too_long = from_verifier(message) if status == 400 else None  # the verifier's context check
        return error_response(status, too_long.anthropic_message() if too_long else message)

    def stream_headers(self) -> list[tuple[bytes, bytes]]:
        return SSE_HEADERS

    def encode(self, event: dict) -> bytes:
        return _sse(event)

    def last_events(self, failure: tuple[int, str] | None) -> list:
        return [error_json(*failure)] if failure else []  # no [DONE]: message_stop ends a stream


class AnthropicApi:
    """The Messages route handlers, beside the OpenAI routes' (their pipeline, config, worker threads)."""

    def __init__(self, api: OpenAIApi):
        self.api, self.p, self.config = api, api.p, api.config

    def _authorize(self, request: Request) -> KeyPolicy:
        key = request.headers.get("x-api-key", "").strip()
        value = f"Bearer {key}" if key else request.headers.get("authorization")
        if not value and self.p.keys.required:
            raise ApiError(
                401, "missing API key: send the header 'x-api-key: <key>' (or 'Authorization: Bearer <key>')"
            )
        try:
            return self.p.keys.authorize(value)
        except Unauthorized as e:
            raise ApiError(401, str(e)) from None

    async def _prepare(self, fn: Callable[[], Any]) -> Any:
        """Run parsing and preparation (template, tokenizer) in a worker thread; every ValueError is a 400."""
        try:
            return await anyio.to_thread.run_sync(fn, limiter=self.api.limiter)
        except ContextLengthExceeded as e:
            raise ApiError(400, e.anthropic_message()) from None
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    def _job(self, params: MessagesParams, max_budget: int) -> Job:
        return self.p.chat_job(
            params.messages,
            params.options,
            tools=params.tools,
            chat_template_kwargs=params.chat_template_kwargs,
            tool_choice=params.tool_choice,
            options_prefix="",
            max_budget=max_budget,
            parallel_tool_calls=params.parallel_tool_calls,
        )

    async def _guarded(self, request: Request, handler) -> Response:
        try:
            return await handler(request)
        except ApiError as e:
            return error_response(e.status, e.message)
        except Exception as e:  # a bug: the details go to the log only, as on the OpenAI routes
            _log.error("http_unhandled", path=request.url.path, error=f"{type(e).__name__}: {e}")
            return error_response(500, "gateway: internal error (logged)")

    async def messages(self, request: Request) -> Response:
        return await self._guarded(request, self._messages)

    async def count_tokens(self, request: Request) -> Response:
        return await self._guarded(request, self._count_tokens)

    async def _messages(self, request: Request) -> Response:
        policy = self._authorize(request)
        body = await read_json_body(request, self.config.max_body_bytes)
        params = await self._prepare(lambda: parse_messages(body, self.p.max_tokens_limit()))
        model = served_model(params.model, self.config.model_id)
        job = await self._prepare(lambda: self._job(params, policy.max_budget))
        _log.info("anthropic_request", request_id=job.request.request_id, user_id=params.user_id, stream=params.stream)
        gen = self.p.generate(job, protocol="http")
        mid = "msg_" + job.request.request_id.removeprefix("gw-")

        def stop_of(finish_reason: str, ids: list[int]) -> tuple[str, str | None]:
            return stop_reason(finish_reason, ids, job.stop_strings, job.stop_ids, self.p.tokenizer.decode)

        if params.stream:
            events = MessageStream(mid, model, len(job.request.input_ids), stop_of)
            return _MessagesResponse(gen, self.api.limiter, True, events=events)
        return _MessagesResponse(
            gen,
            self.api.limiter,
            False,
            build=lambda r: message_response(mid, model, r, stop_of(r.finish_reason, r.token_ids)),
        )

    async def _count_tokens(self, request: Request) -> Response:
        policy = self._authorize(request)
        body = await read_json_body(request, self.config.max_body_bytes)
        params = await self._prepare(lambda: parse_count_tokens(body))
        served_model(params.model, self.config.model_id)
        job = await self._prepare(lambda: self._job(params, policy.max_budget))
        return JSONResponse({"input_tokens": len(job.request.input_ids)})


def anthropic_routes(api: OpenAIApi) -> list[Route]:
    a = AnthropicApi(api)
    return [
        Route("/v1/messages", a.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", a.count_tokens, methods=["POST"]),
    ]

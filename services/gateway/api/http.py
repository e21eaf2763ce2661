"""OpenAI-compatible HTTP API of the gateway (Starlette on uvicorn, in a thread of the gateway process).

Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/responses (responses_api.py), GET /v1/models[/{id}], POST /tokenize,
POST /detokenize, GET /version (vLLM's utility routes: tokenize_protocol.py), GET /health (200 while a
verifier is healthy, else 503), GET /metrics (Prometheus text); Anthropic's POST /v1/messages and
/v1/messages/count_tokens (anthropic_http.py, its own error shape).

- Errors are OpenAI error JSON `{"error": {"message", "type", "param", "code"}}`: 400 malformed JSON,
  a bad value, a field of the wrong type or a refused field (openai_models.py), 401 a missing or
  wrong API key (when keys are set; /health stays open, /metrics follows --http-metrics: behind the
  key by default), 404 an unknown model or route, 409 a request id already running, 413 a body over
  max_body_bytes; verifier failures keep their meaning (429 queue full, 503 unavailable, 504 deadline).
- Streams (`"stream": true`) are server-sent events `data: {chunk}` ending with `data: [DONE]`; the
  response starts when the first tokens arrive, so a request that fails before that gets a plain error
  status; a failure mid-stream is sent as a `data: {"error": ...}` event before [DONE].
- A client that disconnects, streaming or not, cancels its generation: the verifier aborts the
  request and frees its KV at once.
- `n` > 1 runs n choices side by side (choices.py): one stream with each chunk's choice index, or one
  answer with n choices; the response's id and X-Request-Id are choice 0's. Its n threads take n of
  the max_workers + max_streams tokens below (429 when fewer are free), and an answer that is not
  streamed is bounded (choices.MAX_RESPONSE_ENTRIES, 400 above).
- `X-Request-Id` (else the body's `request_id`, else a fresh one) is the request's id on the verifier
  and in the logs, the response's id suffix (`chatcmpl-ID`, `cmpl-ID`), and comes back in the
  response's `X-Request-Id` header.

The pipeline is synchronous (gRPC); each request's blocking calls run in worker threads, at most
max_workers + max_streams at a time. Here: the route table (`create_app`), the OpenAI handlers
(`OpenAIApi`) and the server thread (`HttpServer`); the body, request id and model checks are
http_request.py's, the generation's answer (SSE or JSON, the disconnect watch) http_response.py's.
"""

from __future__ import annotations

import functools
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
import prometheus_client
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ddtree.config import GatewayConfig
from ddtree.gateway import metrics
from ddtree.gateway.api import openai_protocol as oai
from ddtree.gateway.api import tokenize_protocol as tp
from ddtree.gateway.api.anthropic_http import anthropic_routes
from ddtree.gateway.api.http_request import ApiError, read_json_body, request_id_of, served_model
from ddtree.gateway.api.http_response import GenerationResponse, error_response
from ddtree.gateway.api.openai_logprobs import TokenStrings
from ddtree.gateway.api.openai_responses import (
    ChatStream,
    CompletionStream,
    Echo,
    chat_response,
    completion_response,
    field_of,
)
from ddtree.gateway.api.responses_api import ResponsesStream, parse_responses, responses_answer
from ddtree.gateway.api.responses_api import encode as encode_response_event
from ddtree.gateway.auth import KeyPolicy, Unauthorized
from ddtree.gateway.choices import Choices, check_size, choice_jobs
from ddtree.gateway.context_length import CODE as CONTEXT_CODE
from ddtree.gateway.context_length import ContextLengthExceeded
from ddtree.gateway.errors import Invalid
from ddtree.gateway.pipeline import Job, Pipeline, validate_template_kwargs
from ddtree.telemetry.logging import get_logger
from ddtree.tokenization.chat_template import validate_tools

_log = get_logger("gateway.http")


class OpenAIApi:
    """The route handlers over one pipeline."""

    def __init__(self, pipeline: Pipeline, config: GatewayConfig):
        self.p, self.config = pipeline, config
        self.created = int(time.time())
        self._limiter: anyio.CapacityLimiter | None = None
        self.strings = TokenStrings(pipeline.tokenizer)  # logprobs' token strings, cached

    @property
    def limiter(self) -> anyio.CapacityLimiter:
        if self._limiter is None:  # created inside the event loop
            # A thread per stream waiting for its next chunk, plus the unary calls' share.
            self._limiter = anyio.CapacityLimiter(self.config.max_workers + self.config.max_streams)
        return self._limiter

    # -- request checks ------------------------------------------------------------------------------
    def _authorize(self, request: Request) -> KeyPolicy:
        try:
            return self.p.keys.authorize(request.headers.get("authorization"))
        except Unauthorized as e:
            raise ApiError(401, str(e)) from None

    async def _body(self, request: Request) -> dict:
        return await read_json_body(request, self.config.max_body_bytes)

    def _model(self, model: str | None) -> str:
        return served_model(model, self.config.model_id)

    async def _prepare(self, fn: Callable[[], Any]) -> Any:
        """Run request preparation (template, tokenizer) in a worker thread; map its errors."""
        try:
            return await anyio.to_thread.run_sync(fn, limiter=self.limiter)
        except ContextLengthExceeded as e:
            raise ApiError(400, str(e), e.param, CONTEXT_CODE) from None
        except ValueError as e:
            raise ApiError(400, str(e), field_of(str(e))) from None

    def _choices(self, job: Job, n: int, stream: bool) -> Choices:
        """The n choices of an OpenAI request (choices.py), started together."""
        try:
            check_size(job, n, stream)
            jobs = choice_jobs(job, n)
        except Invalid as e:
            raise ApiError(400, str(e), field_of(str(e))) from None
        return Choices([self.p.generate(j, protocol="http") for j in jobs])

    def _strings(self, options) -> TokenStrings | None:
        return self.strings.for_request(options)  # None when it asks for no logprobs

    async def _parsed(self, request: Request, parse: Callable[[dict, int | None], Any]) -> tuple:
        """(key policy, params, model, request id) of a chat or completion request, checked in this order:
        the key (401), the body (413, 400), its fields (`parse`: 400), the model (404), the id (400)."""
        policy = self._authorize(request)
        body = await self._body(request)
        params = await self._prepare(lambda: parse(body, self.p.max_tokens_limit()))
        return policy, params, self._model(params.model), request_id_of(request, params.request_id)

    def _respond(self, job: Job, params, model: str, prefix: str, stream_type, answer, **shape) -> Response:
        """The response of a chat or completion job (params: its ChatParams / CompletionParams): its n
        choices streamed as `stream_type`'s chunks, or `answer`'s one JSON body; the id is PREFIX-ID.
        shape: what the completions' builders take besides (echo)."""
        if params.user is not None:
            _log.info("http_request", request_id=job.request.request_id, user=params.user)
        gen, strings = self._choices(job, params.n, params.stream), self._strings(params.options)
        if strings is not None and getattr(params, "echo", False):  # echo may ask for the prompt's logprobs alone
            strings = TokenStrings(self.p.tokenizer, strings.cache, strings.output, params.prompt_logprobs_shown)
        rid, created = f"{prefix}-{job.request.request_id}", int(time.time())
        if params.stream:
            continuous = len(job.request.input_ids) if params.continuous_usage else None
            events = stream_type(
                rid,
                model,
                created,
                params.include_usage,
                params.n,
                strings,
                continuous_prompt_tokens=continuous,
                **shape,
            )
            return GenerationResponse(gen, self.limiter, True, events=events)
        build = functools.partial(answer, rid, model, created, strings=strings, **shape)
        return GenerationResponse(gen, self.limiter, False, build=build)

    # -- routes ----------------------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        policy, params, model, rid = await self._parsed(request, oai.parse_chat)
        job = await self._prepare(
            lambda: self.p.chat_job(
                params.messages,
                params.options,
                tools=params.tools,
                chat_template_kwargs=params.chat_template_kwargs,
                request_id=rid,
                tool_choice=params.tool_choice,
                separate_reasoning=params.separate_reasoning,
                options_prefix="",
                max_budget=policy.max_budget,
                add_generation_prompt=params.add_generation_prompt,
                continue_final_message=params.continue_final_message,
                grammar_checked=True,  # request_grammar checked each structured-output field
                parallel_tool_calls=params.parallel_tool_calls,
            )
        )
        return self._respond(job, params, model, "chatcmpl", ChatStream, chat_response)

    async def completions(self, request: Request) -> Response:
        policy, params, model, rid = await self._parsed(request, oai.parse_completion)
        job = await self._prepare(
            lambda: self.p.complete_job(
                params.prompt,
                params.options,
                rid,
                options_prefix="",
                max_budget=policy.max_budget,
                grammar_checked=True,  # request_grammar checked each structured-output field
            )
        )
        echo = None
        if params.echo:
            ids = job.request.input_ids
            whole = isinstance(params.prompt, str) and not params.options.HasField("truncate_prompt_tokens")
            text = params.prompt if whole else self.p.tokenizer.decode(list(ids))  # what the verifier read
            top = params.options.top_logprobs if params.options.HasField("top_logprobs") else None
            echo = Echo(text, ids[0], top, output=not params.prompt_only)
        return self._respond(job, params, model, "cmpl", CompletionStream, completion_response, echo=echo)

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API (responses_api.py): text and function tools, one choice."""
        policy = self._authorize(request)
        body = await self._body(request)
        params = await self._prepare(lambda: parse_responses(body, self.p.max_tokens_limit()))
        model, rid = self._model(params["model"]), request_id_of(request, None)
        job = await self._prepare(
            lambda: self.p.chat_job(
                params["messages"],
                params["options"],
                tools=params["tools"],
                request_id=rid,
                tool_choice=params["tool_choice"],
                options_prefix="",
                max_budget=policy.max_budget,
                parallel_tool_calls=params["parallel_tool_calls"],
            )
        )
        if params["user"] is not None:
            _log.info("http_request", request_id=job.request.request_id, user=params["user"])
        gen, rid, created = self._choices(job, 1, params["stream"]), job.request.request_id, int(time.time())
        if params["stream"]:
            return _ResponsesStreamResponse(gen, self.limiter, True, events=ResponsesStream(rid, model, created))
        return GenerationResponse(
            gen, self.limiter, False, build=functools.partial(responses_answer, rid, model, created)
        )

    async def _model_card(self) -> dict:
        max_context = await anyio.to_thread.run_sync(self.p.max_context, limiter=self.limiter)
        return {
            "id": self.config.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "ddtree",
            "max_model_len": max_context,
        }

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [await self._model_card()]})

    async def model(self, request: Request) -> Response:
        self._authorize(request)
        self._model(request.path_params["model"])
        return JSONResponse(await self._model_card())

    async def tokenize(self, request: Request) -> Response:
        self._authorize(request)
        body = await self._body(request)

        def run() -> dict:
            req = tp.parse_tokenize(body)
            self._model(req.model)
            if req.messages is not None:
                tools = validate_tools(req.tools)
                kwargs = validate_template_kwargs(req.chat_template_kwargs)
                messages = oai.chat_messages(req.messages)  # content parts as chat takes them
                _, ids = self.p.render(messages, tools, req.add_generation_prompt, kwargs)
            else:
                self.p.check_prompt_chars(len(req.prompt), "prompt")
                ids = self.p.tokenizer.encode(req.prompt)
            strs = [self.p.tokenizer.id_to_token(i) for i in ids] if req.return_token_strs else None
            return tp.tokenize_response(ids, self.p.max_context(), strs)

        return JSONResponse(await self._prepare(run))

    async def detokenize(self, request: Request) -> Response:
        self._authorize(request)
        body = await self._body(request)

        def run() -> dict:
            model, ids = tp.parse_detokenize(body, self.p.tokenizer.vocab_size)
            self._model(model)
            return {"prompt": self.p.tokenizer.decode(ids)}

        return JSONResponse(await self._prepare(run))

    async def version(self, request: Request) -> Response:
        return JSONResponse(tp.version())

    async def health(self, request: Request) -> Response:
        verifiers = self.p.router.snapshot()
        ok = any(v["healthy"] for v in verifiers)
        return JSONResponse(
            {"status": "ok" if ok else "unavailable", "verifiers": verifiers}, status_code=200 if ok else 503
        )

    async def metrics(self, request: Request) -> Response:
        mode = self.config.http_metrics
        if mode == "off":
            raise ApiError(404, "no route /metrics (this gateway serves no metrics over HTTP: --http-metrics off)")
        if mode == "key" or (mode == "auto" and self.p.keys.required):
            self._authorize(request)
        return Response(
            prometheus_client.generate_latest(metrics.REGISTRY), media_type=prometheus_client.CONTENT_TYPE_LATEST
        )


class _ResponsesStreamResponse(GenerationResponse):
    """The Responses API's stream: `event: TYPE` lines, no [DONE]; a failure is an `error` event."""

    def encode(self, event: Any) -> bytes:
        return encode_response_event(event)

    def last_events(self, failure: tuple[int, str] | None) -> list:
        return [self.events.error(*failure)] if failure else []


async def _api_error(request: Request, e: ApiError) -> Response:
    return error_response(e.status, e.message, e.param, code=e.code)


async def _http_error(request: Request, e: HTTPException) -> Response:
    message = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed on {request.url.path}"}
    return error_response(e.status_code, message.get(e.status_code, str(e.detail)))


async def _server_error(request: Request, e: Exception) -> Response:
    # The details go to the log only: a client never sees exception text.
    _log.error("http_unhandled", path=request.url.path, error=f"{type(e).__name__}: {e}")
    return error_response(500, "gateway: internal error (logged)")


def create_app(pipeline: Pipeline, config: GatewayConfig) -> Starlette:
    api = OpenAIApi(pipeline, config)
    routes = [
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/responses", api.responses, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/detokenize", api.detokenize, methods=["POST"]),
        Route("/version", api.version, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
    ]
    routes += anthropic_routes(api)  # POST /v1/messages, /v1/messages/count_tokens
    return Starlette(
        routes=routes, exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _server_error}
    )


def _bind(host: str, port: int) -> socket.socket:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"gateway-http: could not bind {host}:{port}: {e}") from None
    return sock


class HttpServer:
    """uvicorn serving the app on config.host:config.http_port in a background thread."""

    def __init__(self, pipeline: Pipeline, config: GatewayConfig):
        self.host = config.host
        self._grace_s = config.grace_s
        self._sock = _bind(config.host, config.http_port)
        self.port = self._sock.getsockname()[1]
        uv_config = uvicorn.Config(
            create_app(pipeline, config),
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="off",
            ws="none",
            http="h11",
            timeout_graceful_shutdown=config.grace_s,
            server_header=False,
        )
        self._server = uvicorn.Server(uv_config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="gateway-http", daemon=True
        )

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"gateway-http did not start on {self.address}")
            time.sleep(0.01)

    def stop(self, grace_s: float | None = None) -> None:
        """Stop taking connections; in-flight requests get `grace_s` seconds, then are cancelled."""
        # uvicorn's wait has no "now": a tenth of a second lets idle connections close quietly.
        self._server.config.timeout_graceful_shutdown = max(self._grace_s if grace_s is None else grace_s, 0.1)
        self._server.should_exit = True
        self._thread.join(timeout=(self._grace_s if grace_s is None else grace_s) + 10)

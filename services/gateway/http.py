"""OpenAI-compatible HTTP API of the gateway (Starlette on uvicorn, in a thread of the gateway process).

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/{id}], POST /tokenize,
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
max_workers + max_streams at a time.
"""

from __future__ import annotations

import functools
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
import grpc
import prometheus_client
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ddtree.config import GatewayConfig
from ddtree.gateway import metrics
from ddtree.gateway import openai_protocol as oai
from ddtree.gateway import tokenize_protocol as tp
from ddtree.gateway.auth import KeyPolicy, Unauthorized
from ddtree.gateway.choices import MAX_REQUEST_ID_CHARS, Choices, check_size, choice_jobs
from ddtree.gateway.generation import Generation, RequestError
from ddtree.gateway.openai_logprobs import TokenStrings
from ddtree.gateway.pipeline import Invalid, Job, Pipeline, validate_template_kwargs
from ddtree.protocol.json_limits import JsonInputError, check_depth, parse_hooks
from ddtree.telemetry.logging import get_logger
from ddtree.tokenization.chat_template import validate_tools

_STATUS = {
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
DRAIN_BYTES = 64 * 1024 * 1024
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_log = get_logger("gateway.http")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    metrics.HTTP_ERRORS.labels(status=str(status)).inc()
    if status >= 500:
        _log.warning("http_error", status=status, message=message)
    return JSONResponse(oai.error_json(message, status, param), status_code=status, headers=headers)


def _sse(event: Any) -> bytes:
    data = event if isinstance(event, str) else json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class _GenerationResponse(Response):
    """Runs one Generation and answers with SSE or one JSON body. Watches the connection meanwhile:
    a disconnect cancels the generation (the verifier frees the request's KV)."""

    def __init__(
        self,
        generation: Generation | Choices,
        limiter: anyio.CapacityLimiter,
        stream: bool,
        events: oai.EventStream | None = None,
        build: Callable[[Any], dict] | None = None,
    ):
        self.generation, self.limiter, self.stream = generation, limiter, stream
        self.id_header = {"x-request-id": generation.request_id}
        self.events, self.build = events, build
        self.status_code = 200
        self.background = None
        self._answered = False  # the last byte is on its way: a disconnect now is the normal end

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
        status = _STATUS.get(e.code, 500)
        self._answered = True
        param = oai.field_of(e.message) if status == 400 else None
        await error_response(status, e.message, param, self.id_header)(scope, None, send)

    async def _whole(self, scope, send) -> None:
        try:
            result = await anyio.to_thread.run_sync(self.generation.collect, limiter=self.limiter)
        except RequestError as e:
            await self._error(scope, send, e)
            return
        self._answered = True
        await JSONResponse(self.build(result), headers=self.id_header)(scope, None, send)

    async def _stream(self, scope, send) -> None:
        try:
            first = await self._next()
        except RequestError as e:
            await self._error(scope, send, e)
            return
        headers = [*SSE_HEADERS, (b"x-request-id", self.generation.request_id.encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        events = self.events.start()
        chunk = first
        try:
            while chunk is not None:
                events += self.events.events(chunk)
                if events:
                    await send({"type": "http.response.body", "body": b"".join(map(_sse, events)), "more_body": True})
                events = []
                chunk = await self._next()
        except RequestError as e:
            status = _STATUS.get(e.code, 500)
            metrics.HTTP_ERRORS.labels(status=str(status)).inc()
            await send(
                {"type": "http.response.body", "body": _sse(oai.error_json(e.message, status)), "more_body": True}
            )
        self._answered = True
        await send({"type": "http.response.body", "body": _sse("[DONE]"), "more_body": False})


class _Api:
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
        """The JSON object of the body. An oversize body is read and dropped (up to DRAIN_BYTES) before
        the 413, so that the client, still sending, reads the answer instead of a reset connection."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max(limit, DRAIN_BYTES):
            raise ApiError(413, f"request body of {declared} bytes is over the limit of {limit} bytes")
        body, seen, more = bytearray(), 0, True
        while more and seen <= DRAIN_BYTES:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                raise ApiError(400, "client disconnected while sending the request")
            piece, more = message.get("body", b""), message.get("more_body", False)
            seen += len(piece)
            if seen <= limit:
                body += piece
        if seen > limit:
            raise ApiError(
                413, f"request body of {declared or 'more than ' + str(limit)} bytes is over the limit of {limit} bytes"
            )
        try:
            # Strict UTF-8 first: json.loads(bytes) would let encoded lone surrogates (ED A0 80) through.
            data = json.loads(bytes(body).decode("utf-8"), **parse_hooks())
        except JsonInputError as e:  # a number over the limit, or NaN / Infinity
            raise ApiError(400, f"request body: {e}") from None
        except UnicodeDecodeError:
            raise ApiError(400, "request body is not UTF-8 text") from None
        except json.JSONDecodeError as e:
            raise ApiError(
                400, f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
            ) from None
        except RecursionError:
            raise ApiError(400, "request body is nested too deeply") from None
        try:
            check_depth(data, "request body")
        except JsonInputError as e:
            raise ApiError(400, str(e)) from None
        if not isinstance(data, dict):
            raise ApiError(400, f"request body must be a JSON object, got {oai.json_type(data)}")
        if b"\\ud" in body.lower():  # an escaped surrogate: fine in pairs, invalid alone
            try:
                json.dumps(data, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(400, "request body has an unpaired UTF-16 surrogate escape") from None
        return data

    def _model(self, model: str | None) -> str:
        if model is not None and model != self.config.model_id:
            raise ApiError(
                404, f"model {model!r} does not exist (this server serves {self.config.model_id!r})", "model"
            )
        return self.config.model_id

    async def _prepare(self, fn: Callable[[], Any]) -> Any:
        """Run request preparation (template, tokenizer) in a worker thread; map its errors."""
        try:
            return await anyio.to_thread.run_sync(fn, limiter=self.limiter)
        except ValueError as e:
            raise ApiError(400, str(e), oai.field_of(str(e))) from None

    @staticmethod
    def _request_id(request: Request, from_body: str | None) -> str:
        """X-Request-Id, else the body's request_id, else "" (the pipeline makes one)."""
        header = request.headers.get("x-request-id")
        rid, where = (header, "X-Request-Id") if header is not None else (from_body or "", "request_id")
        if len(rid) > MAX_REQUEST_ID_CHARS or not all("!" <= c <= "~" for c in rid):
            raise ApiError(400, f"{where}: must be 1-{MAX_REQUEST_ID_CHARS} printable ASCII characters", where)
        return rid

    def _choices(self, job: Job, n: int, stream: bool) -> Choices:
        """The n choices of an OpenAI request (choices.py), started together."""
        try:
            check_size(job, n, stream)
            jobs = choice_jobs(job, n)
        except Invalid as e:
            raise ApiError(400, str(e), oai.field_of(str(e))) from None
        return Choices([self.p.generate(j, protocol="http") for j in jobs])

    def _strings(self, options) -> TokenStrings | None:
        return self.strings if options.HasField("top_logprobs") else None

    # -- routes ----------------------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        policy = self._authorize(request)
        body = await self._body(request)
        params = await self._prepare(lambda: oai.parse_chat(body, self.config))
        model = self._model(params.model)
        rid = self._request_id(request, params.request_id)
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
            )
        )
        if params.user is not None:
            _log.info("http_request", request_id=job.request.request_id, user=params.user)
        gen, strings = self._choices(job, params.n, params.stream), self._strings(params.options)
        rid, created = f"chatcmpl-{job.request.request_id}", int(time.time())
        if params.stream:
            events = oai.ChatStream(rid, model, created, params.include_usage, params.n, strings)
            return _GenerationResponse(gen, self.limiter, True, events=events)
        build = functools.partial(oai.chat_response, rid, model, created, strings=strings)
        return _GenerationResponse(gen, self.limiter, False, build=build)

    async def completions(self, request: Request) -> Response:
        policy = self._authorize(request)
        body = await self._body(request)
        params = await self._prepare(lambda: oai.parse_completion(body, self.config))
        model = self._model(params.model)
        rid = self._request_id(request, params.request_id)
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
        if params.user is not None:
            _log.info("http_request", request_id=job.request.request_id, user=params.user)
        gen, strings = self._choices(job, params.n, params.stream), self._strings(params.options)
        rid, created = f"cmpl-{job.request.request_id}", int(time.time())
        if params.stream:
            events = oai.CompletionStream(rid, model, created, params.include_usage, params.n, strings)
            return _GenerationResponse(gen, self.limiter, True, events=events)
        build = functools.partial(oai.completion_response, rid, model, created, strings=strings)
        return _GenerationResponse(gen, self.limiter, False, build=build)

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
                _, ids = self.p.render(req.messages, tools, req.add_generation_prompt, kwargs)
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


async def _api_error(request: Request, e: ApiError) -> Response:
    return error_response(e.status, e.message, e.param)


async def _http_error(request: Request, e: HTTPException) -> Response:
    message = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed on {request.url.path}"}
    return error_response(e.status_code, message.get(e.status_code, str(e.detail)))


async def _server_error(request: Request, e: Exception) -> Response:
    # The details go to the log only: a client never sees exception text.
    _log.error("http_unhandled", path=request.url.path, error=f"{type(e).__name__}: {e}")
    return error_response(500, "gateway: internal error (logged)")


def create_app(pipeline: Pipeline, config: GatewayConfig) -> Starlette:
    api = _Api(pipeline, config)
    routes = [
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/detokenize", api.detokenize, methods=["POST"]),
        Route("/version", api.version, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
    ]
    from ddtree.gateway.anthropic_http import anthropic_routes  # it imports this module: loaded here

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

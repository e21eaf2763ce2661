"""Gateway service: the public gRPC API (`ddtree.v1.Gateway`) and the OpenAI-compatible HTTP API
(`http.py`) in one process, both over one request pipeline (`pipeline.py` prepares, `generation.py`
runs) and one verifier router (`routing.py`).

gRPC specifics: bad input is INVALID_ARGUMENT with the field named; the client's deadline becomes the
verifier call's; a client that leaves (or whose deadline passes) cancels the verifier call; verifier
errors reach the client with their status code and message. With API keys configured, every
Gateway RPC and reflection need metadata `authorization: Bearer KEY` (UNAUTHENTICATED otherwise);
health stays open. Chat and Complete streams take one of `--max-streams` slots (RESOURCE_EXHAUSTED
when none is free), so unary calls and health always find a thread.
"""

from __future__ import annotations

import pathlib
import threading
from collections.abc import Iterator

import grpc

from ddtree.config import GatewayConfig
from ddtree.gateway import metrics
from ddtree.gateway.api.http import HttpServer
from ddtree.gateway.auth import ApiKeys, KeyPolicy, Unauthorized
from ddtree.gateway.errors import Invalid, RequestError
from ddtree.gateway.generation import StopMatcher
from ddtree.gateway.pipeline import Job, Pipeline, validate_options
from ddtree.gateway.routing import Router
from ddtree.protocol.ddtree.v1 import gateway_pb2, gateway_pb2_grpc
from ddtree.protocol.json_limits import JsonInputError, load_json
from ddtree.protocol.security import MetadataGate, ServiceSecurity
from ddtree.protocol.server import RunningServer, start_server
from ddtree.protocol.stream_slots import StreamSlots
from ddtree.telemetry.logging import get_logger
from ddtree.telemetry.metrics import serve_metrics
from ddtree.tokenization.tokenizer import Tokenizer

__all__ = ["GatewayServer", "GatewayServicer", "StopMatcher", "serve", "validate_options"]

# grpc reports an RPC without deadline as one ~forever away; anything beyond this is "no deadline".
_NO_DEADLINE_S = 1e7


def _message_dict(m: gateway_pb2.ChatMessage) -> dict:
    """A proto ChatMessage as the dict the chat template takes (empty strings = absent)."""
    d: dict = {"role": m.role, "content": m.content}
    if m.name:
        d["name"] = m.name
    if m.tool_call_id:
        d["tool_call_id"] = m.tool_call_id
    if m.reasoning_content:
        d["reasoning_content"] = m.reasoning_content
    if m.tool_calls:
        d["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments or "{}"}}
            for c in m.tool_calls
        ]
    return d


def _json_field(text: str, field: str):
    if not text.strip():
        return None
    try:
        return load_json(text, field)
    except JsonInputError as e:
        raise Invalid(str(e)) from None


def _refusal(keys: ApiKeys, value: str | None) -> str | None:
    try:
        keys.authorize(value, header="metadata 'authorization")
    except Unauthorized as e:
        return str(e)
    return None


def _client_timeout(context: grpc.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    if remaining is None or remaining > _NO_DEADLINE_S:
        return None
    return max(remaining, 0.001)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """The Gateway RPCs over the shared pipeline."""

    def __init__(self, pipeline: Pipeline):
        self._p = pipeline
        self._config = pipeline.config
        self.stream_slots = StreamSlots(pipeline.config.max_streams, "--max-streams")

    # -- RPCs --------------------------------------------------------------------------------------
    def Chat(self, request: gateway_pb2.ChatRequest, context) -> Iterator[gateway_pb2.GenerateChunk]:
        policy = self._authorize(context)
        self.stream_slots.take(context)
        try:
            if not request.messages:
                raise Invalid("messages: must not be empty")
            tools = _json_field(request.tools_json, "tools_json")
            kwargs = _json_field(request.chat_template_kwargs_json, "chat_template_kwargs_json")
            if kwargs is not None and not isinstance(kwargs, dict):
                raise Invalid(f"chat_template_kwargs_json: must be a JSON object, got {type(kwargs).__name__}")
            job = self._p.chat_job(
                [_message_dict(m) for m in request.messages],
                request.options,
                tools=tools,
                chat_template_kwargs=kwargs,
                request_id=request.request_id,
                max_budget=policy.max_budget,
            )
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        yield from self._stream(job, context)

    def Complete(self, request: gateway_pb2.CompleteRequest, context) -> Iterator[gateway_pb2.GenerateChunk]:
        policy = self._authorize(context)
        self.stream_slots.take(context)
        try:
            job = self._p.complete_job(
                request.prompt, request.options, request.request_id, max_budget=policy.max_budget
            )
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        yield from self._stream(job, context)

    def Tokenize(self, request: gateway_pb2.TokenizeRequest, context) -> gateway_pb2.TokenizeResponse:
        self._authorize(context)
        tok = self._p.tokenizer
        try:
            if request.messages:
                rendered, ids = self._p.render(
                    [_message_dict(m) for m in request.messages], None, request.add_generation_prompt, {}
                )
            else:
                rendered = ""
                self._p.check_prompt_chars(len(request.text), "text")
                ids = tok.encode(request.text)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return gateway_pb2.TokenizeResponse(token_ids=ids, tokens=[tok.id_to_token(i) for i in ids], rendered=rendered)

    def GetInfo(self, request: gateway_pb2.GatewayInfoRequest, context) -> gateway_pb2.GatewayInfo:
        self._authorize(context)
        c = self._config
        return gateway_pb2.GatewayInfo(
            model_id=c.model_id,
            verifier_address=",".join(self._p.router.addresses),
            vocab_size=self._p.tokenizer.vocab_size,
            max_context=self._p.max_context(),
            reasoning_parser=c.reasoning_parser,
            tool_call_parser=c.tool_call_parser,
        )

    # -- helpers -----------------------------------------------------------------------------------
    def _authorize(self, context) -> KeyPolicy:
        value = next((v for k, v in context.invocation_metadata() if k == "authorization"), None)
        try:
            return self._p.keys.authorize(value, header="metadata 'authorization")
        except Unauthorized as e:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))

    def _stream(self, job: Job, context) -> Iterator[gateway_pb2.GenerateChunk]:
        generation = self._p.generate(job, timeout=_client_timeout(context), protocol="grpc")
        context.add_callback(generation.cancel)  # client gone (or RPC over) -> verifier call cancelled
        try:
            yield from generation
        except RequestError as e:
            if not context.is_active():
                return
            get_logger("gateway").warning(
                "request_error", request_id=job.request.request_id, code=e.code.name, message=e.message
            )
            context.abort(e.code, e.message)


class GatewayServer:
    """The running gateway: gRPC server, HTTP server (unless http_port is -1) and the router.
    `stop()` is graceful for both channels at once and idempotent."""

    def __init__(self, grpc_server: RunningServer, http_server, router: Router, pipeline: Pipeline):
        self.grpc = grpc_server
        self.http = http_server
        self.router = router
        self.pipeline = pipeline
        self._stopped = threading.Event()
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        return self.grpc.address

    @property
    def http_address(self) -> str | None:
        return self.http.address if self.http else None

    # what callers of a plain RunningServer use
    @property
    def host(self) -> str:
        return self.grpc.host

    @property
    def port(self) -> int:
        return self.grpc.port

    @property
    def health(self):
        return self.grpc.health

    @property
    def grace_s(self) -> float:
        return self.grpc.grace_s

    def stop(self, grace_s: float | None = None) -> None:
        with self._lock:
            if self._stopped.is_set():
                return
            http = threading.Thread(target=self.http.stop, args=(grace_s,), daemon=True) if self.http else None
            if http:
                http.start()
            self.grpc.stop(grace_s)
            if http:
                http.join()
            self.router.close()
            self._stopped.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """True once stopped; False when `timeout_s` passed first."""
        return self._stopped.wait(timeout_s)


def serve(
    config: GatewayConfig, tokenizer_dir: str | pathlib.Path | None = None, announce: bool = True
) -> GatewayServer:
    """Start the gateway: gRPC on config.host:config.port (announced first, as
    `LISTENING gateway host:port`), then HTTP on config.http_port (`LISTENING gateway-http host:port`).
    The tokenizer is config.tokenizer, or `tokenizer_dir` when that is empty (the caller resolves the
    default)."""
    path = config.tokenizer or tokenizer_dir
    if not path:
        raise ValueError("gateway: no tokenizer directory (set --tokenizer / DDTREE_TOKENIZER)")
    tokenizer = Tokenizer(path)
    keys = ApiKeys.from_config(config)
    router = Router(config.verifiers, config.health_interval_s, security=ServiceSecurity.from_config(config))
    try:
        pipeline = Pipeline(tokenizer, router, config, keys)
    except ValueError:
        router.close()
        raise
    servicer = GatewayServicer(pipeline)

    def register(server: grpc.Server) -> list[str]:
        gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
        return [gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name]

    # With keys set, reflection (the API's shape) needs one too; health stays open for probes.
    reflection_gate = MetadataGate(
        lambda metadata: _refusal(keys, metadata.get("authorization")),
        lambda method: method.startswith("/grpc.reflection."),
    )
    running = start_server(
        "gateway",
        register,
        config.host,
        config.port,
        config.max_workers,
        config.grace_s,
        announce=announce,
        stream_threads=servicer.stream_slots.limit,
        interceptors=[reflection_gate] if keys.required else [],
        max_receive_bytes=config.max_body_bytes,  # the same bound as an HTTP body
    )
    http = None
    if config.http_port >= 0:
        try:
            http = HttpServer(pipeline, config)
            http.start()
        except BaseException:
            running.stop(0)
            router.close()
            raise
        if announce:
            print(f"LISTENING gateway-http {http.address}", flush=True)
    # Prometheus on its own port (--metrics-port), open: for a scraper on the internal network, while
    # the HTTP API's /metrics follows --http-metrics.
    serve_metrics(config.metrics_port, config.host, metrics.REGISTRY, announce=announce)
    router.start()
    get_logger("gateway").info(
        "gateway_ready",
        address=running.address,
        http=http.address if http else None,
        verifiers=list(router.addresses),
        tokenizer=str(path),
        vocab_size=tokenizer.vocab_size,
    )
    if keys.required and not (config.service_token or config.service_token_file or config.tls_ca):
        get_logger("gateway").warning(
            "services_unauthenticated",
            message="API keys guard the gateway, but the verifier and drafter take calls from any process that "
            "reaches them: give all three services one service token (DDTREE_SERVICE_TOKEN) or mutual TLS",
        )
    return GatewayServer(running, http, router, pipeline)

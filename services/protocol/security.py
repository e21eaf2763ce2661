"""Service-to-service security: a shared service token and mutual TLS between gateway, verifier and
drafter, for deployments that do not keep the three on one private network.

- Service token (`--service-token`, or `--service-token-file`, or DDTREE_SERVICE_TOKEN): a verifier or
  drafter started with one refuses every RPC (UNAUTHENTICATED) whose metadata lacks
  `x-ddtree-service-token: TOKEN`, except grpc.health.v1 (probes carry no secrets and learn nothing);
  gateway and verifier send it on their calls to the services behind them.
- Mutual TLS (`--tls-ca`, `--tls-cert`, `--tls-key`, PEM files): a verifier or drafter serves TLS and
  requires a client certificate signed by the CA; gateway and verifier dial TLS with their own
  certificate and check the server's against the same CA (`--tls-server-name` overrides the name
  checked when certificates name the service differently from the address dialled).

An engine (verifier, drafter) with neither listens on loopback only, whatever --host says
(`engine_bind_host`): nothing off the machine reaches an engine that does not authenticate its callers.
`ddtree serve` always gives its children a service token (a generated one when none is given).

The gateway's public API never uses these (clients there authenticate with the API key, `auth.py`);
terminate public TLS in front of it.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import pathlib
from collections.abc import Callable

import grpc

TOKEN_METADATA = "x-ddtree-service-token"
HEALTH_PREFIX = "/grpc.health.v1.Health/"


def _read(path: str, what: str) -> bytes:
    try:
        data = pathlib.Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path}: {e.strerror}") from None
    if not data.strip():
        raise ValueError(f"{what}: {path} is empty")
    return data


@dataclasses.dataclass(frozen=True)
class ServiceSecurity:
    """What one service needs to talk to and accept calls from the others (no secrets in repr)."""

    token: str = dataclasses.field(default="", repr=False)
    tls_ca: bytes | None = dataclasses.field(default=None, repr=False)
    tls_cert: bytes | None = dataclasses.field(default=None, repr=False)
    tls_key: bytes | None = dataclasses.field(default=None, repr=False)
    tls_server_name: str = ""

    @classmethod
    def from_config(cls, config) -> ServiceSecurity:
        """From a ServiceConfig's service_token / service_token_file / tls_* fields; ValueError names
        the setting that is wrong."""
        token = config.service_token
        if config.service_token_file:
            if token:
                raise ValueError("set service_token or service_token_file, not both")
            token = _read(config.service_token_file, "service_token_file").decode("utf-8").strip()
        files = {"tls_ca": config.tls_ca, "tls_cert": config.tls_cert, "tls_key": config.tls_key}
        given = [name for name, path in files.items() if path]
        if given and len(given) != 3:
            missing = ", ".join(f"--{n.replace('_', '-')}" for n in files if n not in given)
            raise ValueError(f"mutual TLS needs --tls-ca, --tls-cert and --tls-key; missing {missing}")
        pem = {name: _read(path, name) for name, path in files.items() if path}
        return cls(token=token, tls_server_name=config.tls_server_name, **pem)

    @property
    def tls(self) -> bool:
        return self.tls_ca is not None

    # -- client side ---------------------------------------------------------------------------------
    def channel(self, address: str, options: list[tuple[str, object]]) -> grpc.Channel:
        """A channel to another ddtree service: TLS with our certificate when configured, and the
        service token on every call when set."""
        if self.tls:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=self.tls_ca, private_key=self.tls_key, certificate_chain=self.tls_cert
            )
            if self.tls_server_name:
                options = [*options, ("grpc.ssl_target_name_override", self.tls_server_name)]
            channel = grpc.secure_channel(address, credentials, options=options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        if self.token:
            channel = grpc.intercept_channel(channel, _AddMetadata(((TOKEN_METADATA, self.token),)))
        return channel

    # -- server side ---------------------------------------------------------------------------------
    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_server_credentials(
            [(self.tls_key, self.tls_cert)], root_certificates=self.tls_ca, require_client_auth=True
        )

    def server_interceptors(self) -> list[grpc.ServerInterceptor]:
        if not self.token:
            return []
        return [MetadataGate(self._check_token, lambda method: not method.startswith(HEALTH_PREFIX))]

    def _check_token(self, metadata: dict[str, str]) -> str | None:
        sent = metadata.get(TOKEN_METADATA)
        if sent is None:
            return f"missing service token: this service requires metadata {TOKEN_METADATA!r}"
        if not hmac.compare_digest(sent.encode(), self.token.encode()):
            return "invalid service token"
        return None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def engine_bind_host(host: str, security: ServiceSecurity) -> str:
    """Where an engine listens: `host` when its callers authenticate (service token or mutual TLS), else
    loopback (`host` itself when it is loopback already; ::1 for an IPv6 host)."""
    if security.token or security.tls or is_loopback(host):
        return host
    return "::1" if ":" in host else "127.0.0.1"


class _AddMetadata(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds fixed metadata to every call of a channel."""

    def __init__(self, pairs: tuple[tuple[str, str], ...]):
        self._pairs = pairs

    def _details(self, details):
        metadata = [*(details.metadata or ()), *self._pairs]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials, details.wait_for_ready)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


@dataclasses.dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: list
    credentials: object
    wait_for_ready: bool | None


class MetadataGate(grpc.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED and `check`'s message, every call to a method `applies` to whose
    metadata `check` does not accept (check returns None to let a call pass)."""

    def __init__(self, check: Callable[[dict[str, str]], str | None], applies: Callable[[str], bool]):
        self._check = check
        self._applies = applies

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not self._applies(handler_call_details.method):
            return handler
        metadata = {k: v for k, v in handler_call_details.invocation_metadata or () if isinstance(v, str)}
        refused = self._check(metadata)
        if refused is None:
            return handler
        return _refusing(handler, refused)


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that aborts at once (the request is never read)."""

    def unary(_request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    def streaming(_request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this a generator; abort raises first

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(
        streaming if handler.response_streaming else unary,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )

"""Run a gRPC server the way every ddtree service does.

Each service registers its servicer, plus grpc.health.v1 (SERVING for "" and for its own service
names) and server reflection. SIGTERM and SIGINT start a graceful stop: health flips to NOT_SERVING,
new RPCs are refused, in-flight RPCs get `grace_s` seconds to finish. The bound address is printed as
one line `LISTENING <service> <host>:<port>` so parents that started us on port 0 can find it.

A stop is logged (`service_stopping`, then `service_stopped` with the seconds its RPC drain and its engine
took). A process stopped by a signal and still alive `STUCK_STOP_S` seconds past the drain's grace (its
stop or its interpreter's exit hung) writes every thread's stack to stderr (faulthandler), so a shutdown
that hangs says where. SIGUSR1 writes them at once, from the signal handler itself (no GIL, no main thread
needed): what a supervisor sends before it kills a service that did not stop (launcher.ServiceProcess.stop).
"""

from __future__ import annotations

import faulthandler
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ddtree.protocol.security import ServiceSecurity
from ddtree.telemetry.logging import get_logger

# Feature tensors of a long commit can pass a few MB.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
SIGNAL_POLL_S = 1.0  # the main thread's longest sleep between looks for a signal's handler to run
STUCK_STOP_S = 30.0  # past the drain's grace: a stop this late dumps every thread's stack

log = get_logger("ddtree.server")


class RunningServer:
    """A started gRPC server with health and reflection; `stop()` is graceful and idempotent."""

    def __init__(
        self,
        server: grpc.Server,
        health_servicer: health.HealthServicer,
        service_names: Iterable[str],
        port: int,
        host: str,
        grace_s: float,
        on_stop: Callable[[], None] | None = None,
    ):
        self.server = server
        self.health = health_servicer
        self.service_names = tuple(service_names)
        self.port = port
        self.host = host
        self.grace_s = grace_s
        self._on_stop = on_stop
        self._stopped = threading.Event()
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self, grace_s: float | None = None) -> None:
        with self._lock:
            if self._stopped.is_set():
                return
            grace = self.grace_s if grace_s is None else grace_s
            log.info("service_stopping", services=list(self.service_names), grace_s=grace)
            start = time.monotonic()
            self.health.enter_graceful_shutdown()
            self.server.stop(grace).wait()
            drained = time.monotonic()
            if self._on_stop is not None:
                self._on_stop()
            log.info("service_stopped", drain_s=round(drained - start, 3),
                     engine_s=round(time.monotonic() - drained, 3))  # fmt: skip
            self._stopped.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """True once stopped; False when `timeout_s` passed first."""
        return self._stopped.wait(timeout_s)


def start_server(
    name: str,
    register: Callable[[grpc.Server], Iterable[str]],
    host: str,
    port: int,
    max_workers: int,
    grace_s: float,
    on_stop: Callable[[], None] | None = None,
    announce: bool = True,
    *,
    stream_threads: int = 0,
    security: ServiceSecurity | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    max_receive_bytes: int = MAX_MESSAGE_BYTES,
    handler_init: Callable[[], None] | None = None,
) -> RunningServer:
    """Create, register and start a server. `register(server)` adds servicers and returns the full
    service names it registered (e.g. "ddtree.v1.Verifier").

    The pool has `max_workers + stream_threads` threads and the server takes at most that many calls
    at once (more: RESOURCE_EXHAUSTED from grpcio, never a wait inside it); a service whose streams
    take `StreamSlots` of `stream_threads` keeps `max_workers` threads for unary calls and health.
    `security` adds mutual TLS and the service-token check (protocol/security.py). A request message
    over `max_receive_bytes` is refused by grpcio (RESOURCE_EXHAUSTED) before it is parsed. `handler_init`
    runs once on each handler thread (an engine's: models.runtime.cpu.single_threaded)."""
    threads = max_workers + stream_threads
    security = security or ServiceSecurity()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"{name}-rpc", initializer=handler_init),
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", max_receive_bytes),
        ],
        interceptors=[*security.server_interceptors(), *interceptors],
        maximum_concurrent_rpcs=threads,
    )
    names = list(register(server))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for service in ["", *names]:
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    credentials = security.server_credentials()
    if credentials is None:
        bound = server.add_insecure_port(f"{host}:{port}")
    else:
        bound = server.add_secure_port(f"{host}:{port}", credentials)
    if bound == 0:
        raise OSError(f"{name}: could not bind {host}:{port}")
    server.start()
    running = RunningServer(server, health_servicer, names, bound, host, grace_s, on_stop)
    if announce:
        print(f"LISTENING {name} {host}:{bound}", flush=True)
    return running


def stop_on_signals(running: RunningServer, stuck_after_s: float = STUCK_STOP_S) -> None:
    """SIGTERM / SIGINT -> graceful stop; SIGUSR1 -> every thread's stack on stderr (from the main thread only)."""

    def handler(signum, _frame):
        # The process is ending: its stop, then its interpreter's exit, have this long before the stacks
        # are written (the timer ends with the process; only a stop by signal arms it).
        faulthandler.dump_traceback_later(running.grace_s + stuck_after_s)
        threading.Thread(target=running.stop, name="graceful-stop", daemon=True).start()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def serve_until_stopped(running: RunningServer, stuck_after_s: float = STUCK_STOP_S) -> None:
    """A service process's main thread: SIGTERM / SIGINT stop it gracefully; returns once it has stopped."""
    stop_on_signals(running, stuck_after_s)
    # Python runs a signal's handler on the main thread only, once that thread runs bytecode again. A lock
    # wait wakes for a signal the kernel gave the main thread, not for one it gave another thread (any thread
    # that does not block it may take a process-directed signal): the poll bounds that delay.
    while not running.wait(SIGNAL_POLL_S):
        pass


def abort_invalid(context: grpc.ServicerContext, message: str) -> None:
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

"""Several verifiers behind one gateway: each request goes to the healthy verifier with the fewest
outstanding requests (ties rotate).

Addresses are resolved through DNS (services/protocol/discovery.py), so `verifier:50062` with
`docker compose --scale verifier=2` is two endpoints; names are re-resolved on every health poll and
new replicas join. Health is `grpc.health.v1` (service ""), polled every `health_interval_s` in a background thread; a
Generate that fails with UNAVAILABLE marks its verifier unhealthy at once, and the poller brings it
back when it answers SERVING again. When every verifier is unhealthy the request still goes to one of
them (health may be stale), so the client gets the verifier's own error rather than a guess.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddtree.gateway import metrics
from ddtree.protocol.ddtree.v1 import verifier_pb2_grpc
from ddtree.protocol.discovery import resolve
from ddtree.protocol.security import ServiceSecurity
from ddtree.protocol.server import GRPC_OPTIONS
from ddtree.telemetry.logging import get_logger


class Endpoint:
    """One verifier: its channel, stubs and the router's view of it (guarded by the router's lock)."""

    def __init__(self, address: str, security: ServiceSecurity):
        self.address = address
        self.channel = security.channel(address, GRPC_OPTIONS)
        self.stub = verifier_pb2_grpc.VerifierStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.outstanding = 0
        self.healthy = True  # optimistic until the first check says otherwise
        self.last_error = ""


class Router:
    def __init__(
        self, addresses: Iterable[str], health_interval_s: float = 2.0, security: ServiceSecurity | None = None
    ):
        self._spec = list(dict.fromkeys(addresses))
        self._security = security or ServiceSecurity()
        # A name that does not resolve yet is kept as given: gRPC resolves it when it can.
        self.endpoints = [Endpoint(a, self._security) for a in dict.fromkeys(self._expand())]
        if not self.endpoints:
            raise ValueError("router: no verifier addresses")
        self._interval = health_interval_s
        self._lock = threading.Lock()
        self._turn = itertools.count()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._log = get_logger("gateway.routing")
        for e in self.endpoints:
            metrics.VERIFIER_HEALTHY.labels(verifier=e.address).set(1)
            metrics.VERIFIER_OUTSTANDING.labels(verifier=e.address).set(0)

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(e.address for e in self.endpoints)

    def start(self) -> None:
        """Start polling health (only worth it with more than one verifier, but harmless with one)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._poll, name="gateway-health", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for e in self.endpoints:
            e.channel.close()

    # -- choosing --------------------------------------------------------------------------------------
    def acquire(self, exclude: Iterable[Endpoint] = ()) -> Endpoint | None:
        """The endpoint for a new request (its outstanding count taken), or None when all are excluded."""
        excluded = set(map(id, exclude))
        with self._lock:
            candidates = [e for e in self.endpoints if id(e) not in excluded]
            if not candidates:
                return None
            pool = [e for e in candidates if e.healthy] or candidates
            turn, n = next(self._turn), len(self.endpoints)
            order = {id(e): i for i, e in enumerate(self.endpoints)}
            best = min(pool, key=lambda e: (e.outstanding, (order[id(e)] - turn) % n))
            best.outstanding += 1
            metrics.VERIFIER_OUTSTANDING.labels(verifier=best.address).set(best.outstanding)
            return best

    def release(self, endpoint: Endpoint) -> None:
        with self._lock:
            endpoint.outstanding -= 1
            metrics.VERIFIER_OUTSTANDING.labels(verifier=endpoint.address).set(endpoint.outstanding)

    def first_healthy(self) -> Endpoint:
        with self._lock:
            return next((e for e in self.endpoints if e.healthy), self.endpoints[0])

    def mark_unhealthy(self, endpoint: Endpoint, reason: str) -> None:
        self._set_health(endpoint, False, reason)

    def snapshot(self) -> list[dict]:
        with self._lock:
            return [{"address": e.address, "healthy": e.healthy, "outstanding": e.outstanding} for e in self.endpoints]

    # -- health ------------------------------------------------------------------------------------------
    def check_now(self) -> None:
        """Probe every verifier once (the poller's body; tests call it to skip the wait)."""
        for e in self.endpoints:
            try:
                status = e.health.Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=min(1.0, self._interval)
                ).status
                ok, reason = (
                    status == health_pb2.HealthCheckResponse.SERVING,
                    health_pb2.HealthCheckResponse.ServingStatus.Name(status),
                )
            except grpc.RpcError as err:
                ok, reason = False, f"{err.code().name}: {err.details()}"
            self._set_health(e, ok, reason)

    def _set_health(self, endpoint: Endpoint, healthy: bool, reason: str) -> None:
        with self._lock:
            changed = endpoint.healthy != healthy
            endpoint.healthy = healthy
            endpoint.last_error = "" if healthy else reason
        metrics.VERIFIER_HEALTHY.labels(verifier=endpoint.address).set(1 if healthy else 0)
        if changed:
            self._log.warning(
                "verifier_health", verifier=endpoint.address, healthy=healthy, reason=reason if not healthy else None
            )

    def _expand(self) -> list[str]:
        out = []
        for item in self._spec:
            out += resolve(item) or [item]
        return out

    def discover(self) -> None:
        """Add endpoints for replicas that appeared behind a name since the last look."""
        known = set(self.addresses)
        fresh = [a for a in dict.fromkeys(self._expand()) if a not in known]
        if not fresh:
            return
        with self._lock:
            for address in fresh:
                self.endpoints.append(Endpoint(address, self._security))
                metrics.VERIFIER_HEALTHY.labels(verifier=address).set(1)
                metrics.VERIFIER_OUTSTANDING.labels(verifier=address).set(0)
        self._log.info("verifier_replicas_joined", verifiers=fresh)

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                self.discover()
            except ValueError as err:
                self._log.warning("verifier_discovery_error", error=str(err))
            self.check_now()
            self._stop.wait(self._interval)

"""Prometheus plumbing shared by the services (metric names fixed by docs/design.md §8).

Each service defines its own families in its own registry (`ddtree.verifier.metrics`,
`ddtree.drafter.metrics`, `ddtree.gateway.metrics`, each made by `service_registry()`), so a process
exports exactly its own families plus the standard `process_*` / `python_*` ones, never another
service's as zeros. Gauges that describe state (sequences running, KV slots held, draft contexts) are
`StateGauges`: computed at scrape time from the live objects that hold the state, so an idle service
reads its true state rather than the last step's. A service with `--metrics-port P` (P >= 0) serves its
registry at http://host:P/metrics (`serve_metrics`); the gateway also serves its on its HTTP port.
Observations are a few dict lookups per step: cheap enough to stay on.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Protocol

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily

from ddtree.telemetry.logging import get_logger

STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

_log = get_logger("ddtree.telemetry.metrics")


def service_registry() -> CollectorRegistry:
    """A service's own registry, with the process's standard families (process_*, python_*)."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


class StateSource(Protocol):
    def metric_state(self) -> Mapping[str, float]:
        """The current value of each state gauge, by key (thread-safe: called from the scrape thread)."""
        ...


class StateGauges:
    """Gauges computed at scrape time: each family's value is the sum, over the tracked sources, of
    `source.metric_state()[key]` (one source per process in production: the scheduler, the drafter
    servicer; tests may run several in one process). Sources are held weakly and untracked when they
    stop, so a stopped one stops counting."""

    def __init__(self, registry: CollectorRegistry, families: Mapping[str, tuple[str, str]]):
        """families: key -> (metric name, help)."""
        self._families = dict(families)
        self._sources: weakref.WeakSet = weakref.WeakSet()
        self._lock = threading.Lock()
        registry.register(self)

    def track(self, source: StateSource) -> None:
        with self._lock:
            self._sources.add(source)

    def untrack(self, source: StateSource) -> None:
        with self._lock:
            self._sources.discard(source)

    def values(self) -> dict[str, float]:
        """key -> the value a scrape would report now."""
        with self._lock:
            sources = list(self._sources)
        totals = dict.fromkeys(self._families, 0.0)
        for source in sources:
            try:
                state = source.metric_state()
            except Exception as err:  # a scrape must not fail for one source
                _log.warning("metric_state_failed", source=type(source).__name__, error=str(err))
                continue
            for key in totals:
                totals[key] += float(state.get(key, 0))
        return totals

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return [GaugeMetricFamily(name, doc) for name, doc in self._families.values()]

    def collect(self) -> Iterable[GaugeMetricFamily]:
        values = self.values()
        return [GaugeMetricFamily(name, doc, value=values[key]) for key, (name, doc) in self._families.items()]


def serve_metrics(port: int, host: str, registry: CollectorRegistry, announce: bool = True) -> int | None:
    """Serve this registry at http://host:port/metrics when port >= 0 (0 = any free port); returns the
    bound port and prints `LISTENING metrics host:port` (the launcher collects it)."""
    if port < 0:
        return None
    server, _thread = start_http_server(port, addr=host, registry=registry)
    bound = server.server_address[1]
    if announce:
        print(f"LISTENING metrics {host}:{bound}", flush=True)
    return bound

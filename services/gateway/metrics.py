"""The gateway's Prometheus families, in the gateway's own registry (served at HTTP /metrics and at
--metrics-port).

Request latencies are measured on the gateway's clock: what a client sees, less the network. The
gauges change with every request and health check (inc/dec, set), so they are true when idle.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from ddtree.telemetry.metrics import LATENCY_BUCKETS, STEP_BUCKETS, service_registry

ITL_BUCKETS = STEP_BUCKETS

REGISTRY = service_registry()

REQUESTS = Counter(
    "ddtree_gateway_requests", "Finished requests", ["api", "protocol", "outcome"], registry=REGISTRY
)  # outcome: finish reason or status code name
HTTP_ERRORS = Counter("ddtree_gateway_http_errors", "HTTP error responses by status", ["status"], registry=REGISTRY)
PROMPT_TOKENS = Counter("ddtree_gateway_prompt_tokens", "Prompt tokens of finished requests", registry=REGISTRY)
COMPLETION_TOKENS = Counter(
    "ddtree_gateway_completion_tokens", "Completion tokens of finished requests", registry=REGISTRY
)
TTFT = Histogram(
    "ddtree_gateway_time_to_first_token_seconds",
    "Request start to first token",
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
ITL = Histogram(
    "ddtree_gateway_inter_token_seconds",
    "Time between token batches, per token",
    buckets=ITL_BUCKETS,
    registry=REGISTRY,
)
E2E = Histogram("ddtree_gateway_request_seconds", "Request start to finish", buckets=LATENCY_BUCKETS, registry=REGISTRY)
RUNNING = Gauge("ddtree_gateway_running_requests", "Requests generating now", registry=REGISTRY)
VERIFIER_OUTSTANDING = Gauge(
    "ddtree_gateway_verifier_outstanding", "Requests in flight per verifier", ["verifier"], registry=REGISTRY
)
VERIFIER_HEALTHY = Gauge(
    "ddtree_gateway_verifier_healthy",
    "1 when the verifier passes its health check",
    ["verifier"],
    registry=REGISTRY,
)

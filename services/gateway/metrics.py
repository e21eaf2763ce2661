"""Prometheus metrics of the gateway, in the process-wide default registry (served at HTTP /metrics).

Request latencies are measured on the gateway's clock: what a client sees, less the network.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048)

REQUESTS = Counter(
    "ddtree_gateway_requests", "Finished requests", ["api", "protocol", "outcome"]
)  # outcome: finish reason or status code name
HTTP_ERRORS = Counter("ddtree_gateway_http_errors", "HTTP error responses by status", ["status"])
PROMPT_TOKENS = Counter("ddtree_gateway_prompt_tokens", "Prompt tokens of finished requests")
COMPLETION_TOKENS = Counter("ddtree_gateway_completion_tokens", "Completion tokens of finished requests")
TTFT = Histogram("ddtree_gateway_time_to_first_token_seconds", "Request start to first token", buckets=LATENCY_BUCKETS)
ITL = Histogram("ddtree_gateway_inter_token_seconds", "Time between token batches, per token", buckets=ITL_BUCKETS)
E2E = Histogram("ddtree_gateway_request_seconds", "Request start to finish", buckets=LATENCY_BUCKETS)
RUNNING = Gauge("ddtree_gateway_running_requests", "Requests generating now")
VERIFIER_OUTSTANDING = Gauge("ddtree_gateway_verifier_outstanding", "Requests in flight per verifier", ["verifier"])
VERIFIER_HEALTHY = Gauge("ddtree_gateway_verifier_healthy", "1 when the verifier passes its health check", ["verifier"])

"""Prometheus metrics of the services (names fixed by docs/design.md §8).

Metrics live in the process-wide default registry, so each service exposes exactly its own: the
verifier's step metrics, the drafter's draft metrics, the gateway's request latencies. A service with
`--metrics-port P` (P >= 0) serves them at http://host:P/metrics; the gateway also serves them on its
HTTP port. Observations are a few dict lookups per step: cheap enough to stay on.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

# Accepted length = root + matched nodes per step (1 = nothing accepted).
ACCEPT_BUCKETS = tuple(float(b) for b in range(1, 17)) + (24.0, 32.0, 64.0)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
CONTEXT_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
NODE_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

# ---- verifier ----
ACCEPT_LENGTH = Histogram(
    "ddtree_accept_length", "Tokens committed per step (root + matched nodes)", buckets=ACCEPT_BUCKETS
)
STEP_SECONDS = Histogram("ddtree_step_seconds", "Step time by phase", ["phase"], buckets=STEP_BUCKETS)
CONTEXT_TOKENS = Histogram(
    "ddtree_context_tokens", "Committed context per sequence at each step", buckets=CONTEXT_BUCKETS
)
TREE_NODES = Histogram("ddtree_tree_nodes", "Non-root tree nodes verified per sequence and step", buckets=NODE_BUCKETS)
FEATURE_BYTES = Counter("ddtree_feature_bytes", "Feature bytes sent to the drafter")
FEATURE_CHUNKS = Counter("ddtree_feature_chunks", "Commit chunks sent ahead of a Draft (Append RPC)")
FEATURE_APPEND_SECONDS = Histogram(
    "ddtree_feature_append_seconds", "Wall time of one step's Append call (chunked commits)", buckets=STEP_BUCKETS
)
GENERATED_TOKENS = Counter("ddtree_generated_tokens", "Tokens emitted by the verifier")
RUNNING = Gauge("ddtree_running_sequences", "Sequences in prefill or decode")
QUEUED = Gauge("ddtree_queued_requests", "Requests waiting for admission")
KV_USED = Gauge("ddtree_kv_slots_used", "Latent KV slots held by requests")
KV_CACHED = Gauge("ddtree_kv_slots_cached", "Latent KV slots held by the prefix cache")
KV_TOTAL = Gauge("ddtree_kv_slots_total", "Latent KV slots in the pool")
REQUESTS = Counter("ddtree_requests", "Finished requests by finish reason", ["finish_reason"])
DRAFTER_SET_ASIDE = Counter(
    "ddtree_drafter_replicas_set_aside", "Drafter replicas taken out of the pool (lost, or timed out)", ["reason"]
)
TTFT = Histogram("ddtree_time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS)
ITL = Histogram("ddtree_inter_token_seconds", "Time between streamed token batches, per token", buckets=STEP_BUCKETS)
E2E = Histogram("ddtree_request_seconds", "Arrival to finish", buckets=LATENCY_BUCKETS)

# ---- drafter ----
DRAFT_CALLS = Counter("ddtree_drafter_calls", "Draft calls served")
DRAFT_SECONDS = Histogram("ddtree_drafter_draft_seconds", "Drafter compute per Draft call", buckets=STEP_BUCKETS)
DRAFT_SEQUENCES = Gauge("ddtree_drafter_sequences", "Draft contexts held")
DRAFT_CONTEXT_BYTES = Gauge("ddtree_drafter_context_bytes", "Bytes of draft context held")
DRAFT_APPEND_CHUNKS = Counter("ddtree_drafter_append_chunks", "Commit chunks appended through Append calls")


_PHASE_SECONDS = {phase: STEP_SECONDS.labels(phase=phase) for phase in ("draft", "verify", "transport", "total")}


def observe_step(phase_ms: dict[str, float], accept_length: int, context: int, nodes: int, feature_bytes: int) -> None:
    for phase, child in _PHASE_SECONDS.items():  # children looked up once: a label lookup costs a few us
        child.observe(phase_ms[phase] / 1e3)
    ACCEPT_LENGTH.observe(accept_length)
    CONTEXT_TOKENS.observe(context)
    TREE_NODES.observe(nodes)
    FEATURE_BYTES.inc(feature_bytes)


def serve_metrics(port: int, host: str = "0.0.0.0") -> int | None:
    """Start the /metrics endpoint when port >= 0 (0 = any free port); returns the bound port."""
    if port < 0:
        return None
    server, _thread = start_http_server(port, addr=host)
    bound = server.server_address[1]
    print(f"LISTENING metrics {host}:{bound}", flush=True)
    return bound

"""The verifier's Prometheus families (names fixed by docs/design.md §8), in the verifier's own registry.

Served at --metrics-port by `ddtree.telemetry.metrics.serve_metrics(..., REGISTRY)`. The step
histograms and counters are observed by the scheduler thread; the state gauges (running, queued, KV
slots) are `STATE`, read from the scheduler at scrape time (`Scheduler.metric_state`).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from ddtree.telemetry.metrics import LATENCY_BUCKETS, STEP_BUCKETS, StateGauges, service_registry

# Accepted length = root + matched nodes per step (1 = nothing accepted).
ACCEPT_BUCKETS = tuple(float(b) for b in range(1, 17)) + (24.0, 32.0, 64.0)
CONTEXT_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
NODE_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

REGISTRY = service_registry()

ACCEPT_LENGTH = Histogram(
    "ddtree_accept_length",
    "Tokens committed per step (root + matched nodes)",
    buckets=ACCEPT_BUCKETS,
    registry=REGISTRY,
)
STEP_SECONDS = Histogram(
    "ddtree_step_seconds", "Step time by phase", ["phase"], buckets=STEP_BUCKETS, registry=REGISTRY
)
CONTEXT_TOKENS = Histogram(
    "ddtree_context_tokens",
    "Committed context per sequence at each step",
    buckets=CONTEXT_BUCKETS,
    registry=REGISTRY,
)
TREE_NODES = Histogram(
    "ddtree_tree_nodes",
    "Non-root tree nodes verified per sequence and step",
    buckets=NODE_BUCKETS,
    registry=REGISTRY,
)
FEATURE_BYTES = Counter("ddtree_feature_bytes", "Feature bytes sent to the drafter", registry=REGISTRY)
FEATURE_CHUNKS = Counter("ddtree_feature_chunks", "Commit chunks sent ahead of a Draft (Append RPC)", registry=REGISTRY)
FEATURE_APPEND_SECONDS = Histogram(
    "ddtree_feature_append_seconds",
    "Wall time of one step's Append call (chunked commits)",
    buckets=STEP_BUCKETS,
    registry=REGISTRY,
)
GENERATED_TOKENS = Counter("ddtree_generated_tokens", "Tokens emitted by the verifier", registry=REGISTRY)
REQUESTS = Counter("ddtree_requests", "Finished requests by finish reason", ["finish_reason"], registry=REGISTRY)
DRAFTER_SET_ASIDE = Counter(
    "ddtree_drafter_replicas_set_aside",
    "Drafter replicas taken out of the pool (lost, or timed out)",
    ["reason"],
    registry=REGISTRY,
)
DRAFT_CONTEXTS_RESENT = Counter(
    "ddtree_draft_contexts_resent",
    "Sequences whose draft context the drafter no longer held (released, lease expired, drafter restarted), "
    "sent again with reset=True so that their speculation resumes",
    registry=REGISTRY,
)
TTFT = Histogram(
    "ddtree_time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS, registry=REGISTRY
)
ITL = Histogram(
    "ddtree_inter_token_seconds",
    "Time between streamed token batches, per token",
    buckets=STEP_BUCKETS,
    registry=REGISTRY,
)
TREE_CUT = Gauge(
    "ddtree_tree_cut_fit",
    "--tree-cut cost's step-cost fit (ddtree.tree.step_cost): verify_ms (intercept), row_ms, row_ms_per_1k_context, "
    "draft_ms (the Draft call)",
    ["term"],
    registry=REGISTRY,
)
E2E = Histogram("ddtree_request_seconds", "Arrival to finish", buckets=LATENCY_BUCKETS, registry=REGISTRY)

# State, read at scrape time (keys of Scheduler.metric_state).
STATE = StateGauges(
    REGISTRY,
    {
        "running": ("ddtree_running_sequences", "Sequences in prefill or decode"),
        "queued": ("ddtree_queued_requests", "Requests waiting for admission"),
        "kv_used": (
            "ddtree_kv_slots_used",
            "Latent KV slots held by running requests, the cached prefixes they pin included",
        ),
        "kv_cached": ("ddtree_kv_slots_cached", "Latent KV slots the prefix cache holds that no request pins"),
        "kv_total": ("ddtree_kv_slots_total", "Latent KV slots in the pool"),
    },
)

_PHASE_SECONDS = {phase: STEP_SECONDS.labels(phase=phase) for phase in ("draft", "verify", "transport", "total")}


def observe_step(phase_ms: dict[str, float], accept_length: int, context: int, nodes: int, feature_bytes: int) -> None:
    for phase, child in _PHASE_SECONDS.items():  # children looked up once: a label lookup costs a few us
        child.observe(phase_ms[phase] / 1e3)
    ACCEPT_LENGTH.observe(accept_length)
    CONTEXT_TOKENS.observe(context)
    TREE_NODES.observe(nodes)
    FEATURE_BYTES.inc(feature_bytes)

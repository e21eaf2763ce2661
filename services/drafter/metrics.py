"""The drafter's Prometheus families, in the drafter's own registry (served at --metrics-port).

Calls and compute are observed by the servicer; the state gauges (draft contexts and their bytes) are
`STATE`, read at scrape time from the servicers' state (`DrafterServicer.metric_state`).
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from ddtree.telemetry.metrics import STEP_BUCKETS, StateGauges, service_registry

REGISTRY = service_registry()

DRAFT_CALLS = Counter("ddtree_drafter_calls", "Draft calls served", registry=REGISTRY)
DRAFT_SECONDS = Histogram(
    "ddtree_drafter_draft_seconds", "Drafter compute per Draft call", buckets=STEP_BUCKETS, registry=REGISTRY
)
DRAFT_APPEND_CHUNKS = Counter(
    "ddtree_drafter_append_chunks", "Commit chunks appended through Append calls", registry=REGISTRY
)
CONTEXTS_RELEASED = Counter(
    "ddtree_drafter_contexts_released",
    "Draft contexts the drafter released itself (reason: orphaned by a restarted verifier, expired lease)",
    ["reason"],
    registry=REGISTRY,
)
CONTEXTS_UNKNOWN = Counter(
    "ddtree_drafter_contexts_unknown",
    "Sequences committed without reset whose context this drafter did not hold (answered in unknown_seq_ids)",
    registry=REGISTRY,
)
CALLS_REFUSED = Counter(
    "ddtree_drafter_calls_refused",
    "Calls refused (reason: not_owner = they named draft contexts another caller holds)",
    ["reason"],
    registry=REGISTRY,
)

# State, read at scrape time (keys of DrafterServicer.metric_state).
STATE = StateGauges(
    REGISTRY,
    {
        "sequences": ("ddtree_drafter_sequences", "Draft contexts held"),
        "context_bytes": ("ddtree_drafter_context_bytes", "Bytes of draft context held"),
    },
)

"""The step record of a verified sequence (contract/step_record.py): built from the step's clock and what
its Draft call reported, then logged (`--step-log`) and exported (the verifier's Prometheus histograms)."""

from __future__ import annotations

import dataclasses

from ddtree.contract.step_record import StepRecord
from ddtree.verifier import metrics
from ddtree.verifier.sequence import DraftedTree


@dataclasses.dataclass(frozen=True)
class StepClock:
    """perf_counter times of one scheduler step."""

    start: float  # before its Draft call
    forward: float  # the forward's start
    committed: float  # after every item's commit


def step_record(
    step: int, context_tokens: int, tree_nodes: int, accept_length: int, drafted: DraftedTree | None, clock: StepClock
) -> StepRecord:
    """The record of a verified sequence's step: total_ms runs from the step's start (before its Draft
    call) to the commit, verify_ms from the forward's start."""
    return StepRecord(
        step=step,
        context_tokens=context_tokens,
        tree_nodes=tree_nodes,
        accept_length=accept_length,
        draft_ms=drafted.draft_ms if drafted else 0.0,
        verify_ms=(clock.committed - clock.forward) * 1e3,
        transport_ms=drafted.transport_ms if drafted else 0.0,
        total_ms=(clock.committed - clock.start) * 1e3,
        feature_bytes=drafted.feature_bytes if drafted else 0,
    )


def publish_record(record: StepRecord, request_id: str, step_log) -> None:
    """Log the record (step_log: the step-log sink, or None = off) and export it as metrics."""
    if step_log is not None:
        step_log.info("step", request_id=request_id, **record.__dict__)
    metrics.observe_step(
        {
            "draft": record.draft_ms,
            "verify": record.verify_ms,
            "transport": record.transport_ms,
            "total": record.total_ms,
        },
        record.accept_length,
        record.context_tokens,
        record.tree_nodes,
        record.feature_bytes,
    )

"""The step record of a verified sequence (contract/step_record.py): built from the step's times and
what its Draft call reported, then logged (`--step-log`), exported (the verifier's Prometheus
histograms) and returned for the stream; the sequence's step count and accept lengths advance."""

from __future__ import annotations

from ddtree.contract.step_record import StepRecord
from ddtree.contract.token_tree import TokenTree
from ddtree.verifier import metrics
from ddtree.verifier.sequence import Sequence


def record_step(
    seq: Sequence, tree: TokenTree, accept_length: int, t0: float, t1: float, t2: float, step_log
) -> StepRecord:
    """The step record of a verified sequence (logged, exported, streamed); total_ms runs from the
    step's start t0 (before its Draft call) to the commit t2, verify_ms from t1 (the forward's start).
    step_log: the step-log sink, or None (off)."""
    drafted = seq.draft
    record = StepRecord(
        step=seq.steps,
        context_tokens=seq.context_len - accept_length,
        tree_nodes=tree.n,
        accept_length=accept_length,
        draft_ms=drafted.draft_ms if drafted else 0.0,
        verify_ms=(t2 - t1) * 1e3,
        transport_ms=drafted.transport_ms if drafted else 0.0,
        total_ms=(t2 - t0) * 1e3,
        feature_bytes=drafted.feature_bytes if drafted else 0,
    )
    seq.steps += 1
    seq.accept_lengths.append(accept_length)
    if step_log is not None:
        step_log.info("step", request_id=seq.request_id, **record.__dict__)
    metrics.observe_step(
        {
            "draft": record.draft_ms,
            "verify": record.verify_ms,
            "transport": record.transport_ms,
            "total": record.total_ms,
        },
        accept_length,
        record.context_tokens,
        record.tree_nodes,
        record.feature_bytes,
    )
    return record

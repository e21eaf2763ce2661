"""One verify step of one sequence, as measured: streamed in `GenerateResponse.steps`, logged, summed in usage."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class StepRecord:
    step: int
    context_tokens: int
    tree_nodes: int
    accept_length: int
    draft_ms: float
    verify_ms: float
    transport_ms: float
    total_ms: float
    feature_bytes: int


# The record's fields in order: also those of the proto StepStats and of a logged `step` event.
STEP_FIELDS = tuple(f.name for f in dataclasses.fields(StepRecord))

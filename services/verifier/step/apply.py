"""The one place a sequence's decode state changes: a step's outcome is written into it, streamed and
recorded (`apply_outcome`), and its life begins and ends here (`begin_prefill`, `end_sequence`).

An outcome lands in this order: KV (the page table keeps the committed rows), the committed tokens and
the root, the prefill progress, the drafter's pending commit, the features for the prefix cache, the
grammar's state, then the stream: a Features request's rows and a chunk's prompt logprobs first, then
the tokens (cut at a stop id or the length limit; the stop token itself is not emitted) with the step
record. The caller (the scheduler, under its lock) learns from the returned `Ending` whether the
sequence ends now, and removes it.
"""

from __future__ import annotations

import dataclasses
import time

import grpc

from ddtree.contract.step_record import StepRecord
from ddtree.telemetry.logging import get_logger
from ddtree.verifier import metrics
from ddtree.verifier.kv.kv_pool import LatentKVPool
from ddtree.verifier.sequence import Phase, Sequence, StreamEvent
from ddtree.verifier.step.step_outcome import StepOutcome
from ddtree.verifier.step.step_records import StepClock, publish_record, step_record

log = get_logger("ddtree.verifier.step.apply")
NO_CLOCK = StepClock(0.0, 0.0, 0.0)  # a step whose times are not measured (its record reports zero times)


@dataclasses.dataclass(frozen=True)
class Ending:
    """How a sequence ends: its finish reason, and for an error the message and status its stream ends with."""

    reason: str  # stop | length | abort | error
    announced: bool = False  # the last token event carried the finish reason already
    error: str | None = None
    status: grpc.StatusCode = grpc.StatusCode.INTERNAL


def begin_prefill(seq: Sequence) -> None:
    """Admitted: the sequence joins the running batch."""
    seq.phase = Phase.PREFILL


def apply_outcome(
    seq: Sequence, outcome: StepOutcome, pool: LatentKVPool, clock: StepClock = NO_CLOCK, step_log=None
) -> Ending | None:
    """Write `outcome` into `seq` and stream it. clock: the step's times (a verify's record); step_log: the
    step-log sink or None. Returns the sequence's Ending when it ends with this step, else None."""
    if outcome.failure is not None:
        return Ending("error", error=outcome.failure)
    context_before = seq.context_len
    if outcome.accepted_nodes is not None:
        seq.table.commit_tree(pool, outcome.accepted_nodes)
    elif outcome.kv_rows:
        seq.table.commit(outcome.kv_rows)
    seq.committed.extend(outcome.committed)
    if outcome.next_root is not None:
        seq.root = outcome.next_root
    if outcome.prefill_end is not None:
        seq.prefill_done = outcome.prefill_end
    if outcome.cached_tokens:
        seq.cached_tokens = outcome.cached_tokens
    seq.pending_commit = outcome.pending
    seq.drafter_seeded = seq.drafter_seeded or outcome.drafter_has_context
    if outcome.resends_context:
        seq.drafter_seeded, seq.context_resends = False, seq.context_resends + 1
    if outcome.stops_speculating:
        seq.use_spec = False
    if outcome.taps is not None and seq.feature_log is not None:
        seq.feature_log.append(outcome.taps.cpu())  # the prefix cache keeps its features on the host
    if seq.grammar is not None and outcome.emitted:
        seq.grammar.advance(list(outcome.emitted), outcome.grammar)  # its state moves with every emitted token
    if outcome.feature_rows is not None:
        seq.events.put(StreamEvent((), features=outcome.feature_rows))
    if outcome.prompt_logprobs is not None:
        seq.events.put(StreamEvent((), prompt_logprobs=outcome.prompt_logprobs))

    record = None
    if outcome.verified is not None:
        record = step_record(
            seq.steps, context_before, outcome.verified.n, outcome.accept_length, outcome.drafted, clock
        )
        seq.steps += 1
        seq.accept_lengths.append(outcome.accept_length)
        publish_record(record, seq.request_id, step_log)
        if seq.last_token_time is not None:
            metrics.ITL.observe((time.perf_counter() - seq.last_token_time) / max(len(outcome.emitted), 1))
    elif outcome.starts_decode:
        seq.phase = Phase.DECODE
        metrics.TTFT.observe(time.perf_counter() - seq.arrival)
    else:
        return None  # a prompt chunk before the last, or a prefix hit: nothing to emit yet
    metrics.GENERATED_TOKENS.inc(len(outcome.emitted))
    finish = _emit(seq, list(outcome.emitted), record, outcome.logprobs)
    if finish is not None:
        return Ending(finish, announced=True)
    return _dead_end(seq) if outcome.dead_end else None


def _emit(seq: Sequence, tokens: list[int], step: StepRecord | None, logprobs: tuple) -> str | None:
    """Append generated tokens, cut at a stop token or the length limit, and stream them. Returns the
    finish reason when they end the sequence ("stop" | "length"), else None."""
    out: list[int] = []
    finish = None
    for tok in tokens:
        if tok in seq.params.stop_token_ids:
            finish = "stop"
            seq.stop_token_id = tok
            break
        out.append(tok)
        if len(seq.generated) + len(out) >= seq.params.max_new_tokens:
            finish = "length"
            break
    now = time.perf_counter()
    if seq.first_token_time is None:
        seq.first_token_time = now
    if out:
        seq.last_token_time = now
    seq.generated.extend(out)
    if seq.penalty_counts is not None:
        seq.penalty_counts.add(out)  # penalties count exactly the tokens of `generated`
    seq.finish_reason = finish
    seq.events.put(StreamEvent(tuple(out), step, finish, logprobs=tuple(logprobs[: len(out)])))
    return finish


def _dead_end(seq: Sequence) -> Ending:
    """A dead end (no token allowed) ends its sequence. A grammar's (grammar.py): "stop" where the grammar
    accepts (a finished grammar whose stop ids min_tokens holds back), else an error naming why. Without a
    grammar the request's own masks (allowed_token_ids, bad_words, min_tokens' stop ids) excluded every token."""
    if seq.grammar is None:
        error = "no token is allowed: allowed_token_ids, bad_words and min_tokens' stop ids exclude every token"
        log.warning("logit_mask_dead_end", request_id=seq.request_id)
        return Ending("error", error=error, status=grpc.StatusCode.INVALID_ARGUMENT)
    matcher = seq.grammar.matcher
    if matcher.is_accepting() and not matcher.is_error():
        return Ending("stop")
    reason = seq.grammar.dead_end_reason()
    log.warning("grammar_dead_end", request_id=seq.request_id, reason=reason)
    # The request's own grammar (or its parser limits, grammar_limits) allows no way on: a client error.
    return Ending("error", error=f"grammar: no token is allowed ({reason})", status=grpc.StatusCode.INVALID_ARGUMENT)


def end_sequence(seq: Sequence, ending: Ending) -> bool:
    """The sequence's last event and its finished state; False when it had finished already."""
    if seq.phase is Phase.FINISHED:
        return False
    if ending.error is not None:
        seq.events.put(StreamEvent((), None, "error", error=ending.error, error_status=ending.status))
    elif not ending.announced:
        seq.finish_reason = ending.reason
        seq.events.put(StreamEvent((), None, ending.reason))
    seq.phase = Phase.FINISHED
    return True

"""`Sequence.iter_events`, the wait on a sequence's events that Generate and Features share: the events
in order, an error event aborting the RPC with its status (INTERNAL unless it says otherwise) and its
message, and the end of the wait when the client has gone away (no abort, nothing yielded after)."""

from __future__ import annotations

import grpc
import pytest

from ddtree.contract.sampling_params import SamplingConfig
from ddtree.verifier.sequence import GenerateParams, Sequence, StreamEvent


class _Aborted(Exception):
    pass


class _Context:
    """The two ServicerContext calls the wait makes; abort raises, as grpc's does."""

    def __init__(self, active: bool = True):
        self.active, self.aborted = active, None

    def is_active(self) -> bool:
        return self.active

    def abort(self, code, details):
        self.aborted = (code, details)
        raise _Aborted


def _seq() -> Sequence:
    return Sequence(GenerateParams("r", (1, 2, 3), SamplingConfig(), 8, frozenset(), False, 0))


def test_events_come_in_order_until_the_consumer_stops():
    seq, context = _seq(), _Context()
    sent = [StreamEvent((5,)), StreamEvent((6, 7)), StreamEvent((8,), finish_reason="length")]
    for event in sent:
        seq.events.put(event)
    got = []
    for event in seq.iter_events(context):
        got.append(event)
        if event.finish_reason:
            break
    assert got == sent and context.aborted is None


@pytest.mark.parametrize(
    "status, expected",
    [(None, grpc.StatusCode.INTERNAL), (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT)],
)
def test_an_error_event_aborts_with_its_status_and_message(status, expected):
    seq, context = _seq(), _Context()
    seq.events.put(StreamEvent((5,)))
    extra = {} if status is None else {"error_status": status}
    seq.events.put(StreamEvent((), None, "error", error="the failure", **extra))
    events = seq.iter_events(context)
    assert next(events).token_ids == (5,)
    with pytest.raises(_Aborted):
        next(events)
    assert context.aborted == (expected, "the failure")


def test_the_wait_ends_when_the_client_is_gone():
    seq, context = _seq(), _Context(active=False)
    assert list(seq.iter_events(context)) == []  # one 1 s poll finds no event and no client
    assert context.aborted is None

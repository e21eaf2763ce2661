"""A request's usage totals (`ddtree.v1.Usage`) from its verify steps: the one definition of them.

The verifier computes the usage it sends with a request's last message from here; the gateway uses it
only when it ends a stream itself (a stop string), over the messages it received and passed on.

Definitions, over the request's verify steps, with and without a tree (a step without one, e.g. for a
no_spec request, commits exactly one token):
- verify_steps: the number of verify steps.
- avg_accept_length: tokens committed per verify step, the mean of the steps' accept_length (root +
  matched nodes). 0.0 when there was no verify step (the first token comes from the prefill, which is
  no verify step). A no_spec request therefore reads 1.0.
- accept_histogram: [k] = verify steps that committed k tokens; index 0 is unused (always 0); empty
  when there was no verify step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ddtree.protocol.ddtree.v1 import common_pb2


def avg_accept_length(accept_lengths: Sequence[int]) -> float:
    """Tokens committed per verify step (0.0 without a step)."""
    return sum(accept_lengths) / len(accept_lengths) if accept_lengths else 0.0


def usage_from_steps(
    prompt_tokens: int, completion_tokens: int, accept_lengths: Iterable[int], ttft_ms: float, decode_ms: float
) -> common_pb2.Usage:
    """The usage of a request whose verify steps committed `accept_lengths` tokens each, in step order."""
    lengths = list(accept_lengths)
    histogram = [0] * (max(lengths) + 1 if lengths else 0)
    for n in lengths:
        histogram[n] += 1
    return common_pb2.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        verify_steps=len(lengths),
        avg_accept_length=avg_accept_length(lengths),
        accept_histogram=histogram,
        ttft_ms=ttft_ms,
        decode_ms=decode_ms,
    )

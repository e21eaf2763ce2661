"""Bucket sizes of the static-shape forwards (static_batch.py, dflash_static.py): the ladders from which
the verifier's step buckets (verifier/step/static_step.py) and the drafter's block buckets
(drafter/static_draft.py) are made, one CUDA graph per combination."""

from __future__ import annotations


def powers_of_two_up_to(top: int) -> list[int]:
    """1, 2, 4, ... and `top` itself last: [1, 2, 4, 8, 12] for 12."""
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    return sorted({min(1 << i, top) for i in range(top.bit_length() + 1)})


def doubling_sizes(first: int, last: int) -> list[int]:
    """first, 2·first, 4·first, ... below `last`, then `last`: [512, 1024, 1500] for (512, 1500)."""
    if first < 1 or last < 1:
        raise ValueError(f"first {first} and last {last} must be >= 1")
    sizes, size = [], first
    while size < last:
        sizes.append(size)
        size *= 2
    return [*sizes, last]

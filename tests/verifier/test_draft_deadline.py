"""The Draft deadline (verifier/drafting/draft_deadline.py) against a brute-force p99 of what it observed."""

from __future__ import annotations

import random

import pytest

from ddtree.verifier.drafting.draft_deadline import DraftDeadline


def _p99(samples: list[float]) -> float:
    """The 99th percentile by rank: sorted[floor(0.99 n)], capped at the last."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def test_the_ceiling_until_enough_calls_then_a_multiple_of_the_p99_within_the_bounds():
    d = DraftDeadline(ceiling_s=10.0, multiple=3.0, floor_s=0.5, window=64, min_samples=8)
    rng = random.Random(0)
    seen: list[float] = []
    for i in range(300):
        if len(seen) < 8:
            assert d.seconds() == 10.0
        else:
            want = min(10.0, max(0.5, 3.0 * _p99(seen[-64:])))
            assert d.seconds() == pytest.approx(want)
        assert d.seconds(long_commit=True) == 10.0  # a long commit's call always gets the ceiling
        x = rng.choice([0.01, 0.02, 0.05]) if i < 200 else rng.uniform(0.3, 5.0)  # fast, then slow
        d.observe(x)
        seen.append(x)
    assert d.seconds() == 10.0  # slow calls lift it to the ceiling, never past it


def test_a_fast_drafter_gets_the_floor():
    d = DraftDeadline(ceiling_s=10.0, floor_s=0.75)
    for _ in range(50):
        d.observe(0.004)
    assert d.seconds() == 0.75


@pytest.mark.parametrize(
    "kwargs",
    [dict(ceiling_s=1.0, floor_s=2.0), dict(ceiling_s=1.0, floor_s=0.0), dict(ceiling_s=1.0, multiple=0.0),
     dict(ceiling_s=1.0, window=0), dict(ceiling_s=1.0, min_samples=0)],
)  # fmt: skip
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="bad draft deadline"):
        DraftDeadline(**kwargs)

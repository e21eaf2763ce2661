"""Learning-rate schedule (linear warmup, cosine decay) and the step plan of a time-limited run."""

from __future__ import annotations

import math


def lr_at(step: int, total: int, warmup: int, base: float, min_ratio: float) -> float:
    """Step 0-based. Linear warmup to `base` over `warmup` steps, then cosine down to base * min_ratio
    at step `total`."""
    if step < warmup:
        return base * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def plan_steps(
    budget_s: float, done_steps: int, accum: int, train_s: float, data_s: float, pool: int, batches_seen: int
) -> int:
    """Total optimizer steps that fit in `budget_s` more seconds after `done_steps`.

    Each micro-batch costs `train_s`, plus `data_s` while it is a fresh one: with a pool of `pool`
    data batches (0 = every batch fresh) only the first `pool` micro-batches run the target."""
    budget_s = max(budget_s, 0.0)
    fresh_left = float("inf") if pool <= 0 else max(pool - batches_seen, 0)
    t_fresh = train_s + data_s
    if fresh_left * t_fresh >= budget_s:
        micro = budget_s / t_fresh
    else:
        micro = fresh_left + (budget_s - fresh_left * t_fresh) / max(train_s, 1e-9)
    return done_steps + max(1, int(micro // accum))

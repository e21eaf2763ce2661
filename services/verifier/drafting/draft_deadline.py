"""How long a step waits for one drafter replica: a deadline that follows the replica's own speed.

A Draft call gets `multiple` x the p99 of the replica's recent successful calls (the last `window`),
at least `floor_s` and at most `ceiling_s` (--draft-timeout-s). Until `min_samples` calls have been
timed (start-up: compilation, first contexts) it gets the ceiling, and so does a call that carries a
long commit in Append chunks (its time grows with the commit, not with the step). A hung replica then
costs one short wait, after which the pool sets it aside (drafter_pool.py); a replica that is merely
slower than usual moves its own p99 up.
"""

from __future__ import annotations

import collections
import threading


class DraftDeadline:
    def __init__(
        self, ceiling_s: float, multiple: float = 3.0, floor_s: float = 0.5, window: int = 256, min_samples: int = 8
    ):
        if not 0 < floor_s <= ceiling_s or multiple <= 0 or window < 1 or min_samples < 1:
            raise ValueError(
                f"bad draft deadline: ceiling {ceiling_s} s, floor {floor_s} s, multiple {multiple}, "
                f"window {window}, min_samples {min_samples}"
            )
        self.ceiling_s, self.multiple, self.floor_s, self.min_samples = ceiling_s, multiple, floor_s, min_samples
        self._recent: collections.deque[float] = collections.deque(maxlen=window)
        self._lock = threading.Lock()  # a pool drafts replicas from several threads

    def seconds(self, long_commit: bool = False) -> float:
        """The deadline of the next call (long_commit: it carries Append chunks)."""
        with self._lock:
            if long_commit or len(self._recent) < self.min_samples:
                return self.ceiling_s
            ordered = sorted(self._recent)
            p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        return min(self.ceiling_s, max(self.floor_s, self.multiple * p99))

    def observe(self, seconds: float) -> None:
        """A successful call's wall time (calls with Append chunks excluded)."""
        with self._lock:
            self._recent.append(seconds)

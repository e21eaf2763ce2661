"""Who holds each draft context, and when it was last used: the drafter's leases on its contexts.

Every call from a verifier names its caller (`Caller`: the verifier's instance name, stable across its
restarts, and an incarnation id made at its start). A draft context belongs to the caller whose call made
it, and is released by the drafter itself
- when no call has touched it for `lease_s` seconds (a verifier that died, a sequence never released), or
- at once when a caller of the same name shows up with another incarnation: that verifier restarted, so
  every context of its former self is orphaned.
A call that names no caller (a tool, an older verifier) holds its contexts under the empty name, and they
only expire. All of it is pure bookkeeping: the servicer asks which ids to release and releases them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable


@dataclasses.dataclass(frozen=True)
class Caller:
    name: str = ""  # the verifier's instance name ("" = anonymous)
    incarnation: str = ""  # made at the verifier's start


class Leases:
    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic):
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.lease_s, self._clock = lease_s, clock
        self._held: dict[str, tuple[Caller, float]] = {}  # seq id -> (holder, last touched)
        self._next_sweep = float("-inf")  # expired() scans the book at most every lease_s / 4
        self._incarnations: dict[str, str] = {}  # caller name -> its latest incarnation

    def arrive(self, caller: Caller) -> list[str]:
        """A call from `caller` starts: the ids orphaned by an earlier incarnation of its name (to release
        now). Anonymous callers orphan nothing."""
        if not caller.name:
            return []
        if self._incarnations.setdefault(caller.name, caller.incarnation) == caller.incarnation:
            return []
        self._incarnations[caller.name] = caller.incarnation
        return self._drop(lambda holder: holder.name == caller.name and holder.incarnation != caller.incarnation)

    def touch(self, seq_ids: Iterable[str], caller: Caller) -> None:
        """These contexts were used (or made) by `caller` now."""
        now = self._clock()
        for s in seq_ids:
            self._held[s] = (caller, now)

    def expired(self) -> list[str]:
        """The ids untouched for longer than the lease (dropped from the book: release them now). The scan
        runs at most every lease_s / 4 (every call asks): a context goes at most a quarter lease late."""
        now = self._clock()
        if now < self._next_sweep:
            return []
        self._next_sweep = now + self.lease_s / 4
        cutoff = now - self.lease_s
        stale = [s for s, (_, at) in self._held.items() if at < cutoff]
        for s in stale:
            del self._held[s]
        return stale

    def forget(self, seq_ids: Iterable[str]) -> None:
        """These contexts were released by their caller."""
        for s in seq_ids:
            self._held.pop(s, None)

    def _drop(self, orphaned: Callable[[Caller], bool]) -> list[str]:
        ids = [s for s, (holder, _) in self._held.items() if orphaned(holder)]
        for s in ids:
            del self._held[s]
        return ids

"""Who holds each draft context, and when it was last used: the drafter's leases on its contexts.

Every call from a verifier names its caller (`Caller`: the verifier's instance name, stable across its
restarts, and an incarnation id made at its start: 128 random bits, which no other process learns). A draft
context belongs to the caller (name and incarnation) whose call made it: only that caller may release it or
send its commits (`owned_by_others`), so a process that names a live verifier's name with another
incarnation can neither release nor overwrite its contexts. The drafter itself releases a context
- when no call has touched it for `lease_s` seconds (a verifier that died, a sequence never released), or
- when a caller of the same name has shown up with another incarnation and the former incarnation has
  made no call for `replace_idle_s`: that verifier restarted, so every context of its former self is
  orphaned (released at the first call of anyone after that, GetInfo included). A former incarnation that still calls is alive (a forged
  incarnation, or two verifiers under one name): its contexts stay; they go once it falls silent.
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


# A former incarnation silent this long is taken for dead when another incarnation of its name calls: a
# live verifier with contexts calls every step (far more often), a restarted one was down longer (its
# process start and model load alone take more).
REPLACE_IDLE_S = 3.0


class Leases:
    def __init__(
        self, lease_s: float, clock: Callable[[], float] = time.monotonic, replace_idle_s: float = REPLACE_IDLE_S
    ):
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.lease_s, self._clock, self.replace_idle_s = lease_s, clock, min(replace_idle_s, lease_s)
        self._held: dict[str, tuple[Caller, float]] = {}  # seq id -> (holder, last touched)
        self._next_sweep = float("-inf")  # expired() scans the book at most every lease_s / 4
        # caller name -> {incarnation: its last call}; an entry leaves with its last context (or at the sweep)
        self._seen: dict[str, dict[str, float]] = {}

    def arrive(self, caller: Caller) -> list[str]:
        """A call from `caller` starts: the ids orphaned by replaced incarnations (to release now). Any call,
        an anonymous one included, settles every name: an incarnation is replaced when another incarnation of
        its name was heard from later and it has been silent for replace_idle_s. So a restarted verifier's
        former contexts go at the first call after that, whoever makes it, not only at its own next call."""
        now = self._clock()
        if caller.name:
            self._seen.setdefault(caller.name, {})[caller.incarnation] = now
        gone: set[tuple[str, str]] = set()
        for name, seen in self._seen.items():
            if len(seen) < 2:
                continue
            # the caller is its name's latest incarnation (it calls now); elsewhere the last heard from
            latest = caller.incarnation if name == caller.name else max(seen, key=seen.__getitem__)
            gone.update((name, inc) for inc, at in seen.items() if inc != latest and now - at >= self.replace_idle_s)
        if not gone:
            return []
        for name, inc in gone:
            del self._seen[name][inc]
        return self._drop(lambda holder: (holder.name, holder.incarnation) in gone)

    def owned_by_others(self, seq_ids: Iterable[str], caller: Caller) -> list[str]:
        """The ids among seq_ids whose context another caller (name or incarnation) holds: `caller` may
        neither release them nor commit to them."""
        return [s for s in seq_ids if s in self._held and self._held[s][0] != caller]

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
        # the incarnations seen: only those still holding a context, or heard from within the lease
        holding = {(c.name, c.incarnation) for c, _ in self._held.values()}
        for name, seen in list(self._seen.items()):
            for inc, at in list(seen.items()):
                if at < cutoff and (name, inc) not in holding:
                    del seen[inc]
            if not seen:
                del self._seen[name]
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

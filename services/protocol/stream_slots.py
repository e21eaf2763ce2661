"""A fixed number of server-streaming calls at a time, refused at once beyond it.

A grpcio sync server runs each call on one thread of its pool for the call's whole life, and calls
beyond the pool wait inside grpcio, where no admission limit can see them and health checks queue
behind long streams. So a service gives its pool `unary threads + stream slots` threads, caps the
server's concurrent calls at that number (grpcio answers RESOURCE_EXHAUSTED above it), and each
stream takes a slot here first: when none is free it is refused with RESOURCE_EXHAUSTED before doing
any work, so the unary threads (health, GetInfo, Abort, Tokenize) are never taken by streams.
"""

from __future__ import annotations

import threading

import grpc


class StreamSlots:
    """Counts streams in progress; `take` admits one or aborts the call. Thread-safe."""

    def __init__(self, limit: int, what: str):
        if limit < 1:
            raise ValueError(f"stream slots: limit must be >= 1, got {limit}")
        self.limit = limit
        self._what = what  # names the setting in the refusal, e.g. "--max-streams"
        self._used = 0
        self._lock = threading.Lock()

    @property
    def in_use(self) -> int:
        return self._used

    def take(self, context: grpc.ServicerContext) -> None:
        """Admit the calling stream (its slot comes back when the call ends, however it ends) or abort
        it with RESOURCE_EXHAUSTED."""
        with self._lock:
            full = self._used >= self.limit
            if not full:
                self._used += 1
        if full:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.limit} streams in progress, the limit ({self._what}); retry later",
            )
        released = threading.Event()

        def give_back() -> None:
            if not released.is_set():  # the callback may run once only, but be sure
                released.set()
                with self._lock:
                    self._used -= 1

        if not context.add_callback(give_back):  # the call already ended
            give_back()

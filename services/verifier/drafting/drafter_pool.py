"""Drafter replicas: discovery, per-sequence affinity, and losing a replica without losing a token.

`--drafter` takes a comma-separated list of HOST:PORT. Every host is resolved with getaddrinfo, so a
DNS name with several addresses (docker compose `--scale drafter=3` gives one A record per replica)
becomes several replicas; names are re-resolved in the background every `resolve_interval_s`, and new
replicas join once they answer GetInfo. A sequence's draft context lives on one replica: it is
assigned at its first Draft (the live replica with the fewest sequences) and stays there. One step
sends one Draft RPC per replica, in parallel. When a replica fails, it leaves the pool and its
sequences take AR steps (exactly the same tokens) and send their context again (reset) to a replica
at a later step, as a sequence whose context a replica no longer holds does (`DraftResult.unknown`);
later sequences go to the replicas that remain. A replica whose Draft call times out is set aside the same way (a circuit
breaker: `drafter_replica_set_aside` in the log, `ddtree_drafter_replicas_set_aside{reason}` in the
metrics), so a hung drafter costs one draft deadline (a few times its own p99 call time:
draft_deadline.py), not one per step or per new sequence; the
background resolver probes it (GetInfo) and takes it back when it answers. Release calls never run on
the scheduler's thread.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Callable

import grpc
import torch

from ddtree.models.runtime.cpu import single_threaded
from ddtree.protocol.ddtree.v1 import drafter_pb2
from ddtree.protocol.discovery import resolve
from ddtree.protocol.security import ServiceSecurity
from ddtree.telemetry.logging import get_logger
from ddtree.verifier import metrics
from ddtree.verifier.drafting.draft_deadline import DraftDeadline
from ddtree.verifier.drafting.drafter_client import DrafterClient, DraftResult
from ddtree.verifier.drafting.feature_chunks import DEFAULT_CHUNK_BYTES
from ddtree.verifier.sequence import Sequence

log = get_logger("ddtree.verifier.drafting.drafter_pool")


class DrafterPool:
    def __init__(
        self,
        spec: str,
        timeout_s: float,
        connect_timeout_s: float = 60.0,
        resolve_interval_s: float = 10.0,
        security: ServiceSecurity | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        caller: drafter_pb2.Caller | None = None,
        deadline: Callable[[], DraftDeadline] | None = None,
        local_ring_bytes: int = 0,
        ring_device: torch.device | None = None,
    ):
        """caller: this verifier as every call names it (the drafters lease its contexts to it); deadline:
        makes each replica's Draft deadline (draft_deadline.py; None: timeout_s always)."""
        self.spec = spec
        self.caller = caller
        self._make_deadline = deadline
        self.local_ring_bytes = local_ring_bytes  # > 0: co-located replicas are called over their local channel
        self.ring_device = ring_device  # the verifier's device: a GPU keeps the ring's features on it
        self.security = security or ServiceSecurity()
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.resolve_interval_s = resolve_interval_s
        self._lock = threading.Lock()
        self._clients: dict[str, DrafterClient] = {}
        self._assigned: dict[str, str] = {}  # request id -> replica address
        # Draft calls serialise features: one thread each (models/runtime/cpu: no OpenMP pool of their own).
        self._executor = cf.ThreadPoolExecutor(
            max_workers=8, thread_name_prefix="draft-rpc", initializer=single_threaded
        )
        # Releases wait on their own threads: a hung replica must not hold up Draft calls to the others.
        self._releases = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="draft-release")
        deadline = time.monotonic() + connect_timeout_s
        while not self._clients:
            self._discover(connect_timeout_s=max(1.0, deadline - time.monotonic()))
            if not self._clients and time.monotonic() > deadline:
                raise ConnectionError(f"no drafter answered at {spec!r} within {connect_timeout_s:.0f}s")
        first = next(iter(self._clients.values()))
        self.info = first.info
        self._stop = threading.Event()
        self._resolver = threading.Thread(target=self._resolve_loop, name="drafter-resolver", daemon=True)
        self._resolver.start()

    # ---- what the scheduler reads ----
    @property
    def address(self) -> str:
        return self.spec

    @property
    def window(self) -> int:
        return self.info.window

    @property
    def tap_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.info.target_layer_ids)

    @property
    def replicas(self) -> list[str]:
        with self._lock:
            return list(self._clients)

    # ---- discovery ----
    def _compatible(self, client: DrafterClient) -> bool:
        info = getattr(self, "info", None)
        if info is None:
            return True
        same = (
            client.info.window == info.window
            and list(client.info.target_layer_ids) == list(info.target_layer_ids)
            and client.info.hidden_size == info.hidden_size
            and client.info.vocab_size == info.vocab_size
        )
        if not same:
            log.error("drafter_replica_incompatible", address=client.address)
        return same

    def _discover(self, connect_timeout_s: float) -> None:
        for addr in resolve(self.spec):
            with self._lock:
                if addr in self._clients:
                    continue
            try:
                client = DrafterClient(
                    addr,
                    self.timeout_s,
                    connect_timeout_s=connect_timeout_s,
                    security=self.security,
                    chunk_bytes=self.chunk_bytes,
                    caller=self.caller,
                    deadline=self._make_deadline() if self._make_deadline is not None else None,
                    local_ring_bytes=self.local_ring_bytes,
                    ring_device=self.ring_device,
                )
            except grpc.RpcError as err:
                log.warning("drafter_replica_unreachable", address=addr, code=str(err.code()))
                continue
            if not self._compatible(client):
                client.close()
                continue
            with self._lock:
                self._clients[addr] = client
            log.info("drafter_replica_joined", address=addr)

    def _resolve_loop(self) -> None:
        while not self._stop.wait(self.resolve_interval_s):
            try:
                self._discover(connect_timeout_s=2.0)
            except Exception as err:  # discovery must never take the verifier down
                log.warning("drafter_discovery_error", error=str(err))

    def _drop(self, addr: str, reason: str, event: str = "drafter_replica_lost") -> None:
        """Take a replica out of the pool; its sequences continue with AR, the resolver may bring it back."""
        with self._lock:
            client = self._clients.pop(addr, None)
            self._assigned = {rid: a for rid, a in self._assigned.items() if a != addr}
        if client is not None:
            client.close()
            metrics.DRAFTER_SET_ASIDE.labels(reason="timeout" if event != "drafter_replica_lost" else "lost").inc()
            log.error(event, address=addr, reason=reason)

    # ---- per step ----
    def _replica_for(self, seq: Sequence) -> str | None:
        with self._lock:
            addr = self._assigned.get(seq.draft_id)
            if addr is not None and addr in self._clients:
                return addr
            if addr is not None or seq.drafter_seeded:
                return None  # its replica is gone: the context is lost (resent once the pool has its loss)
            if not self._clients:
                return None
            load = {a: 0 for a in self._clients}
            for a in self._assigned.values():
                if a in load:
                    load[a] += 1
            # A replica at its max_sequences takes no new sequence (0 = an older drafter: no cap known).
            room = [a for a, c in self._clients.items() if not c.info.max_sequences or load[a] < c.info.max_sequences]
            if not room:
                return None  # every replica is full: this sequence decodes with AR
            addr = min(room, key=lambda a: (load[a], a))
            self._assigned[seq.draft_id] = addr
            return addr

    def draft(
        self, batch: list[tuple[Sequence, int]], vocab_size: int, table_widths: dict[str, int] | None = None
    ) -> DraftResult:
        """DrafterClient.draft over the replicas (table_widths: draft id -> K, those that ask for a table)."""
        groups: dict[str, list[tuple[Sequence, int]]] = {}
        failed: set[str] = set()
        unknown: set[str] = set()  # their context was on a replica that left: sent again once one takes them
        for seq, budget in batch:
            addr = self._replica_for(seq)
            if addr is None:
                (unknown if seq.drafter_seeded or seq.context_resends else failed).add(seq.draft_id)
            else:
                groups.setdefault(addr, []).append((seq, budget))
        with self._lock:
            clients = {a: self._clients.get(a) for a in groups}
        for addr in [a for a, c in clients.items() if c is None]:  # dropped since assignment
            unknown.update(seq.draft_id for seq, _ in groups.pop(addr))
        if len(groups) == 1:  # the common case: no thread hop
            ((addr, group),) = groups.items()
            futures = {addr: cf.Future()}
            try:
                futures[addr].set_result(clients[addr].draft(group, vocab_size, table_widths))
            except grpc.RpcError as err:
                futures[addr].set_exception(err)
        else:
            futures = {
                a: self._executor.submit(clients[a].draft, g, vocab_size, table_widths) for a, g in groups.items()
            }
        trees, tables, fbytes, draft_ms, rpc_ms = {}, {}, {}, 0.0, 0.0
        for addr, fut in futures.items():
            try:
                res = fut.result()
            except grpc.RpcError as err:
                ids = [seq.draft_id for seq, _ in groups[addr]]
                if err.code() == grpc.StatusCode.UNAVAILABLE:
                    unknown.update(ids)  # the replica left (restarting?): their contexts go to one that answers
                    self._drop(addr, f"{err.code()}: {err.details()}")
                    continue
                failed.update(ids)
                if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    # Hung (stopped, overloaded): set aside until a probe answers, so neither the next
                    # step nor a new sequence waits for it again.
                    waited = getattr(clients[addr], "last_deadline_s", self.timeout_s)
                    self._drop(addr, f"Draft took over {waited:.3g} s", event="drafter_replica_set_aside")
                else:
                    # The replica answers but this call failed (internal error, over its capacity): these
                    # sequences continue with AR and their contexts there are released, off this thread.
                    log.error("draft_call_failed", address=addr, code=str(err.code()), details=err.details())
                    self._releases.submit(self.release, ids)
                continue
            failed.update(res.failed)
            unknown.update(res.unknown)
            trees.update(res.trees)
            tables.update(res.tables)
            fbytes.update(res.feature_bytes)
            draft_ms, rpc_ms = max(draft_ms, res.draft_ms), max(rpc_ms, res.rpc_ms)
        return DraftResult(
            trees, draft_ms, rpc_ms, fbytes, frozenset(failed), tables=tables, unknown=frozenset(unknown - failed)
        )

    def release(self, draft_ids: list[str]) -> None:
        by_addr: dict[str, list[str]] = {}
        with self._lock:
            for rid in draft_ids:
                addr = self._assigned.pop(rid, None)
                if addr in self._clients:
                    by_addr.setdefault(addr, []).append(rid)
            clients = {a: self._clients[a] for a in by_addr}
        for addr, ids in by_addr.items():
            clients[addr].release(ids)

    def close(self) -> None:
        self._stop.set()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._releases.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()

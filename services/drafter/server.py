"""The Drafter gRPC service: decodes and validates Draft calls, runs the engine, returns trees.

The engine is anything with `draft(list[SeqDraftInput]) -> list[TokenTree | TokenTable]` (a table for a
sequence with table_width > 0), `release(ids) -> int` and `info() -> dict` of DrafterInfo fields: the DFlash
engine (the tests serve an oracle engine through the same server). A malformed call is answered
INVALID_ARGUMENT as a whole and changes no sequence's state (the engine validates every sequence before
touching any). A sequence sent without reset whose context is gone (released, expired, this drafter
restarted) is left out of the call and named in `unknown_seq_ids`: its caller sends the context again.
Every context is leased to the caller (verifier name and incarnation) whose call made it (leases.py):
released when idle past --context-lease-s, or once that verifier restarts under the same instance name;
a call that names another caller's context (Draft, Append, Release) is PERMISSION_DENIED and changes
nothing.
"""

from __future__ import annotations

import threading
import time

import grpc
import torch

from ddtree.config import DrafterConfig
from ddtree.drafter import metrics
from ddtree.drafter.call_error import DraftCallError
from ddtree.drafter.engine import SeqDraftInput, check_table_width
from ddtree.drafter.leases import Caller, Leases
from ddtree.drafter.local_server import LocalDraftServer
from ddtree.models.runtime.cpu import EngineThread, run_on, single_threaded
from ddtree.protocol.ddtree.v1 import drafter_pb2, drafter_pb2_grpc
from ddtree.protocol.feature_ring import FeatureRing
from ddtree.protocol.local_channel import host_id
from ddtree.protocol.security import ServiceSecurity, engine_bind_host
from ddtree.protocol.server import RunningServer, start_server
from ddtree.protocol.tensors import tensor_from_bytes, tensor_from_proto
from ddtree.telemetry.logging import get_logger
from ddtree.telemetry.metrics import serve_metrics
from ddtree.tree.best_first import MAX_TABLE_WIDTH, TokenTable

log = get_logger("ddtree.drafter")
MAX_SEQS_PER_CALL = 1024
MAX_SEQ_ID_CHARS = 256
MAX_CHUNKS_PER_APPEND = 65536  # 64 MiB messages: far beyond any window's worth of features


def decode_request(
    req: drafter_pb2.DraftRequest, vocab_size: int, ring_features: dict[str, torch.Tensor] | None = None
) -> list[SeqDraftInput]:
    """ring_features: the features of the sequences whose commit came through the co-located ring."""
    if len(req.seqs) > MAX_SEQS_PER_CALL:
        raise ValueError(f"{len(req.seqs)} sequences in one Draft call; the limit is {MAX_SEQS_PER_CALL}")
    out = []
    for i, s in enumerate(req.seqs):
        if not s.seq_id or len(s.seq_id) > MAX_SEQ_ID_CHARS:
            raise ValueError(f"seqs[{i}].seq_id must be 1..{MAX_SEQ_ID_CHARS} characters")
        try:
            check_table_width(s.table_width, s.chain, vocab_size)
        except ValueError as err:
            raise ValueError(f"seqs[{i}] (seq_id={s.seq_id!r}): {err}") from None
        feats = (ring_features or {}).get(s.seq_id)
        if feats is None:
            feats = tensor_from_proto(s.commit_features, what=f"seqs[{i}] ({s.seq_id}) commit_features")
        out.append(
            SeqDraftInput(
                seq_id=s.seq_id,
                commit_token_ids=tuple(s.commit_token_ids),
                commit_start=s.commit_start,
                commit_features=feats,
                root_token_id=s.root_token_id,
                budget=s.budget,
                reset=s.reset,
                chain=s.chain,
                table_width=s.table_width,
            )
        )
    return out


def decode_chunk(i: int, chunk: drafter_pb2.CommitChunk, ring_features: torch.Tensor | None = None) -> SeqDraftInput:
    """An Append chunk as the engine's input (no root, budget or chain: nothing is drafted); ring_features:
    its features when they came through the co-located ring."""
    if not chunk.seq_id or len(chunk.seq_id) > MAX_SEQ_ID_CHARS:
        raise ValueError(f"chunk {i}: seq_id must be 1..{MAX_SEQ_ID_CHARS} characters")
    feats = ring_features
    if feats is None:
        feats = tensor_from_proto(chunk.commit_features, what=f"chunk {i} ({chunk.seq_id}) commit_features")
    return SeqDraftInput(
        seq_id=chunk.seq_id,
        commit_token_ids=tuple(chunk.commit_token_ids),
        commit_start=chunk.commit_start,
        commit_features=feats,
        root_token_id=0,
        budget=0,
        reset=chunk.reset,
        chain=False,
    )


def _resolve_refs(request: drafter_pb2.DraftRequest, ring: FeatureRing) -> tuple[list[str], dict[str, torch.Tensor]]:
    """(the ids of sequences whose reference is bad or stale, taken out of the request; the features each
    other FeatureRef names, copied out of the ring: on its device plane's GPU, or the CPU)."""
    failed, keep, features = [], [], {}
    for i, s in enumerate(request.seqs):
        if s.HasField("commit_features_ref"):
            ref = s.commit_features_ref
            try:
                raw = ring.read(ref.offset, ref.nbytes, ref.generation)
                features[s.seq_id] = tensor_from_bytes(
                    raw, ref.shape, ref.dtype, what=f"seqs[{i}] ({s.seq_id}) features"
                )
            except ValueError as err:
                log.warning("feature_ref_rejected", seq_id=s.seq_id[:MAX_SEQ_ID_CHARS], reason=str(err))
                failed.append(s.seq_id)
                continue
        keep.append(s)
    if failed:
        kept = [s.SerializeToString() for s in keep]
        del request.seqs[:]
        for raw in kept:
            request.seqs.add().ParseFromString(raw)
    return failed, features


def decode_caller(msg: drafter_pb2.Caller) -> Caller:
    if len(msg.name) > MAX_SEQ_ID_CHARS or len(msg.incarnation) > MAX_SEQ_ID_CHARS:
        raise ValueError(f"caller name and incarnation must be at most {MAX_SEQ_ID_CHARS} characters")
    return Caller(msg.name, msg.incarnation)


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(
        self,
        engine,
        max_sequences: int,
        engine_thread: EngineThread | None = None,
        lease_s: float = DrafterConfig.context_lease_s,
    ):
        self.engine = engine
        self._leases = Leases(lease_s)  # which caller holds each context (leases.py)
        self.local_address = ""  # the co-located channel's socket (local_server.py), once serve_engine opens it
        self.maps_device_features = False  # that channel maps a ring's GPU buffer
        # Draft / Append compute runs there when given (models/runtime/cpu), else on the handler's thread.
        self._compute = run_on(engine_thread)
        self.max_sequences = max_sequences  # draft contexts held at once (--max-sequences)
        # What a table_width is checked against (an engine that reports none is bounded by MAX_TABLE_WIDTH alone).
        self.vocab_size = int(engine.info().get("vocab_size", MAX_TABLE_WIDTH))
        # The engine holds per-sequence state: one Draft call at a time.
        self._lock = threading.Lock()
        # What the state gauges read at scrape time (metric_state), noted under the lock after every call
        # that changes the engine's contexts: a scrape neither waits for a Draft nor reads a dict mid-change.
        self._state: dict[str, int] = {}
        self._note_state()
        metrics.STATE.track(self)

    def metric_state(self) -> dict[str, int]:
        return self._state

    def _settle(self, caller: Caller) -> None:
        """Release the contexts a call from `caller` finds orphaned (a former incarnation of its name) or
        expired (caller holds the lock)."""
        orphaned, expired = self._leases.arrive(caller), self._leases.expired()
        if orphaned or expired:
            self.engine.release(orphaned + expired)
            log.info("draft_contexts_released", orphaned=len(orphaned), expired=len(expired), caller=caller.name)
            metrics.CONTEXTS_RELEASED.labels(reason="orphaned").inc(len(orphaned))
            metrics.CONTEXTS_RELEASED.labels(reason="expired").inc(len(expired))

    def _check_owner(self, seq_ids, caller: Caller) -> None:
        """DraftCallError PERMISSION_DENIED when another caller holds one of these contexts (caller holds the
        lock): only the verifier incarnation that made a context may commit to it or release it."""
        taken = self._leases.owned_by_others(seq_ids, caller)
        if taken:
            metrics.CALLS_REFUSED.labels(reason="not_owner").inc()
            log.warning("draft_context_not_owner", caller=caller.name, seq_ids=len(taken))
            raise DraftCallError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{len(taken)} of these draft contexts belong to another caller (verifier name and incarnation)",
            )

    def _unknown(self, seqs: list[SeqDraftInput]) -> list[SeqDraftInput]:
        """The sequences committed without reset whose context this drafter does not hold (caller holds the
        lock): their caller resends the context with reset=True."""
        return [s for s in seqs if not s.reset and not self.engine.knows(s.seq_id)]

    def _note_state(self) -> None:
        """Record the engine's contexts for the state gauges (caller holds the lock)."""
        self._state = {
            "sequences": self.engine.info()["active_sequences"],
            "context_bytes": getattr(self.engine, "context_bytes", 0),
        }

    def Draft(self, request, context):
        try:
            return self.serve_draft(request)
        except DraftCallError as err:
            context.abort(err.code, err.details)

    def serve_draft(
        self, request: drafter_pb2.DraftRequest, ring: FeatureRing | None = None
    ) -> drafter_pb2.DraftResponse:
        """A Draft call from gRPC or the co-located channel (local_server.py, whose `ring` holds the features
        its FeatureRefs name); DraftCallError for a call that fails as a whole. A sequence whose reference
        cannot be read fails alone: no draft, its context released, listed in failed_seq_ids."""
        failed, ring_features = _resolve_refs(request, ring) if ring is not None else ([], {})
        try:
            seqs = decode_request(request, self.vocab_size, ring_features)
            caller = decode_caller(request.caller)
        except ValueError as err:
            raise DraftCallError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
        t0 = time.perf_counter()
        with self._lock:
            self._settle(caller)
            self._check_owner([s.seq_id for s in seqs] + failed, caller)
            if failed:  # their commit never reached the drafter: their contexts are out of step
                self.engine.release(failed)
                self._leases.forget(failed)
            unknown = self._unknown(seqs)
            if unknown:
                gone = {s.seq_id for s in unknown}
                seqs = [s for s in seqs if s.seq_id not in gone]
                metrics.CONTEXTS_UNKNOWN.inc(len(gone))
            new = sum(not self.engine.knows(s.seq_id) for s in seqs)
            held = self.engine.info()["active_sequences"]
            if new and held + new > self.max_sequences:
                # Nothing is drafted: the caller decodes these sequences without a drafter (AR, same tokens).
                raise DraftCallError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"drafter holds {held} draft contexts and the call starts {new} more; "
                    f"max_sequences is {self.max_sequences}",
                )
            try:
                drafts = self._compute(self.engine.draft, seqs) if seqs else []
            except ValueError as err:
                raise DraftCallError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
            finally:
                self._note_state()
            self._leases.touch((s.seq_id for s in seqs), caller)
            draft_ms = (time.perf_counter() - t0) * 1e3
        metrics.DRAFT_CALLS.inc()
        metrics.DRAFT_SECONDS.observe(draft_ms / 1e3)
        resp = drafter_pb2.DraftResponse(
            draft_ms=draft_ms, failed_seq_ids=failed, unknown_seq_ids=[s.seq_id for s in unknown]
        )
        for s, draft in zip(seqs, drafts):
            if isinstance(draft, TokenTable):
                resp.tables.add(
                    seq_id=s.seq_id,
                    depth=draft.depth,
                    width=draft.width,
                    logprobs=draft.logprobs.flatten().tolist(),
                    token_ids=draft.token_ids.flatten().tolist(),
                )
            else:
                resp.trees.add(
                    seq_id=s.seq_id,
                    token_ids=draft.token_ids,
                    parents=draft.parents,
                    depths=draft.depths,
                    scores=draft.scores,
                )
        return resp

    def Append(self, request_iterator, context):
        """Chunks of long commits, appended in order; the first inconsistent chunk (a gap, a wrong
        width, an unknown sequence without reset) ends the call with INVALID_ARGUMENT, and the caller
        decodes that call's sequences with AR."""
        chunks = nbytes = 0
        compute_s = 0.0
        try:
            for chunk in request_iterator:
                if chunks >= MAX_CHUNKS_PER_APPEND:
                    context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT, f"more than {MAX_CHUNKS_PER_APPEND} chunks in one call"
                    )
                try:
                    n, s = self.serve_chunk(chunks, chunk)
                except DraftCallError as err:
                    context.abort(err.code, err.details)
                chunks += 1
                nbytes += n
                compute_s += s
        finally:  # the contexts the chunks made or grew, for the state gauges (once per call)
            with self._lock:
                self._note_state()
        return drafter_pb2.AppendResponse(chunks=chunks, feature_bytes=nbytes, append_ms=compute_s * 1e3)

    def serve_chunk(
        self, index: int, chunk: drafter_pb2.CommitChunk, ring: FeatureRing | None = None
    ) -> tuple[int, float]:
        """Append one chunk (chunk `index` of its call) from gRPC or the co-located channel (whose `ring`
        holds the features a FeatureRef names); (feature bytes, compute seconds). DraftCallError when it
        cannot be appended: the caller's call fails as a whole (its sequences decode with AR)."""
        if not hasattr(self.engine, "append"):
            raise DraftCallError(grpc.StatusCode.UNIMPLEMENTED, "this drafter's engine takes commits in Draft only")
        try:
            features = None
            if chunk.HasField("commit_features_ref"):
                if ring is None:
                    raise ValueError(f"chunk {index}: a feature reference outside the co-located channel")
                ref = chunk.commit_features_ref
                raw = ring.read(ref.offset, ref.nbytes, ref.generation)
                features = tensor_from_bytes(raw, ref.shape, ref.dtype, what=f"chunk {index} ({chunk.seq_id}) features")
            seq = decode_chunk(index, chunk, features)
            caller = decode_caller(chunk.caller)
        except ValueError as err:
            raise DraftCallError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
        with self._lock:
            self._settle(caller)
            self._check_owner([seq.seq_id], caller)
            new = not self.engine.knows(seq.seq_id)
            held = self.engine.info()["active_sequences"]
            if new and held + 1 > self.max_sequences:
                raise DraftCallError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"drafter holds {held} draft contexts; max_sequences is {self.max_sequences}",
                )
            t0 = time.perf_counter()
            try:
                self._compute(self.engine.append, [seq])
            except ValueError as err:
                raise DraftCallError(grpc.StatusCode.INVALID_ARGUMENT, f"chunk {index}: {err}") from None
            compute_s = time.perf_counter() - t0
            self._leases.touch((seq.seq_id,), caller)
            metrics.DRAFT_APPEND_CHUNKS.inc()
            if ring is not None:  # one chunk per call: the state gauges now
                self._note_state()
        return seq.commit_features.numel() * seq.commit_features.element_size(), compute_s

    def Release(self, request, context):
        try:
            caller = decode_caller(request.caller)
        except ValueError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        with self._lock:
            self._settle(caller)
            try:
                self._check_owner(request.seq_ids, caller)
            except DraftCallError as err:
                context.abort(err.code, err.details)
            released = self.engine.release(list(request.seq_ids))
            self._leases.forget(request.seq_ids)
            self._note_state()
        return drafter_pb2.ReleaseResponse(released=released)

    def GetInfo(self, request, context):
        try:
            caller = decode_caller(request.caller)
        except ValueError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        with self._lock:
            self._settle(caller)
            self._note_state()
            return drafter_pb2.DrafterInfo(
                **self.engine.info(),
                max_sequences=self.max_sequences,
                local_address=self.local_address,
                host_id=host_id() if self.local_address else "",
                maps_device_features=self.maps_device_features,
            )


def _on_stop(servicer: DrafterServicer, engine_thread: EngineThread | None, local: LocalDraftServer | None) -> None:
    metrics.STATE.untrack(servicer)  # a stopped drafter's contexts stop counting
    if local is not None:
        local.close()
    if engine_thread is not None:
        engine_thread.close()
    close = getattr(servicer.engine, "close", None)  # a tensor-parallel engine stops its ranks
    if close is not None:
        close()


def serve_engine(engine, config: DrafterConfig, engine_thread: EngineThread | None = None) -> RunningServer:
    servicer = DrafterServicer(engine, config.max_sequences, engine_thread, config.context_lease_s)
    security = ServiceSecurity.from_config(config)
    local = None
    if config.local_channel == "auto" and not security.tls:
        map_device = bool(getattr(engine, "tree_on_device", False)) and torch.cuda.is_available()
        local = LocalDraftServer(
            servicer,
            thread_init=single_threaded if engine_thread is not None else None,
            map_device=map_device,
            token=security.token,
        )
        servicer.local_address, servicer.maps_device_features = local.path, map_device

    def register(server):
        drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server)
        return [drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name]

    host = engine_bind_host(config.host, security)
    if not (security.token or security.tls):
        log.warning("engine_unauthenticated", listening_on=host, asked=config.host,
                    message="no service token or mutual TLS: listening on loopback only")  # fmt: skip
    running = start_server(
        "drafter",
        register,
        host,
        config.port,
        config.max_workers,
        config.grace_s,
        lambda: _on_stop(servicer, engine_thread, local),
        security=security,
        handler_init=single_threaded if engine_thread is not None else None,
    )
    serve_metrics(config.metrics_port, config.host, metrics.REGISTRY)
    return running

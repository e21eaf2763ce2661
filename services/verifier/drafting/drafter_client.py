"""The verifier's side of the Drafter contract: one Draft RPC per step for the whole batch.

Each sequence sends only what the drafter has not seen (its pending commit, already trimmed to the
draft window) and its root. A sequence may ask for the drafter's top-K table instead of a tree
(`table_widths`: a grammar-constrained one, whose tree the verifier builds from grammar-valid tokens).
Trees and tables coming back are validated like any untrusted input: a bad one turns into an AR step
for that sequence, never into a wrong token.
"""

from __future__ import annotations

import dataclasses
import time

import grpc
import numpy as np
import torch

from ddtree.contract.token_tree import TokenTree
from ddtree.protocol.ddtree.v1 import drafter_pb2, drafter_pb2_grpc
from ddtree.protocol.security import ServiceSecurity
from ddtree.protocol.server import GRPC_OPTIONS
from ddtree.protocol.tensors import tensor_to_proto
from ddtree.telemetry.logging import get_logger
from ddtree.tree.best_first import TokenTable
from ddtree.verifier import metrics
from ddtree.verifier.drafting.draft_deadline import DraftDeadline
from ddtree.verifier.drafting.feature_chunks import DEFAULT_CHUNK_BYTES, split_commit
from ddtree.verifier.drafting.local_drafter import ChannelBroken, LocalDrafterChannel
from ddtree.verifier.sequence import Sequence

log = get_logger("ddtree.verifier.drafting.drafter_client")


@dataclasses.dataclass(frozen=True)
class DraftResult:
    trees: dict[str, TokenTree]  # by draft id; missing (and no table) = AR step for that sequence
    draft_ms: float  # drafter compute, as reported
    rpc_ms: float  # wall time of the RPC
    feature_bytes: dict[str, int]  # bytes of features sent, by draft id
    failed: frozenset[str] = frozenset()  # draft ids whose drafter failed: they continue with AR
    tables: dict[str, TokenTable] = dataclasses.field(default_factory=dict)  # by draft id: those that asked one
    # draft ids whose context the drafter no longer holds (released, expired, restarted): resent with reset=True
    unknown: frozenset[str] = frozenset()


class DrafterClient:
    def __init__(
        self,
        address: str,
        timeout_s: float,
        connect_timeout_s: float = 60.0,
        security: ServiceSecurity | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        caller: drafter_pb2.Caller | None = None,
        deadline: DraftDeadline | None = None,
        local_ring_bytes: int = 0,
        ring_device: torch.device | None = None,
    ):
        """caller: this verifier, named in every call (the drafter leases its contexts to it); deadline: of
        each Draft call (draft_deadline.py; None = timeout_s always); local_ring_bytes > 0: use the drafter's
        co-located channel when it offers one on this host (local_drafter.py), with a ring that large, its
        data on ring_device when that is a GPU the drafter can map (the verifier's: features stay there)."""
        self.address = address
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self.caller = caller or drafter_pb2.Caller()
        self.deadline = deadline or DraftDeadline(timeout_s, floor_s=timeout_s)
        security = security or ServiceSecurity()
        self.channel = security.channel(address, GRPC_OPTIONS)
        self.stub = drafter_pb2_grpc.DrafterStub(self.channel)
        self.info = self.stub.GetInfo(
            drafter_pb2.DrafterInfoRequest(caller=self.caller), timeout=connect_timeout_s, wait_for_ready=True
        )
        self.local = None
        if local_ring_bytes > 0:
            self.local = LocalDrafterChannel.open(self.info, local_ring_bytes, ring_device, security.token)

    @property
    def window(self) -> int:
        return self.info.window

    @property
    def tap_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.info.target_layer_ids)

    def draft(
        self, batch: list[tuple[Sequence, int]], vocab_size: int, table_widths: dict[str, int] | None = None
    ) -> DraftResult:
        """batch: (sequence, budget); table_widths: draft id -> K for the sequences that ask for a top-K
        table instead of a tree (SeqDraft.table_width; not with chain). Raises grpc.RpcError when the call
        fails as a whole. A commit over `chunk_bytes` of features goes ahead in chunks (`_append`, in the same
        deadline), its last piece in the Draft."""
        widths = table_widths or {}
        msgs, sent, chunks, features = [], {}, [], {}
        for seq, budget in batch:
            pend = seq.pending_commit
            reset = not seq.drafter_seeded
            width = widths.get(seq.draft_id, 0)
            msg = drafter_pb2.SeqDraft(
                seq_id=seq.draft_id,
                commit_start=pend.start if pend is not None else seq.context_len,
                root_token_id=seq.root,
                budget=budget,
                chain=seq.params.chain and not width,
                table_width=width,
            )
            sent[seq.draft_id] = 0
            if pend is not None:
                *ahead, last = split_commit(pend.token_ids, pend.start, pend.features, self.chunk_bytes)
                for piece in ahead:
                    chunk = drafter_pb2.CommitChunk(
                        seq_id=seq.draft_id,
                        commit_token_ids=piece.token_ids,
                        commit_start=piece.start,
                        reset=reset,
                        caller=self.caller,
                    )
                    chunks.append((chunk, piece.features))
                    sent[seq.draft_id] += piece.features.numel() * piece.features.element_size()
                    reset = False
                msg.commit_token_ids.extend(last.token_ids)
                msg.commit_start = last.start
                features[seq.draft_id] = last.features
                sent[seq.draft_id] += last.features.numel() * last.features.element_size()
            msg.reset = reset
            msgs.append(msg)
        t0 = time.perf_counter()
        self.last_deadline_s = self.deadline.seconds(long_commit=bool(chunks))
        deadline = t0 + self.last_deadline_s
        append_ms = 0.0
        if chunks:
            append_ms = self._append(chunks, deadline)
            metrics.FEATURE_CHUNKS.inc(len(chunks))
            metrics.FEATURE_APPEND_SECONDS.observe(time.perf_counter() - t0)
        remaining = max(deadline - time.perf_counter(), 0.001)
        resp = self._draft_call(msgs, features, remaining)
        rpc_ms = (time.perf_counter() - t0) * 1e3
        if not chunks:
            self.deadline.observe(rpc_ms / 1e3)
        budgets = {seq.draft_id: budget for seq, budget in batch}
        trees = {}
        for tree_msg in resp.trees:
            rid = tree_msg.seq_id
            # A tree where a table was asked is taken as a tree (a drafter that predates tables ignores
            # table_width): the grammar prunes it as under --grammar-tree prune.
            if rid not in budgets or rid in trees:
                log.error("drafter_bad_tree", draft_id=rid, reason="unknown or duplicate seq_id")
                continue
            try:
                tree = TokenTree(tuple(tree_msg.token_ids), tuple(tree_msg.parents), tuple(tree_msg.depths))
                tree.validate()
                tree = _with_scores(tree, tuple(tree_msg.scores), rid)
                if tree.n > budgets[rid]:
                    raise ValueError(f"tree has {tree.n} nodes, budget {budgets[rid]}")
                if any(not 0 <= t < vocab_size for t in tree.token_ids):
                    raise ValueError(f"token id outside [0, {vocab_size})")
            except ValueError as err:
                log.error("drafter_bad_tree", draft_id=rid, reason=str(err))
                continue
            trees[rid] = tree
        tables = {}
        for table_msg in resp.tables:
            rid = table_msg.seq_id
            try:
                if rid not in widths or rid in tables:
                    raise ValueError("unknown or duplicate seq_id, or a tree was asked")
                tables[rid] = _table(table_msg, widths[rid], self.info.block_size - 1, vocab_size)
            except ValueError as err:
                log.error("drafter_bad_table", draft_id=rid, reason=str(err))
        # Drafter compute = the Draft's and the chunks' context K/V; transport is the rest of the wall time.
        failed = frozenset(resp.failed_seq_ids) & budgets.keys()  # their features did not reach the drafter
        unknown = frozenset(resp.unknown_seq_ids) & budgets.keys()
        return DraftResult(trees, resp.draft_ms + append_ms, rpc_ms, sent, failed, tables=tables, unknown=unknown)

    def _append(self, chunks: list[tuple[drafter_pb2.CommitChunk, torch.Tensor]], deadline: float) -> float:
        """A long commit's earlier chunks, in order, before `deadline`; the drafter's compute ms for them.
        Over the co-located channel, one frame each (features through its ring), while there is one and
        they fit it; the rest in one gRPC Append stream, the features as bytes."""
        append_ms, rest = 0.0, list(chunks)
        while rest and self.local is not None:
            chunk, feats = rest[0]
            try:
                reply = self.local.append(chunk, feats, max(deadline - time.perf_counter(), 0.001))
            except ChannelBroken as err:
                log.warning("drafter_local_channel_lost", address=self.address, reason=str(err)[:200])
                self.local = None
                break
            if reply is None:  # too large for the ring: this chunk and the rest go over gRPC
                break
            append_ms += reply.append_ms
            rest.pop(0)
        if rest:
            for chunk, feats in rest:
                chunk.commit_features.CopyFrom(tensor_to_proto(feats))
            remaining = max(deadline - time.perf_counter(), 0.001)
            append_ms += self.stub.Append(iter(chunk for chunk, _ in rest), timeout=remaining).append_ms
        return append_ms

    def _draft_call(self, msgs: list, features: dict[str, torch.Tensor], timeout_s: float) -> drafter_pb2.DraftResponse:
        """The Draft call: over the co-located channel when there is one (features through its ring), else
        (or when that channel breaks: closed, then this call again) over gRPC with the features as bytes."""
        if self.local is not None:
            refs = self.local.put_all(features)
            if refs is not None:
                request = drafter_pb2.DraftRequest(seqs=msgs, caller=self.caller)
                for msg in request.seqs:
                    if msg.seq_id in refs:
                        msg.commit_features_ref.CopyFrom(refs[msg.seq_id])
                try:
                    return self.local.draft(request, timeout_s)
                except ChannelBroken as err:
                    log.warning("drafter_local_channel_lost", address=self.address, reason=str(err)[:200])
                    self.local = None
        for msg in msgs:
            if msg.seq_id in features:
                msg.commit_features.CopyFrom(tensor_to_proto(features[msg.seq_id]))
        return self.stub.Draft(drafter_pb2.DraftRequest(seqs=msgs, caller=self.caller), timeout=timeout_s)

    def release(self, draft_ids: list[str]) -> None:
        if not draft_ids:
            return
        try:
            self.stub.Release(drafter_pb2.ReleaseRequest(seq_ids=draft_ids, caller=self.caller), timeout=self.timeout_s)
        except grpc.RpcError as err:
            log.warning("drafter_release_failed", code=str(err.code()), count=len(draft_ids))

    def close(self) -> None:
        if self.local is not None:
            self.local.close()
        self.channel.close()


def _with_scores(tree: TokenTree, scores: tuple[float, ...], draft_id: str) -> TokenTree:
    """The tree with the drafter's node scores when they are well formed; without them otherwise (scores
    only steer how a capped batch shares tree tokens, so bad ones cost nothing but that)."""
    if not scores:
        return tree
    scored = TokenTree(tree.token_ids, tree.parents, tree.depths, scores)
    try:
        scored.validate_scores()  # the nodes were validated already
    except ValueError as err:
        log.warning("drafter_bad_scores", draft_id=draft_id, reason=str(err))
        return tree
    return scored


def _table(msg: drafter_pb2.TokenTable, width: int, max_depth: int, vocab_size: int) -> TokenTable:
    """A TokenTable message as asked (width K, at most the drafter's block_size - 1 rows), validated like a
    tree (TokenTable.validate: sorted finite log-probs, distinct ids in [0, vocab_size)); ValueError if not.
    The table's only check: the grammar build takes it as it is (ddtree.tree.build_checked_tree)."""
    if msg.width != width:
        raise ValueError(f"table width {msg.width}, asked {width}")
    if not 0 <= msg.depth <= max(max_depth, 0):
        raise ValueError(f"table depth {msg.depth} outside [0, {max_depth}] (the drafter's block_size - 1)")
    n = msg.depth * msg.width
    if len(msg.logprobs) != n or len(msg.token_ids) != n:
        raise ValueError(
            f"{len(msg.logprobs)} logprobs and {len(msg.token_ids)} token_ids for a {msg.depth} x {width} table"
        )
    table = TokenTable(  # through numpy: a repeated field converts in one pass, not element by element
        torch.from_numpy(np.asarray(msg.logprobs, dtype=np.float32)).view(msg.depth, width),
        torch.from_numpy(np.asarray(msg.token_ids, dtype=np.int64)).view(msg.depth, width),
    )
    table.validate(vocab_size)
    return table

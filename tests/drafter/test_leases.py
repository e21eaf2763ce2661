"""The drafter's leases on its draft contexts (drafter/leases.py): pure bookkeeping against a fake clock,
then through the real Drafter server: a restarted verifier (same name, new incarnation, the former one
silent) has its former contexts released at its first call, an idle context is released after the lease,
anonymous callers and other names are never orphaned, and a caller field over its limit is
INVALID_ARGUMENT. A forged incarnation of a live verifier's name (issue 47) orphans nothing, and its
Release or Draft of that verifier's contexts is PERMISSION_DENIED; a sequence whose context is gone comes
back in unknown_seq_ids while the rest of the call is drafted."""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from ddtree.config import DrafterConfig
from ddtree.contract.token_tree import TokenTree
from ddtree.drafter.leases import REPLACE_IDLE_S, Caller, Leases
from ddtree.drafter.server import serve_engine
from ddtree.protocol.ddtree.v1 import drafter_pb2, drafter_pb2_grpc
from ddtree.protocol.tensors import tensor_to_proto
from tests.support.fakes import stub_engine_info


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_expiry_orphaning_and_release_by_the_book():
    clock = Clock()
    leases = Leases(10.0, clock)
    a1, a2, b, anon = Caller("a", "1"), Caller("a", "2"), Caller("b", "1"), Caller()
    assert leases.arrive(a1) == [] and leases.arrive(b) == [] and leases.arrive(anon) == []
    leases.touch(["x", "y"], a1)
    leases.touch(["z"], b)
    leases.touch(["w"], anon)
    clock.now += 6
    leases.touch(["y"], a1)  # y is used again: its lease restarts
    clock.now += 5
    assert leases.expired() == ["x", "z", "w"]  # untouched for 11 s
    assert leases.expired() == []  # dropped from the book once reported
    leases.touch(["p", "q"], a1)
    leases.touch(["r"], b)
    assert leases.arrive(a1) == []  # the same incarnation again: nothing orphaned
    assert leases.arrive(a2) == []  # a1 called just now: alive (a forged or duplicate incarnation), kept
    assert leases.owned_by_others(["p", "r", "new"], a2) == ["p", "r"]  # a2 may not touch a1's or b's
    assert leases.owned_by_others(["p", "q"], a1) == []
    clock.now += REPLACE_IDLE_S  # a1 silent since: it restarted as a2
    assert sorted(leases.arrive(a2)) == ["p", "q", "y"]  # every context of a1
    assert leases.arrive(a1) == []  # a1 holds nothing any more (a late call of the old self orphans nothing)
    leases.forget(["r"])
    # a restart noticed by anyone: c1 made "s"; c2 (its restart) called once, before c1 had been silent long
    c1, c2 = Caller("c", "1"), Caller("c", "2")
    leases.touch(["s"], c1)
    assert leases.arrive(c1) == []
    clock.now += 0.5
    assert leases.arrive(c2) == []
    clock.now += REPLACE_IDLE_S / 2 - 0.5
    assert leases.arrive(anon) == []  # c1 not yet silent for replace_idle_s
    clock.now += REPLACE_IDLE_S / 2
    assert leases.arrive(anon) == ["s"]  # an anonymous call (a GetInfo) settles c's restart
    clock.now += 100
    assert leases.expired() == []  # r was released by its caller, the rest by orphaning
    with pytest.raises(ValueError, match="lease_s"):
        Leases(0)


class ContextEngine:
    """Holds a context per sequence it drafted, as the DFlash engine does; one-node trees."""

    def __init__(self):
        self.held: set[str] = set()

    def info(self):
        return {**stub_engine_info("contexts", 16), "active_sequences": len(self.held)}

    def knows(self, seq_id):
        return seq_id in self.held

    def draft(self, seqs):
        self.held.update(s.seq_id for s in seqs)
        return [TokenTree((5,), (0,), (1,)) for _ in seqs]

    def release(self, ids):
        ids = set(ids) & self.held
        self.held -= ids
        return len(ids)


def _draft(stub, ids, caller):
    seqs = [drafter_pb2.SeqDraft(seq_id=i, commit_start=0, root_token_id=3, reset=True) for i in ids]
    for s in seqs:
        s.commit_features.CopyFrom(tensor_to_proto(torch.zeros(0, 16)))
    stub.Draft(drafter_pb2.DraftRequest(seqs=seqs, caller=caller), timeout=30)


def _active(stub, caller=None) -> int:
    return stub.GetInfo(drafter_pb2.DrafterInfoRequest(caller=caller), timeout=30).active_sequences


def test_a_restarted_verifier_and_an_idle_context_are_released_by_the_server():
    engine = ContextEngine()
    server = serve_engine(engine, DrafterConfig(port=0, grace_s=0.0, context_lease_s=REPLACE_IDLE_S + 1.0))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = drafter_pb2_grpc.DrafterStub(ch)
            old, other = drafter_pb2.Caller(name="v", incarnation="1"), drafter_pb2.Caller(name="w", incarnation="1")
            forged = drafter_pb2.Caller(name="v", incarnation="evil")
            _draft(stub, ["a", "b", "c", "d", "e"], old)
            _draft(stub, ["f"], other)
            _draft(stub, ["g"], drafter_pb2.Caller())  # anonymous
            assert _active(stub) == 7
            # "v" is alive (it just called): another incarnation of its name releases nothing, and may not
            # release or overwrite its contexts
            assert _active(stub, forged) == 7
            for call in (
                lambda: stub.Release(drafter_pb2.ReleaseRequest(seq_ids=["a"], caller=forged), timeout=30),
                lambda: _draft(stub, ["b"], forged),
                lambda: stub.Release(drafter_pb2.ReleaseRequest(seq_ids=["f"], caller=old), timeout=30),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert engine.held == {"a", "b", "c", "d", "e", "f", "g"}
            # a commit without reset for a context the drafter lost: named back, the others still drafted
            seqs = [drafter_pb2.SeqDraft(seq_id=i, commit_start=0, root_token_id=3) for i in ("a", "gone")]
            for s in seqs:
                s.commit_features.CopyFrom(tensor_to_proto(torch.zeros(0, 16)))
            resp = stub.Draft(drafter_pb2.DraftRequest(seqs=seqs, caller=old), timeout=30)
            assert list(resp.unknown_seq_ids) == ["gone"] and [t.seq_id for t in resp.trees] == ["a"]
            _draft(stub, ["f"], other)
            _draft(stub, ["g"], drafter_pb2.Caller())
            time.sleep(REPLACE_IDLE_S + 0.1)  # "v" silent since: restarted
            # "v" comes back with a new incarnation: its GetInfo at connection releases a..e, nothing else
            assert _active(stub, drafter_pb2.Caller(name="v", incarnation="2")) == 2
            assert engine.held == {"f", "g"}
            _draft(stub, ["f"], other)  # f is used again; g stays idle
            time.sleep(1.0)
            assert _active(stub) == 1 and engine.held == {"f"}  # g's lease ran out, f's did not
            with pytest.raises(grpc.RpcError) as err:
                _draft(stub, ["h"], drafter_pb2.Caller(name="x" * 300, incarnation="1"))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "caller name and incarnation" in err.value.details()
    finally:
        server.stop(0)


def test_an_engine_without_token_or_tls_listens_on_loopback_only():
    """Issue 47: whatever --host says, an engine that authenticates no caller is reachable from this machine
    only; a token (or mutual TLS) lets it listen where it is told."""
    from ddtree.protocol.security import ServiceSecurity, engine_bind_host

    open_, keyed = ServiceSecurity(), ServiceSecurity(token="t")
    assert engine_bind_host("0.0.0.0", open_) == "127.0.0.1" and engine_bind_host("::", open_) == "::1"
    assert engine_bind_host("10.1.2.3", open_) == "127.0.0.1"
    assert engine_bind_host("127.0.0.2", open_) == "127.0.0.2" and engine_bind_host("localhost", open_) == "localhost"
    assert engine_bind_host("0.0.0.0", keyed) == "0.0.0.0"
    server = serve_engine(ContextEngine(), DrafterConfig(host="0.0.0.0", port=0, grace_s=0.0))
    try:
        assert server.address.startswith("127.0.0.1:")
    finally:
        server.stop(0)

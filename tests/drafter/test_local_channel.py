"""The co-located drafter channel (protocol/local_channel.py, drafter/local_server.py,
verifier/drafting/local_drafter.py): the feature ring's records and its checks; the same trees through the channel
as through gRPC (two drafters from one checkpoint); a bad, stale or overwritten feature reference costs
only its own sequence's draft (failed_seq_ids, its context released); a drafter that goes away sends the
client back to gRPC."""

from __future__ import annotations

import json
import os

import grpc
import pytest
import torch

from ddtree.config import DrafterConfig
from ddtree.contract.sampling_params import SamplingConfig
from ddtree.drafter.server import serve_engine
from ddtree.protocol.ddtree.v1 import drafter_pb2
from ddtree.protocol.device_plane import DevicePlaneHandle
from ddtree.protocol.feature_ring import FeatureRing
from ddtree.protocol.local_channel import APPEND
from ddtree.protocol.security import ServiceSecurity
from ddtree.verifier.drafting.drafter_client import DrafterClient
from ddtree.verifier.drafting.local_drafter import LocalDrafterChannel, LocalRpcError
from ddtree.verifier.sequence import GenerateParams, PendingCommit, Sequence
from tests.support.draft_engines import random_draft_engine

F = 64  # the random drafter's feature width (2 taps x 32)


def _u8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def test_ring_records_wrap_and_bad_references_are_refused(tmp_path):
    ring = FeatureRing.create(4096, str(tmp_path))
    reader = FeatureRing.attach(ring.path)
    refs = [ring.write(_u8(bytes([i]) * (300 + i))) for i in range(20)]  # ~6 KB in all: it wraps
    assert min(off for off, _, _ in refs[5:]) == 0, "the ring never wrapped"
    last = refs[-1]
    assert bytes(reader.read(*last).tolist()) == bytes([19]) * 319
    for bad in [(last[0], last[1], last[2] - 1), (last[0], last[1] + 1, last[2]), (4096, 10, 1), (last[0] + 8, 10, 1)]:
        with pytest.raises(ValueError, match="stale|outside the ring"):
            reader.read(*bad)
    stale = refs[0]  # overwritten since
    with pytest.raises(ValueError, match="stale"):
        reader.read(*stale)
    with pytest.raises(ValueError, match="do not fit"):
        ring.write(torch.zeros(3000, dtype=torch.uint8))
    reader.close()
    ring.close(unlink=True)
    with pytest.raises(ValueError, match="not a feature ring"):
        FeatureRing.attach("/etc/hostname")  # a HELLO naming another file is refused


def test_records_keep_any_dtype_bit_for_bit(tmp_path):
    ring = FeatureRing.create(1 << 16, str(tmp_path))
    reader = FeatureRing.attach(ring.path)
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(3, 40, generator=g).to(dtype)
        raw = reader.read(*ring.write(x))
        assert raw.dtype == torch.uint8 and torch.equal(raw.view(dtype).view(3, 40), x)
    reader.close()
    ring.close(unlink=True)


def test_a_hello_is_checked_and_a_device_plane_that_cannot_be_mapped_leaves_the_features_in_shared_memory(tmp_path):
    ring = FeatureRing.create(4096, str(tmp_path))
    for bad, words in ((b"not json", "not JSON"), (b'{"path": 1}', "path, device_plane"),
                       (json.dumps({"path": "/etc/hostname", "device_plane": None}).encode(), "not a feature ring"),
                       (b"{" * 70000, "at most")):  # fmt: skip
        with pytest.raises(ValueError, match=words):
            FeatureRing.from_hello(bad, use_device=True)
    assert json.loads(ring.hello()) == {"path": ring.path, "device_plane": None}  # a CPU verifier offers none
    fields = dict(device_uuid="GPU-0", storage_handle="00", storage_size=4096, storage_offset=0,
                  ref_counter_handle="00", ref_counter_offset=0, event_handle="00", event_sync_required=False,
                  written_event="00", consumed_event="00", size=4096)  # fmt: skip
    handle = DevicePlaneHandle.from_json(json.loads(json.dumps(fields)))  # what crosses the socket, both ways
    assert handle.storage_handle == b"\x00" and json.loads(json.dumps(handle.to_json())) == fields
    for plane, why in ((fields, "no local CUDA device"), ({**fields, "size": -1}, "non-negative"),
                       ({**fields, "storage_handle": "zz"}, "hex"), ({"x": 1}, "exactly the fields")):  # fmt: skip
        hello = json.dumps({"path": ring.path, "device_plane": plane}).encode()
        offered = FeatureRing.from_hello(hello, use_device=True)
        assert offered.device is None and why in offered.device_refused
        offered.close()
        unused = FeatureRing.from_hello(hello, use_device=False)  # a drafter on the CPU does not try
        assert unused.device is None and not unused.device_refused
        unused.close()
    ring.close(unlink=True)


def _sequence(i: int, seed: int) -> Sequence:
    seq = Sequence(GenerateParams(f"r{i}", (1, 2, 3), SamplingConfig(), 64, frozenset(), True, 8))
    g = torch.Generator().manual_seed(seed)
    seq.root = 5 + i
    seq.pending_commit = PendingCommit([1, 2, 3, 4 + i], 0, torch.randn(4, F, generator=g))
    return seq


def _advance(seq: Sequence, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    start = seq.pending_commit.start + len(seq.pending_commit.token_ids)
    seq.drafter_seeded = True
    seq.pending_commit = PendingCommit([seq.root, 9], start, torch.randn(2, F, generator=g))
    seq.root = 11


@pytest.fixture
def two_drafters(tmp_path):
    servers = [
        serve_engine(random_draft_engine(tmp_path / f"d{i}"), DrafterConfig(port=0, grace_s=0.0)) for i in range(2)
    ]
    yield [f"127.0.0.1:{s.port}" for s in servers]
    for s in servers:
        s.stop(0)


def test_the_same_trees_as_grpc(two_drafters):
    local = DrafterClient(two_drafters[0], timeout_s=30, local_ring_bytes=1 << 20)
    remote = DrafterClient(two_drafters[1], timeout_s=30)
    assert local.local is not None and remote.local is None
    assert not os.path.exists(local.local.ring.path), (
        "the ring's name outlives the handshake (a killed verifier leaks it)"
    )
    pairs = [(_sequence(i, seed=i), _sequence(i, seed=i)) for i in range(3)]
    for step in range(3):
        got = local.draft([(a, 6) for a, _ in pairs], vocab_size=64)
        want = remote.draft([(b, 6) for _, b in pairs], vocab_size=64)
        assert len(got.trees) == len(pairs) and not got.failed
        assert [got.trees[a.draft_id] for a, _ in pairs] == [want.trees[b.draft_id] for _, b in pairs]
        assert [got.feature_bytes[a.draft_id] for a, _ in pairs] == [want.feature_bytes[b.draft_id] for _, b in pairs]
        for i, (a, b) in enumerate(pairs):
            _advance(a, seed=100 * step + i)
            _advance(b, seed=100 * step + i)
    local.close()
    remote.close()


def test_a_bad_or_overwritten_reference_costs_only_its_sequence(two_drafters):
    client = DrafterClient(two_drafters[0], timeout_s=30, local_ring_bytes=8192)
    channel = client.local
    seqs = [drafter_pb2.SeqDraft(seq_id=s, commit_token_ids=[1, 2, 3, 4], commit_start=0, root_token_id=5, reset=True)
            for s in ("good", "forged", "overwritten")]  # fmt: skip
    g = torch.Generator().manual_seed(0)

    def put(features: torch.Tensor) -> drafter_pb2.FeatureRef:
        return channel.put_all({"x": features})["x"]

    old = put(torch.randn(4, F, generator=g))
    for _ in range(8):  # the ring (8 KB, records of 1 KB) wraps over `old`
        put(torch.randn(4, F, generator=g))
    good = put(torch.randn(4, F, generator=g))
    forged = drafter_pb2.FeatureRef()
    forged.CopyFrom(good)
    forged.generation += 7
    for msg, ref in zip(seqs, (good, forged, old)):
        msg.commit_features_ref.CopyFrom(ref)
    reply = channel.draft(drafter_pb2.DraftRequest(seqs=seqs), timeout_s=30)
    assert sorted(reply.failed_seq_ids) == ["forged", "overwritten"]
    assert [t.seq_id for t in reply.trees] == ["good"]
    client.close()


def test_a_call_whose_records_would_wrap_onto_each_other_goes_over_grpc(two_drafters):
    """Five records of 1 KB (and their headers) exceed half of an 8 KB ring: the call goes over gRPC, with the
    same trees; three fit."""
    client = DrafterClient(two_drafters[0], timeout_s=30, local_ring_bytes=8192)
    remote = DrafterClient(two_drafters[1], timeout_s=30)
    g = torch.Generator().manual_seed(0)
    assert client.local.put_all({str(i): torch.randn(4, F, generator=g) for i in range(5)}) is None
    assert client.local.put_all({str(i): torch.randn(4, F, generator=g) for i in range(3)}) is not None
    pairs = [(_sequence(i, seed=i), _sequence(i, seed=i)) for i in range(5)]
    got = client.draft([(a, 6) for a, _ in pairs], vocab_size=64)
    want = remote.draft([(b, 6) for _, b in pairs], vocab_size=64)
    assert client.local is not None and not got.failed
    assert [got.trees[a.draft_id] for a, _ in pairs] == [want.trees[b.draft_id] for _, b in pairs]
    client.close()
    remote.close()


def test_a_drafter_gone_sends_the_client_back_to_grpc(tmp_path):
    server = serve_engine(random_draft_engine(tmp_path / "d"), DrafterConfig(port=0, grace_s=0.0))
    client = DrafterClient(f"127.0.0.1:{server.port}", timeout_s=5, local_ring_bytes=1 << 20)
    seq = _sequence(0, seed=0)
    assert client.draft([(seq, 4)], vocab_size=64).trees
    server.stop(0)  # the socket and the gRPC port close
    with pytest.raises(Exception) as err:
        _advance(seq, seed=1)
        client.draft([(seq, 4)], vocab_size=64)
    assert client.local is None, "the broken local channel was kept"
    assert "UNAVAILABLE" in str(err.value) or "unavailable" in str(err.value).lower()


def test_a_drafter_with_a_service_token_takes_the_channel_only_with_it(tmp_path):
    """Issue 47: serve always gives its engines a token, and the co-located channel stays theirs: a verifier
    with the token says AUTH first and gets the channel; one without it (or with another) is refused there
    and over gRPC alike."""
    (tmp_path / "token").write_text("secret-47\n")
    cfg = DrafterConfig(port=0, grace_s=0.0, service_token_file=str(tmp_path / "token"))
    server = serve_engine(random_draft_engine(tmp_path / "d"), cfg)
    try:
        address = f"127.0.0.1:{server.port}"
        good = DrafterClient(address, 5, security=ServiceSecurity(token="secret-47"), local_ring_bytes=1 << 20)
        assert good.local is not None, "the channel was refused to the token's holder"
        assert good.draft([(_sequence(0, seed=0), 4)], vocab_size=64).trees
        good.close()
        info = drafter_pb2.DrafterInfo(local_address=good.info.local_address, host_id=good.info.host_id)
        for token in ("", "wrong"):
            assert LocalDrafterChannel.open(info, 1 << 20, token=token) is None
        with pytest.raises(grpc.RpcError) as err:
            DrafterClient(address, 5, connect_timeout_s=5, local_ring_bytes=1 << 20)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop(0)


def test_long_commits_go_ahead_in_ring_chunks_with_the_same_trees(two_drafters):
    """A commit over chunk_bytes: its earlier pieces go one APPEND frame each through the ring (gRPC's
    Append is never called), and the trees equal those of a drafter fed the same chunks over gRPC."""
    local = DrafterClient(two_drafters[0], timeout_s=30, local_ring_bytes=1 << 20, chunk_bytes=300)
    remote = DrafterClient(two_drafters[1], timeout_s=30, chunk_bytes=300)

    def no_grpc_append(*args, **kwargs):
        raise AssertionError("a chunk went over gRPC")

    local.stub.Append = no_grpc_append
    pairs = []
    for i in range(2):
        a, b = _sequence(i, seed=i), _sequence(i, seed=i)
        g = torch.Generator().manual_seed(50 + i)
        feats = torch.randn(9, F, generator=g)  # 9 rows of 256 bytes: 8 chunks ahead, the last in the Draft
        for seq in (a, b):
            seq.pending_commit = PendingCommit(list(range(1, 10)), 0, feats.clone())
        pairs.append((a, b))
    got = local.draft([(a, 6) for a, _ in pairs], vocab_size=64)
    want = remote.draft([(b, 6) for _, b in pairs], vocab_size=64)
    assert local.local is not None and not got.failed and len(got.trees) == 2
    assert [got.trees[a.draft_id] for a, _ in pairs] == [want.trees[b.draft_id] for _, b in pairs]
    local.close()
    remote.close()


def test_a_bad_chunk_reference_fails_the_call_as_grpc_append_would(two_drafters):
    client = DrafterClient(two_drafters[0], timeout_s=30, local_ring_bytes=8192)
    chunk = drafter_pb2.CommitChunk(seq_id="c", commit_token_ids=[1, 2], commit_start=0, reset=True)
    ref = client.local.put_all({"c": torch.randn(2, F)})["c"]
    ref.generation += 3  # stale
    chunk.commit_features_ref.CopyFrom(ref)
    with pytest.raises(LocalRpcError) as err:
        client.local._call(APPEND, chunk, drafter_pb2.AppendResponse, 30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stale" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # a reference means nothing over gRPC
        client.stub.Append(iter([chunk]), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "co-located" in err.value.details()
    assert client.local is not None  # the channel itself is fine
    client.close()


def test_a_gpu_buffer_is_offered_only_to_a_drafter_that_maps_one(two_drafters, monkeypatch):
    """A verifier on a GPU makes the ring's device buffer only when the drafter's GetInfo says it maps one: a
    buffer shared through CUDA IPC and never mapped stays allocated for the verifier's life."""
    from ddtree.verifier.drafting import local_drafter

    asked = []
    create = FeatureRing.create

    def recording_create(size, directory=None, device=None):
        asked.append(device)
        return create(size, directory)  # this CPU has no GPU to put it on

    monkeypatch.setattr(local_drafter.FeatureRing, "create", staticmethod(recording_create))
    gpu = torch.device("cuda", 0)
    client = DrafterClient(two_drafters[0], timeout_s=30, local_ring_bytes=1 << 20, ring_device=gpu)
    assert not client.info.maps_device_features and asked == [None] and client.local is not None
    info = drafter_pb2.DrafterInfo()
    info.CopyFrom(client.info)
    info.maps_device_features = True
    channel = local_drafter.LocalDrafterChannel.open(info, 1 << 20, gpu)
    assert asked == [None, gpu] and channel is not None
    channel.close()
    client.close()

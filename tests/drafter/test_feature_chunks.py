"""Feature transport at full scale (issue 17, point 2): a commit over --feature-chunk-bytes travels as
Append chunks ahead of its Draft; the drafter's context (and so every tree) is the same as with one
message, inconsistent chunks are INVALID_ARGUMENT, and through the services the output equals AR."""

from __future__ import annotations

import re
import urllib.request

import grpc
import pytest
import torch

from ddtree.config import DrafterConfig
from ddtree.drafter.engine import DraftEngine
from ddtree.drafter.server import serve_engine
from ddtree.launcher import start_stack
from ddtree.models.dflash.checkpoint import load_drafter, write_random_drafter
from ddtree.protocol.ddtree.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from ddtree.protocol.tensors import tensor_to_proto
from ddtree.verifier.drafting.feature_chunks import split_commit

TARGET = {"hidden_size": 32, "num_hidden_layers": 6, "vocab_size": 64, "rope_theta": 10000.0}


@pytest.mark.parametrize("n, width, chunk", [(10, 12, 4 * 12 * 3), (10, 12, 1), (7, 5, 10**9), (1, 3, 1)])
def test_split_commit_pieces_are_contiguous_and_bounded(n, width, chunk):
    feats = torch.randn(n, width)
    pieces = split_commit(list(range(100, 100 + n)), 40, feats, chunk)
    row = width * feats.element_size()
    assert all(p.features.shape[0] * row <= max(chunk, row) for p in pieces)  # one row at least
    assert [p.start for p in pieces] == [40 + sum(len(q.token_ids) for q in pieces[:i]) for i in range(len(pieces))]
    assert sum((p.token_ids for p in pieces), []) == list(range(100, 100 + n))
    assert torch.equal(torch.cat([p.features for p in pieces]), feats)
    with pytest.raises(ValueError, match="3 tokens with 2 feature rows"):
        split_commit([1, 2, 3], 0, torch.randn(2, 4), 8)


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    ckpt = write_random_drafter(tmp_path_factory.mktemp("drafter"), TARGET, seed=3, block_size=5, num_layers=2)
    g = torch.Generator().manual_seed(0)
    engine = DraftEngine(load_drafter(ckpt), torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g) / 4)
    running = serve_engine(engine, DrafterConfig(max_sequences=4))
    channel = grpc.insecure_channel(running.address)
    yield drafter_pb2_grpc.DrafterStub(channel), engine
    channel.close()
    running.stop(0)


def _chunk(seq_id, start, feats, reset=False, tokens=None):
    c = drafter_pb2.CommitChunk(
        seq_id=seq_id, commit_token_ids=tokens or [1] * feats.shape[0], commit_start=start, reset=reset
    )
    c.commit_features.CopyFrom(tensor_to_proto(feats))
    return c


def _draft(stub, seq_id, start, feats, reset):
    seq = drafter_pb2.SeqDraft(
        seq_id=seq_id,
        commit_token_ids=[1] * feats.shape[0],
        commit_start=start,
        root_token_id=7,
        budget=12,
        reset=reset,
    )
    seq.commit_features.CopyFrom(tensor_to_proto(feats))
    (tree,) = stub.Draft(drafter_pb2.DraftRequest(seqs=[seq]), timeout=30).trees
    return (tuple(tree.token_ids), tuple(tree.parents), tuple(tree.scores))


def test_chunks_then_draft_equal_one_draft(drafter):
    stub, engine = drafter
    width = engine.config.feature_size
    feats = torch.randn(30, width, generator=torch.Generator().manual_seed(5))
    whole = _draft(stub, "whole", 0, feats, reset=True)
    pieces = split_commit([1] * 30, 0, feats, 7 * width * 4)  # 7 rows per piece
    chunks = [_chunk("chunked", p.start, p.features, reset=(i == 0)) for i, p in enumerate(pieces[:-1])]
    answer = stub.Append(iter(chunks), timeout=30)
    assert answer.chunks == len(chunks) == 4 and answer.feature_bytes == 28 * width * 4
    assert engine.context_end("chunked") == pieces[-1].start
    chunked = _draft(stub, "chunked", pieces[-1].start, pieces[-1].features, reset=False)
    assert chunked[:2] == whole[:2]  # the same tree
    # Scores: the context K/V came from GEMMs over 7-row pieces instead of 30 rows (fp32 rounding only).
    torch.testing.assert_close(torch.tensor(chunked[2]), torch.tensor(whole[2]))
    stub.Release(drafter_pb2.ReleaseRequest(seq_ids=["whole", "chunked"]), timeout=10)


@pytest.mark.parametrize(
    "chunks, message",
    [
        (
            lambda w: [_chunk("a", 0, torch.randn(3, w), reset=True), _chunk("a", 5, torch.randn(2, w))],
            "commit_start 5",
        ),
        (lambda w: [_chunk("b", 0, torch.randn(3, w + 1), reset=True)], "commit_features shape"),
        (lambda w: [_chunk("c", 0, torch.randn(3, w))], "unknown sequence"),
        (lambda w: [_chunk("d", 0, torch.full((2, w), float("nan")), reset=True)], "non-finite"),
        (lambda w: [_chunk("", 0, torch.randn(1, w), reset=True)], "seq_id must be"),
        (lambda w: [_chunk("e", 0, torch.randn(2, w), reset=True, tokens=[1, 10**6])], "outside"),
    ],
)
def test_inconsistent_chunks_are_invalid_argument(drafter, chunks, message):
    stub, engine = drafter
    with pytest.raises(grpc.RpcError) as err:
        stub.Append(iter(chunks(engine.config.feature_size)), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()
    stub.Release(drafter_pb2.ReleaseRequest(seq_ids=["a", "b", "c", "d", "e"]), timeout=10)


def _counter(metrics_text: str, name: str) -> float:
    m = re.search(rf"^{name}_total (\S+)$", metrics_text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.slow
def test_through_the_services_small_chunks_equal_ar(default_ckpt, tmp_path):
    """Every commit of a 300-token prompt and of each step goes in chunks of 2 KiB (a few rows):
    the DDTree output is the AR output, trees were verified, and both sides counted chunks."""
    with start_stack(
        str(default_ckpt.target),
        str(default_ckpt.drafter),
        tmp_path / "logs",
        verifier_args=("--feature-chunk-bytes", "2048", "--metrics-port", "0"),
        drafter_args=("--metrics-port", "0"),
    ) as stack:
        ids = [(i * 37) % 500 + 5 for i in range(300)]
        with grpc.insecure_channel(stack.verifier) as ch:
            stub = verifier_pb2_grpc.VerifierStub(ch)

            def run(no_spec):
                request = verifier_pb2.GenerateRequest(
                    input_ids=ids, max_new_tokens=24, ignore_eos=True, spec=common_pb2.SpecOptions(no_spec=no_spec)
                )
                responses = list(stub.Generate(request, timeout=120))
                return [t for r in responses for t in r.token_ids], [s for r in responses for s in r.steps]

            ar, _ = run(True)
            spec, steps = run(False)
        assert spec == ar
        assert any(s.tree_nodes > 0 for s in steps) and steps[0].feature_bytes > 2048
        for name, counter in [("verifier", "ddtree_feature_chunks"), ("drafter", "ddtree_drafter_append_chunks")]:
            address = stack.get(name).wait_address("metrics")
            text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
            assert _counter(text, counter) > 10, (name, counter)

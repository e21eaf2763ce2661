"""Bad input gets a clear error with the right status code, and requests in flight are untouched."""

from __future__ import annotations

import concurrent.futures as cf

import grpc
import pytest
import torch

from ddtree.protocol.ddtree.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from ddtree.protocol.tensors import tensor_to_proto

pytestmark = pytest.mark.slow


def _stream(address, req, timeout=300):
    with grpc.insecure_channel(address) as ch:
        out = []
        for msg in verifier_pb2_grpc.VerifierStub(ch).Generate(req, timeout=timeout):
            out.extend(msg.token_ids)
        return out


def _expect(code, fragment, call):
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    assert fragment in info.value.details()


def _gen(**kw):
    base = dict(input_ids=[5, 6, 7], max_new_tokens=8)
    base.update(kw)
    return verifier_pb2.GenerateRequest(**base)


VERIFIER_CASES = [
    ("empty prompt", _gen(input_ids=[]), "input_ids is empty"),
    ("prompt over max context", _gen(input_ids=[5] * 2049), "maximum context is 2048"),
    ("max_new_tokens 0", _gen(max_new_tokens=0), "max_new_tokens must be >= 1"),
    ("max_new_tokens negative", _gen(max_new_tokens=-3), "max_new_tokens must be >= 1"),
    ("max_new_tokens over limit", _gen(max_new_tokens=100000), "above the limit"),
    ("negative temperature", _gen(sampling=common_pb2.SamplingParams(temperature=-0.5)), "temperature"),
    ("top_p above 1", _gen(sampling=common_pb2.SamplingParams(temperature=1, top_p=1.5)), "top_p"),
    ("top_p negative", _gen(sampling=common_pb2.SamplingParams(temperature=1, top_p=-0.1)), "top_p"),
    ("token id above vocab", _gen(input_ids=[5, 999999]), "outside [0, 4096)"),
    ("negative token id", _gen(input_ids=[-1, 5]), "outside [0, 4096)"),
    ("negative budget", _gen(spec=common_pb2.SpecOptions(budget=-2)), "budget"),
    (
        "repetition_penalty negative",
        _gen(sampling=common_pb2.SamplingParams(repetition_penalty=-1)),
        "repetition_penalty",
    ),
    ("presence_penalty above 2", _gen(sampling=common_pb2.SamplingParams(presence_penalty=2.5)), "presence_penalty"),
    (
        "logit_bias id above vocab",
        _gen(sampling=common_pb2.SamplingParams(logit_bias={4096: 1.0})),
        "outside [0, 4096)",
    ),
    ("logit_bias above 100", _gen(sampling=common_pb2.SamplingParams(logit_bias={5: 101.0})), "logit_bias values"),
    ("bad word empty", _gen(sampling=common_pb2.SamplingParams(bad_words=[common_pb2.TokenIds()])), "bad_words"),
]


def test_bad_requests_are_rejected_while_others_stream(oracle_stack, default_ckpt):
    """A long greedy generation runs while every bad request is sent; it must finish with exactly
    the tokens it gives when run alone."""
    long_req = _gen(
        input_ids=[11, 12, 13, 14], max_new_tokens=96, ignore_eos=True, spec=common_pb2.SpecOptions(budget=8)
    )
    alone = _stream(oracle_stack.verifier, long_req)
    with cf.ThreadPoolExecutor(1) as pool:
        running = pool.submit(_stream, oracle_stack.verifier, long_req)
        with grpc.insecure_channel(oracle_stack.verifier) as ch:
            stub = verifier_pb2_grpc.VerifierStub(ch)
            for _name, req, fragment in VERIFIER_CASES:
                _expect(
                    grpc.StatusCode.INVALID_ARGUMENT, fragment, lambda req=req: list(stub.Generate(req, timeout=30))
                )
            _expect(
                grpc.StatusCode.NOT_FOUND,
                "no running request",
                lambda: stub.Abort(verifier_pb2.AbortRequest(request_id="never-started"), timeout=10),
            )
            _expect(
                grpc.StatusCode.INVALID_ARGUMENT,
                "request_id is empty",
                lambda: stub.Abort(verifier_pb2.AbortRequest(), timeout=10),
            )
            _expect(  # a 20k-character id is refused without being echoed (it once overflowed the metadata)
                grpc.StatusCode.INVALID_ARGUMENT,
                "request_id is longer than 256 characters",
                lambda: stub.Abort(verifier_pb2.AbortRequest(request_id="x" * 20_000), timeout=10),
            )
        with grpc.insecure_channel(oracle_stack.get("drafter").address) as ch:
            _bad_drafts(drafter_pb2_grpc.DrafterStub(ch))
        assert running.result() == alone


def _seq(**kw):
    base = dict(seq_id="bad-1", commit_token_ids=[1, 2], commit_start=0, root_token_id=3, budget=4, reset=True)
    base.update(kw)
    feats = kw.pop("features", None)
    base.pop("features", None)
    msg = drafter_pb2.SeqDraft(**base)
    msg.commit_features.CopyFrom(feats if feats is not None else tensor_to_proto(torch.zeros(2, 256)))
    return msg


def _bad_drafts(stub):
    cases = [
        (_seq(features=tensor_to_proto(torch.zeros(2, 17))), "commit_features shape"),
        (_seq(features=tensor_to_proto(torch.zeros(3, 256))), "commit_features shape"),
        (_seq(features=common_pb2.Tensor(data=b"\0" * 7, shape=[2, 256], dtype=common_pb2.FLOAT32)), "bytes"),
        (_seq(features=common_pb2.Tensor(data=b"", shape=[2, 256], dtype=99)), "unsupported dtype"),
        (_seq(commit_token_ids=[1, 10**6]), "outside [0, 4096)"),
        (_seq(root_token_id=-5), "outside [0, 4096)"),
        (_seq(seq_id=""), "seq_id"),
        (_seq(budget=-1), "budget"),
    ]
    for msg, fragment in cases:
        _expect(
            grpc.StatusCode.INVALID_ARGUMENT,
            fragment,
            lambda msg=msg: stub.Draft(drafter_pb2.DraftRequest(seqs=[msg]), timeout=30),
        )
    # A context the drafter does not hold is named in the answer, not an error for the whole call: the
    # verifier resends it (reset=True) at its next step.
    lost = stub.Draft(drafter_pb2.DraftRequest(seqs=[_seq(reset=False, seq_id="unknown-seq")]), timeout=30)
    assert list(lost.unknown_seq_ids) == ["unknown-seq"]
    dup = drafter_pb2.DraftRequest(seqs=[_seq(), _seq()])
    _expect(grpc.StatusCode.INVALID_ARGUMENT, "twice", lambda: stub.Draft(dup, timeout=30))


def test_verifier_rejects_a_malformed_tree_from_the_drafter():
    """A tree whose parent index is not smaller than its own index never reaches the forward."""
    from ddtree.contract.token_tree import TokenTree

    bad = [TokenTree((5, 6), (0, 2), (1, 2)), TokenTree((5, 6), (0, 1), (1, 3)), TokenTree((5,), (1,), (1,))]
    for tree in bad:
        with pytest.raises(ValueError, match="parent|depth"):
            tree.validate()

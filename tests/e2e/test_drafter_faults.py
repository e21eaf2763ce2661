"""A drafter that misbehaves never changes a token: malformed trees become AR steps, and a drafter
that disappears mid-stream leaves its sequences to finish with AR decoding."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from ddtree.config import DrafterConfig
from ddtree.contract.token_tree import TokenTree
from ddtree.drafter.server import serve_engine
from ddtree.launcher import start_service
from ddtree.protocol.ddtree.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from tests.support.fakes import stub_engine_info

pytestmark = pytest.mark.slow


class HostileEngine:
    """Speaks the Draft contract but returns broken trees, in rotation."""

    BAD = [
        TokenTree((5, 6), (0, 2), (1, 2)),  # parent index not smaller than its own
        TokenTree((5, 6), (0, 0), (1, 2)),  # depth inconsistent with parent
        TokenTree((5, 10**7), (0, 1), (1, 2)),  # token outside the vocabulary
        TokenTree(tuple(range(40)), tuple(range(40)), tuple(range(1, 41))),  # over the budget
        TokenTree((7, 7), (0, 0), (1, 1)),  # duplicate sibling tokens
    ]

    def __init__(self, hidden: int):
        self.calls = 0
        self.hidden = hidden
        self.held: set[str] = set()  # the contexts it was sent (a Draft without reset needs one held)

    def info(self):
        return stub_engine_info("hostile", self.hidden)

    def draft(self, seqs):
        self.calls += 1
        self.held.update(s.seq_id for s in seqs)
        return [self.BAD[(self.calls + i) % len(self.BAD)] for i, _ in enumerate(seqs)]

    def knows(self, seq_id):
        return seq_id in self.held

    def release(self, ids):
        return len(ids)


def _generate(address, no_spec):
    req = verifier_pb2.GenerateRequest(
        input_ids=[40, 41, 42, 43],
        max_new_tokens=30,
        ignore_eos=True,
        spec=common_pb2.SpecOptions(no_spec=no_spec, budget=8),
    )
    with grpc.insecure_channel(address) as ch:
        msgs = list(verifier_pb2_grpc.VerifierStub(ch).Generate(req, timeout=120))
    return [t for m in msgs for t in m.token_ids], [s for m in msgs for s in m.steps]


def test_malformed_trees_become_ar_steps(default_ckpt, tmp_path):
    engine = HostileEngine(hidden=256)
    drafter = serve_engine(engine, DrafterConfig(port=0, grace_s=0.0))
    verifier = start_service(
        "verifier",
        ["verifier", "--model", str(default_ckpt.target), "--port", "0", "--drafter", f"127.0.0.1:{drafter.port}"],
        tmp_path,
    )
    try:
        spec_tokens, steps = _generate(verifier.address, no_spec=False)
        ar_tokens, _ = _generate(verifier.address, no_spec=True)
        assert spec_tokens == ar_tokens
        assert engine.calls >= len(steps) > 0
        assert all(s.tree_nodes == 0 and s.accept_length == 1 for s in steps), "a malformed tree was verified"
        log = verifier.log_path.read_text()
        for reason in (">= own index", "depth 2 != parent", "token id outside", "budget 8", "repeats among children"):
            assert reason in log, f"no drafter_bad_tree record mentioning {reason!r}"
    finally:
        verifier.stop()
        drafter.stop(0)


def test_drafter_lost_mid_stream_falls_back_to_ar(default_ckpt, tmp_path):
    drafter = start_service(
        "drafter",
        ["drafter", "--model", str(default_ckpt.drafter), "--target", str(default_ckpt.target), "--port", "0"],
        tmp_path,
    )
    verifier = start_service(
        "verifier",
        [
            "verifier",
            "--model",
            str(default_ckpt.target),
            "--port",
            "0",
            "--drafter",
            drafter.address,
            "--draft-timeout-s",
            "5",
        ],
        tmp_path,
    )
    try:
        ar_tokens, _ = _generate(verifier.address, no_spec=True)
        req = verifier_pb2.GenerateRequest(
            input_ids=[40, 41, 42, 43], max_new_tokens=30, ignore_eos=True, spec=common_pb2.SpecOptions(budget=8)
        )
        tokens, steps = [], []
        with grpc.insecure_channel(verifier.address) as ch:
            for msg in verifier_pb2_grpc.VerifierStub(ch).Generate(req, timeout=120):
                tokens.extend(msg.token_ids)
                steps.extend(msg.steps)
                if len(steps) == 3:
                    drafter.popen.kill()
                    drafter.popen.wait()
        assert tokens == ar_tokens
        assert steps[0].tree_nodes > 0 and steps[-1].tree_nodes == 0
    finally:
        verifier.stop()
        drafter.stop()


class BadScoresEngine(HostileEngine):
    """Valid trees whose node scores are broken (rising, wrong count, positive): the verifier must still
    verify the trees, only without the scores."""

    SCORES = [(-0.5, -0.1, -2.0), (-0.5,), (0.5, -1.0, -2.0)]

    def draft(self, seqs):
        self.calls += 1
        self.held.update(s.seq_id for s in seqs)
        return [
            TokenTree((100, 101, 102), (0, 1, 1), (1, 2, 2), self.SCORES[(self.calls + i) % 3])
            for i, _ in enumerate(seqs)
        ]


def test_bad_node_scores_are_dropped_not_the_trees(default_ckpt, tmp_path):
    engine = BadScoresEngine(hidden=256)
    drafter = serve_engine(engine, DrafterConfig(port=0, grace_s=0.0))
    verifier = start_service(
        "verifier",
        [
            "verifier",
            "--model",
            str(default_ckpt.target),
            "--port",
            "0",
            "--drafter",
            f"127.0.0.1:{drafter.port}",
            "--max-tree-tokens",
            "3",
        ],
        tmp_path,
    )
    try:
        spec_tokens, steps = _generate(verifier.address, no_spec=False)
        ar_tokens, _ = _generate(verifier.address, no_spec=True)
        assert spec_tokens == ar_tokens
        assert steps and all(s.tree_nodes == 2 for s in steps)  # verified, cut to the cap's equal share (3 // 1 - 1)
        log = verifier.log_path.read_text()
        for reason in ("must be non-increasing", "1 scores for 3 nodes", "must be finite log-probs"):
            assert reason in log, f"no drafter_bad_scores record mentioning {reason!r}"
    finally:
        verifier.stop()
        drafter.stop(0)


def test_a_drafter_at_max_sequences_leaves_new_sequences_to_ar(default_ckpt, tmp_path):
    """--max-sequences 1: the drafter refuses a Draft that would start a second context
    (RESOURCE_EXHAUSTED), the verifier sends it no second sequence, and that one decodes with AR."""
    from ddtree.protocol.ddtree.v1 import drafter_pb2, drafter_pb2_grpc

    drafter = start_service(
        "drafter",
        ["drafter", "--model", str(default_ckpt.drafter), "--target", str(default_ckpt.target), "--port", "0",
         "--max-sequences", "1"],
        tmp_path,
    )  # fmt: skip
    try:
        with grpc.insecure_channel(drafter.address) as ch:
            stub = drafter_pb2_grpc.DrafterStub(ch)
            info = stub.GetInfo(drafter_pb2.DrafterInfoRequest(), timeout=30)
            assert info.max_sequences == 1
            width = len(info.target_layer_ids) * info.hidden_size
            feats = {"data": b"\0" * (2 * width * 4), "shape": [2, width], "dtype": common_pb2.FLOAT32}

            def seq(seq_id):
                return drafter_pb2.SeqDraft(seq_id=seq_id, commit_token_ids=[5, 6], commit_start=0,
                                            commit_features=common_pb2.Tensor(**feats), root_token_id=7, reset=True)  # fmt: skip

            with pytest.raises(grpc.RpcError) as err:
                stub.Draft(drafter_pb2.DraftRequest(seqs=[seq("a"), seq("b")]), timeout=30)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_sequences is 1" in err.value.details()
            assert stub.GetInfo(drafter_pb2.DrafterInfoRequest(), timeout=30).active_sequences == 0
            assert len(stub.Draft(drafter_pb2.DraftRequest(seqs=[seq("a")]), timeout=30).trees) == 1
            stub.Release(drafter_pb2.ReleaseRequest(seq_ids=["a"]), timeout=30)

        verifier = start_service(
            "verifier",
            ["verifier", "--model", str(default_ckpt.target), "--port", "0", "--drafter", drafter.address],
            tmp_path,
        )
        try:
            ar_tokens, _ = _generate(verifier.address, no_spec=True)
            long_req = verifier_pb2.GenerateRequest(
                input_ids=[40, 41, 42, 43], max_new_tokens=300, ignore_eos=True, spec=common_pb2.SpecOptions(budget=8)
            )
            with grpc.insecure_channel(verifier.address) as ch:
                first = verifier_pb2_grpc.VerifierStub(ch).Generate(long_req, timeout=120)
                for msg in first:  # until the first sequence holds the drafter's one context (a drafted tree)
                    if any(st.tree_nodes > 0 for st in msg.steps):
                        break
                tokens, steps = _generate(verifier.address, no_spec=False)
                first.cancel()
            assert tokens == ar_tokens
            assert steps and all(s.tree_nodes == 0 for s in steps), "the second sequence was drafted past the cap"
            # The verifier kept to the cap itself: no Draft call was refused, so the first sequence (drafted
            # in the same calls) never lost its drafter.
            assert "RESOURCE_EXHAUSTED" not in verifier.log_path.read_text()
        finally:
            verifier.stop()
    finally:
        drafter.stop()


class HangingEngine(HostileEngine):
    """Valid one-node trees; while `hang` is set, a Draft call waits (a stopped or overloaded drafter)."""

    def __init__(self, hidden: int):
        super().__init__(hidden)
        self.hang = threading.Event()

    def draft(self, seqs):
        self.calls += 1
        self.held.update(s.seq_id for s in seqs)
        while self.hang.is_set():
            time.sleep(0.01)
        return [TokenTree((5,), (0,), (1,)) for _ in seqs]


def _new_sequence(i: int):
    import torch

    from ddtree.contract.sampling_params import SamplingConfig
    from ddtree.verifier.sequence import GenerateParams, PendingCommit, Sequence

    seq = Sequence(GenerateParams(f"r{i}", (1, 2, 3), SamplingConfig(), 8, frozenset(), True, 4))
    seq.root = 7
    seq.pending_commit = PendingCommit([1, 2, 3], 0, torch.zeros(3, 256))
    return seq


def test_a_hung_drafter_is_set_aside_after_one_timeout_and_taken_back(tmp_path):
    """The circuit breaker: the first Draft that times out sets the replica aside; while it hangs no
    sequence, old or new, waits for it again (they decode with AR); once it answers a probe it is back."""
    from ddtree.verifier.drafting.drafter_pool import DrafterPool

    engine = HangingEngine(hidden=256)
    drafter = serve_engine(engine, DrafterConfig(port=0, grace_s=0.0))
    address = f"127.0.0.1:{drafter.port}"
    pool = DrafterPool(address, timeout_s=0.5, resolve_interval_s=0.2)
    try:
        engine.hang.set()
        first = _new_sequence(0)
        result = pool.draft([(first, 4)], vocab_size=4096)
        assert first.draft_id in result.failed and not result.trees
        assert pool.replicas == [], "the hung replica is still in the pool"
        calls = engine.calls
        for i in range(1, 4):  # new sequences while it hangs: no Draft reaches it, none waits
            seq = _new_sequence(i)
            assert seq.draft_id in pool.draft([(seq, 4)], vocab_size=4096).failed
        assert engine.calls == calls, "a Draft call went to the set-aside replica"
        engine.hang.clear()
        deadline = time.monotonic() + 60
        while pool.replicas != [address] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.replicas == [address], "the replica was not taken back after it answered again"
        back = _new_sequence(9)
        assert pool.draft([(back, 4)], vocab_size=4096).trees[back.draft_id].token_ids == (5,)
    finally:
        engine.hang.clear()
        pool.close()
        drafter.stop(0)

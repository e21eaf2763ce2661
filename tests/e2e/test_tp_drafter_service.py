"""The DFlash drafter at TP 2 through the services (`ddtree drafter --tp 2`: two gloo ranks, rank 0 serving
gRPC, each drafting with its shard of the drafter and of the target's vocabulary) feeding a TP-2 verifier of
a Kimi-shaped INT4 checkpoint (the default target with its routed experts pack-quantized, group 32, Kimi's
ignore list): greedy DDTree output is token-identical to AR; and the TP-2 drafter's trees, over the gRPC
API, are the TP-1 drafter's for the same commits (the same tokens, parents and scores to fp32 rounding: the
TP-2 forward sums its shards' partial products in another order)."""

from __future__ import annotations

import grpc
import pytest
import torch

from ddtree.drafter.memory_check import read_drafter_config
from ddtree.launcher import start_service
from ddtree.protocol.ddtree.v1 import drafter_pb2, drafter_pb2_grpc
from ddtree.protocol.tensors import tensor_to_proto
from ddtree.tokenization.tokenizer import Tokenizer
from ddtree.tools.selftest.compare import assert_close
from tests.support.quantized_checkpoints import quantize_checkpoint
from tests.support.stack_calls import MAX_NEW, PROMPTS, VERIFIER_ARGS, generate_concurrently

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stacks(default_ckpt, tmp_path_factory):
    base = tmp_path_factory.mktemp("tp-drafter")
    root = quantize_checkpoint(default_ckpt.target, base / "target", "int4")
    procs, verifiers, drafters = [], {}, {}
    try:
        for name, extra in (("tp1", []), ("tp2", ["--tp", "2"])):
            drafter = start_service(
                "drafter",
                ["drafter", "--model", str(default_ckpt.drafter), "--target", str(root), "--port", "0",
                 "--threads", "1", "--dtype", "float32", "--warmup-sequences", "0", *extra],
                base / f"logs-drafter-{name}",
            )  # fmt: skip
            procs.append(drafter)
            drafters[name] = drafter.address
        args = ["verifier", "--model", str(root), "--drafter", drafters["tp2"], *VERIFIER_ARGS, "--tp", "2"]
        verifiers["tp2"] = start_service("verifier", args, base / "logs-verifier-tp2")
        procs.append(verifiers["tp2"])
        yield verifiers, drafters
    finally:
        for p in reversed(procs):
            p.stop()


def test_tp2_drafter_ddtree_equals_ar(stacks, default_ckpt):
    verifiers, _ = stacks
    tok = Tokenizer(default_ckpt.target)
    prompt_ids = [tok.encode(p) for p in PROMPTS[:2]]
    ar = generate_concurrently(verifiers["tp2"].address, prompt_ids, no_spec=True)
    assert all(len(t) == MAX_NEW for t in ar)
    steps = []
    assert generate_concurrently(verifiers["tp2"].address, prompt_ids, steps, no_spec=False, budget=8) == ar
    assert any(s.tree_nodes for s in steps), "the TP-2 drafter never drafted"


def _draft(address: str, features: torch.Tensor) -> drafter_pb2.DraftResponse:
    """Two sequences: a fresh 5-token commit, then the first one's next 3 tokens on its cached context."""
    msgs = []
    for seq_id, ids, start, reset, rows in (("a", [5, 6, 7, 8, 9], 0, True, slice(0, 5)),
                                            ("b", [11, 12, 13], 0, True, slice(5, 8))):  # fmt: skip
        msg = drafter_pb2.SeqDraft(seq_id=seq_id, commit_token_ids=ids, commit_start=start, root_token_id=4,
                                   reset=reset, budget=12)  # fmt: skip
        msg.commit_features.CopyFrom(tensor_to_proto(features[rows]))
        msgs.append(msg)
    with grpc.insecure_channel(address) as ch:
        return drafter_pb2_grpc.DrafterStub(ch).Draft(drafter_pb2.DraftRequest(seqs=msgs), timeout=60)


def test_tp2_drafter_trees_are_the_tp1_drafters(stacks, default_ckpt):
    _, drafters = stacks
    cfg = read_drafter_config(default_ckpt.drafter)
    features = torch.randn(8, cfg.feature_size, generator=torch.Generator().manual_seed(2))
    one, two = _draft(drafters["tp1"], features), _draft(drafters["tp2"], features)
    assert len(one.trees) == len(two.trees) == 2 and not two.failed_seq_ids
    for a, b in zip(one.trees, two.trees):
        assert a.seq_id == b.seq_id and list(a.token_ids) == list(b.token_ids) and list(a.parents) == list(b.parents)
        assert len(a.token_ids) == 12
        assert_close(f"{a.seq_id} scores", torch.tensor(list(b.scores)), torch.tensor(list(a.scores)))

"""A repeated prompt reuses the cached prefix's KV and drafter features: same tokens, same acceptance."""

from __future__ import annotations

import grpc
import pytest

from ddtree.protocol.ddtree.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

pytestmark = pytest.mark.slow


def _run(address, ids, budget=8):
    # The oracle drafter's noise is seeded by the token history: the same prompt gets the same trees.
    req = verifier_pb2.GenerateRequest(
        request_id="prefix-reuse",
        input_ids=ids,
        max_new_tokens=48,
        ignore_eos=True,
        spec=common_pb2.SpecOptions(budget=budget),
    )
    with grpc.insecure_channel(address) as ch:
        msgs = list(verifier_pb2_grpc.VerifierStub(ch).Generate(req, timeout=300))
    return [t for m in msgs for t in m.token_ids], [s.accept_length for m in msgs for s in m.steps], msgs[-1].usage


@pytest.mark.parametrize("stack_name", ["oracle_stack", "dflash_stack"])
def test_repeated_prompt_hits_the_cache_with_identical_results(request, stack_name):
    stack = request.getfixturevalue(stack_name)
    ids = [(37 * i) % 3000 + 50 for i in range(300)]
    first_tokens, first_accept, _ = _run(stack.verifier, ids)
    second_tokens, second_accept, _ = _run(stack.verifier, ids)
    assert second_tokens == first_tokens
    assert second_accept == first_accept, "acceptance changed with a prefix hit"
    log = stack.get("verifier").log_path.read_text()
    assert '"cached_tokens": 299' in log, "the second request did not reuse the 299-token prefix"
    # A prompt that extends the first answer reuses prompt + answer (a second chat turn).
    turn2 = ids + first_tokens[:40] + [61, 62, 63]
    t2_tokens, _, _ = _run(stack.verifier, turn2)
    assert '"cached_tokens": 340' in stack.get("verifier").log_path.read_text(), "no reuse of prompt + answer"
    with grpc.insecure_channel(stack.verifier) as ch:
        stub = verifier_pb2_grpc.VerifierStub(ch)
        ar = [
            t
            for m in stub.Generate(
                verifier_pb2.GenerateRequest(
                    input_ids=turn2, max_new_tokens=48, ignore_eos=True, spec=common_pb2.SpecOptions(no_spec=True)
                ),
                timeout=300,
            )
            for t in m.token_ids
        ]
    assert t2_tokens == ar

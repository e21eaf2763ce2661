"""Greedy DDTree equals AR through the services on the device path (issue 50): a verifier running the Triton
kernels (interpreted here) on a Kimi-shaped checkpoint (INT4 routed experts, bf16 elsewhere: 2 layers, a
dense one and a MoE one), beside a drafter process whose trees follow the target's own continuation with
noise (tests/support/oracle_drafter.py), so that steps accept several tokens and tree rows at every depth
decide the output. AR (`no_spec`) against DDTree, every prompt in flight together (batches of sequences
beside one another): the tokens are equal, and so is every emitted token's top-2 log-probabilities, bit
for bit (they are the row's own logits through one log-softmax). The prefix cache is on, so the second run
takes the first one's prompt KV and extends each prompt's last token in a 1-row step where the first run
prefilled it inside the prompt's chunk: equal too, because every prefill row is planned as the decode row
it would be (kernels/mla/plan.py; before that plan, this moved the fp32 logits of 11 of 96 tokens).

Interpreted, a 17-row tree of this 2-layer model costs the verifier about 0.13 s a row (the MLA split
kernel runs a program per row), so the suite runs a small form (3 prompts x 16 tokens, trees of budget 8);
the issue's form, 20 prompts x 64 tokens at the default budget, runs with DDTREE_LOSSLESS_FULL=1 (about 15 minutes here; docs/performance.md
section 13 has its last result). On a GPU the same test takes seconds.

Near-ties: the prompts are drawn until their AR continuations hold near-ties, steps where the two most
likely tokens are within 1/64 in log-probability (one bf16 ULP of a logit in [2, 4), a few ULPs below);
the test asserts it found them, so the comparison covers exactly the rows where a reduction order that
depended on the step's shape would flip a token.

The negative control: the same comparison with `--row-invariant off` (the attention's throughput plan:
a tree's or a chunk's rows planned as one tile, not as decode rows), in fp32, finds rows whose
log-probabilities differ from AR's, so this comparison can fail. (In bf16 the interpreter computes every
dot in fp32 and rounds the result, which hides such differences; on a GPU the GPU check measures them.)
"""

from __future__ import annotations

import concurrent.futures
import os
import random

import grpc
import pytest

from ddtree.launcher import start_service
from ddtree.models.checkpoint.random import DEFAULT_TARGET_CONFIG, write_random_target
from ddtree.protocol.ddtree.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from tests.support.paths import ORACLE_DRAFTER
from tests.support.quantized_checkpoints import quantize_checkpoint

TINY = {**DEFAULT_TARGET_CONFIG, "vocab_size": 128, "hidden_size": 64, "intermediate_size": 64,
        "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
        "n_routed_experts": 4, "bos_token_id": 0, "eos_token_id": 1}  # fmt: skip
pytestmark = [pytest.mark.slow, pytest.mark.beside_stacks]  # tests/conftest.py: beside the services' group
FULL = os.environ.get("DDTREE_LOSSLESS_FULL") == "1"
# prompts, tokens each, near-ties the AR runs must hold, tree budget (0: the verifier's default)
PROMPTS, NEW_TOKENS, NEAR_TIES, BUDGET = (20, 64, 10, 0) if FULL else (3, 16, 1, 8)
NEAR_TIE = 1 / 64  # top-2 log-probability gap: one bf16 ULP of a logit in [2, 4)
STOP_S = 90  # an interpreted verifier beside the suite's stacks has taken over 20 s to exit (1.5-2 s alone)


@pytest.fixture(scope="module")
def int4_target(tmp_path_factory):
    fp32 = write_random_target(tmp_path_factory.mktemp("fp32"), TINY, seed=23)
    return quantize_checkpoint(fp32, tmp_path_factory.mktemp("int4"), "int4")


@pytest.fixture(scope="module")
def drafter(int4_target, tmp_path_factory):
    proc = start_service("drafter", ["drafter", "--target", str(int4_target), "--port", "0", "--threads", "1",
                                     "--oracle-seed", "3"], tmp_path_factory.mktemp("drafter-logs"), module=ORACLE_DRAFTER)  # fmt: skip
    yield proc
    proc.stop()


def _verifier(target, drafter, log_dir, dtype: str, row_invariant: str):
    args = ["verifier", "--model", str(target), "--drafter", drafter.address, "--port", "0", "--threads", "1",
            "--attention-backend", "triton", "--dtype", dtype, "--row-invariant", row_invariant,
            "--max-batch", str(PROMPTS), "--kv-tokens", "8192", "--max-context", "256", "--prefill-chunk", "1024",
            "--prefix-cache", "true"]  # fmt: skip
    return start_service(f"verifier-{dtype}-{row_invariant}", args, log_dir, env={"TRITON_INTERPRET": "1"}, timeout=300)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, TINY["vocab_size"]) for _ in range(rng.randrange(12, 40))] for _ in range(PROMPTS)]


def _generate(address: str, prompts: list[list[int]], no_spec: bool) -> list[tuple[list[int], list[tuple], list[int]]]:
    """Every prompt in flight at once: (tokens, per token (top ids, top logprobs), accept length per step) in
    prompt order."""

    def one(prompt):
        req = verifier_pb2.GenerateRequest(input_ids=prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                           top_logprobs=2, spec=common_pb2.SpecOptions(no_spec=no_spec, budget=BUDGET))  # fmt: skip
        tokens, tops, accepts = [], [], []
        with grpc.insecure_channel(address) as ch:
            for msg in verifier_pb2_grpc.VerifierStub(ch).Generate(req, timeout=1800):
                tokens += msg.token_ids
                tops += [(tuple(lp.top_ids), tuple(lp.top_logprobs)) for lp in msg.logprobs]
                accepts += [s.accept_length for s in msg.steps]
        return tokens, tops, accepts

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _near_ties(runs, gap: float = NEAR_TIE) -> int:
    return sum(1 for _, tops, _ in runs for _, lp in tops if lp[0] - lp[1] <= gap)


def _mean_accept(runs) -> float:
    accepts = [a for _, _, steps in runs for a in steps]
    return sum(accepts) / len(accepts)


def test_ddtree_equals_ar_on_the_device_path_in_bf16(int4_target, drafter, tmp_path):
    verifier = _verifier(int4_target, drafter, tmp_path, "bfloat16", "on")
    try:
        prompts = _prompts(seed=1)
        ar = _generate(verifier.address, prompts, no_spec=True)
        assert _near_ties(ar) >= NEAR_TIES, f"the prompts' AR continuations hold {_near_ties(ar)} near-ties"
        spec = _generate(verifier.address, prompts, no_spec=False)
    finally:
        assert verifier.stop(timeout=STOP_S) == 0, verifier.log_tail()
    assert all(len(tokens) == NEW_TOKENS for tokens, _, _ in ar + spec)
    assert _mean_accept(spec) > 2, f"speculation accepted {_mean_accept(spec):.2f} tokens a step"
    print(f"{len(prompts)} prompts x {NEW_TOKENS} tokens: near-ties {_near_ties(ar)} (exact ties "
          f"{_near_ties(ar, 0.0)}), DDTree accepted {_mean_accept(spec):.2f} tokens a step")  # fmt: skip
    for i, ((ar_tokens, ar_tops, _), (dd_tokens, dd_tops, _)) in enumerate(zip(ar, spec, strict=True)):
        assert dd_tokens == ar_tokens, f"prompt {i}: DDTree left AR at token {_first_difference(dd_tokens, ar_tokens)}"
        assert dd_tops == ar_tops, (
            f"prompt {i}: top-2 log-probabilities differ at token {_first_difference(dd_tops, ar_tops)}"
        )


def test_negative_control_row_invariance_off_differs_from_ar(int4_target, drafter, tmp_path):
    """fp32, `--row-invariant off`: some emitted token's log-probabilities differ from AR's (the comparison
    above can fail); with it on, in fp32 too, none does."""
    prompts = _prompts(seed=1)
    differing = {}
    for flag in ("off", "on"):
        verifier = _verifier(int4_target, drafter, tmp_path, "float32", flag)
        try:
            ar = _generate(verifier.address, prompts, no_spec=True)
            spec = _generate(verifier.address, prompts, no_spec=False)
        finally:
            assert verifier.stop(timeout=STOP_S) == 0, verifier.log_tail()
        assert _mean_accept(spec) > 2, f"speculation accepted {_mean_accept(spec):.2f} tokens a step"
        differing[flag] = sum(
            a != d for (_, ar_tops, _), (_, dd_tops, _) in zip(ar, spec) for a, d in zip(ar_tops, dd_tops)
        )
    assert differing["off"] > 0 and differing["on"] == 0, differing


def _first_difference(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

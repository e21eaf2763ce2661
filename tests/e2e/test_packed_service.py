"""INT4 and FP8 checkpoints served with packed weights through the services: greedy DDTree output is
token-identical to AR at TP 1, TP 2 and TP 2 with expert parallelism.

The checkpoints are the default one (its tokenizer, its fp32 weights) with the routed experts INT4
(group 32, Kimi's ignore list) or every projection FP8 (32x32 blocks, so that TP 2 cuts whole blocks).
Each gets one oracle drafter (the target's own continuation with noise, loaded packed too: real
multi-token acceptance) shared by its three verifiers.
"""

from __future__ import annotations

import pytest

from ddtree.launcher import start_service
from ddtree.tokenization.tokenizer import Tokenizer
from tests.support.paths import ORACLE_DRAFTER
from tests.support.quantized_checkpoints import quantize_checkpoint
from tests.support.stack_calls import MAX_NEW, PROMPTS, VERIFIER_ARGS, generate_concurrently

pytestmark = pytest.mark.slow
LAYOUTS = {"tp1": [], "tp2": ["--tp", "2"], "tp2-ep": ["--tp", "2", "--expert-parallel", "true"]}


@pytest.fixture(scope="module")
def prompt_ids(default_ckpt):
    tok = Tokenizer(default_ckpt.target)
    return [tok.encode(p) for p in PROMPTS[:3]]


@pytest.fixture(scope="module", params=["int4", "fp8"])
def served(request, default_ckpt, tmp_path_factory):
    kind = request.param
    base = tmp_path_factory.mktemp(f"packed-{kind}")
    root = quantize_checkpoint(default_ckpt.target, base / "target", kind, fp8_block=(32, 32))
    procs = []
    try:
        drafter = start_service(
            "drafter",
            ["drafter", "--model", str(default_ckpt.drafter), "--target", str(root), "--port", "0",
             "--threads", "1", "--oracle-seed", "7"],
            base / "logs-drafter",
            module=ORACLE_DRAFTER,
        )  # fmt: skip
        procs.append(drafter)
        verifiers = {}
        for name, extra in LAYOUTS.items():
            args = ["verifier", "--model", str(root), "--drafter", drafter.address, *VERIFIER_ARGS, *extra]
            verifiers[name] = start_service("verifier", args, base / f"logs-{name}")
            procs.append(verifiers[name])
        yield kind, verifiers
    finally:
        for p in reversed(procs):
            p.stop()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_packed_ddtree_greedy_equals_ar(served, prompt_ids, layout):
    kind, verifiers = served
    address = verifiers[layout].address
    ar = generate_concurrently(address, prompt_ids, no_spec=True)
    steps = []
    ddtree = generate_concurrently(address, prompt_ids, steps, no_spec=False, budget=8)
    assert all(len(t) == MAX_NEW for t in ar)
    assert max(s.accept_length for s in steps) > 1, "the oracle's trees were never accepted past the root"
    assert ddtree == ar, f"{kind} {layout}: DDTree output differs from AR"
    if layout != "tp1":  # the same dequantized values in every layout: the same greedy tokens as TP 1
        assert ar == generate_concurrently(verifiers["tp1"].address, prompt_ids, no_spec=True), (
            f"{kind} {layout} vs TP 1"
        )

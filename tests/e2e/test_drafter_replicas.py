"""Several drafter replicas behind one verifier: sequences spread with per-sequence affinity, and a
replica killed mid-stream costs no token (its sequences continue with AR)."""

from __future__ import annotations

import concurrent.futures as cf

import grpc
import pytest

from ddtree.launcher import start_service
from ddtree.protocol.ddtree.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from tests.support.stack_calls import metrics_port, scrape_metrics

pytestmark = pytest.mark.slow
PROMPTS = [[30 + i, 31 + i, 32 + i, 33 + i] for i in range(6)]


def _generate(address, ids, no_spec, on_step=None):
    req = verifier_pb2.GenerateRequest(
        input_ids=ids, max_new_tokens=40, ignore_eos=True, spec=common_pb2.SpecOptions(no_spec=no_spec, budget=8)
    )
    tokens, steps = [], []
    with grpc.insecure_channel(address) as ch:
        for msg in verifier_pb2_grpc.VerifierStub(ch).Generate(req, timeout=300):
            tokens.extend(msg.token_ids)
            steps.extend(msg.steps)
            if on_step:
                on_step(len(steps))
    return tokens, steps


def test_two_replicas_spread_and_survive_a_loss(default_ckpt, tmp_path):
    replicas = [
        start_service(
            f"drafter{i}",
            [
                "drafter",
                "--model",
                str(default_ckpt.drafter),
                "--target",
                str(default_ckpt.target),
                "--port",
                "0",
                "--metrics-port",
                "0",
            ],
            tmp_path,
        )
        for i in range(2)
    ]
    verifier = start_service(
        "verifier",
        [
            "verifier",
            "--model",
            str(default_ckpt.target),
            "--port",
            "0",
            "--drafter",
            ",".join(r.address for r in replicas),
            "--draft-timeout-s",
            "5",
        ],
        tmp_path,
    )
    try:
        ar = [_generate(verifier.address, ids, True)[0] for ids in PROMPTS]
        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(lambda ids: _generate(verifier.address, ids, False), PROMPTS))
        assert [t for t, _ in results] == ar
        calls = [scrape_metrics(metrics_port(r.log_path))["ddtree_drafter_calls_total"] for r in replicas]
        assert all(c > 0 for c in calls), f"a replica got no sequence: {calls}"

        killed = {"done": False}

        def kill_once(n_steps):
            if n_steps == 3 and not killed["done"]:
                killed["done"] = True
                replicas[0].popen.kill()

        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
            futs = [
                pool.submit(_generate, verifier.address, ids, False, kill_once if i == 0 else None)
                for i, ids in enumerate(PROMPTS)
            ]
            results = [f.result() for f in futs]
        assert killed["done"]
        assert [t for t, _ in results] == ar, "a token changed when a drafter replica was lost"
        # New requests still speculate on the surviving replica.
        tokens, steps = _generate(verifier.address, PROMPTS[0], False)
        assert tokens == ar[0] and all(s.tree_nodes > 0 for s in steps)
    finally:
        verifier.stop()
        for r in replicas:
            r.stop()

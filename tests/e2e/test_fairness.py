"""Noisy neighbours (issue 20, point 4): streams cannot take the threads health and GetInfo need,
admission beyond the stream slots is RESOURCE_EXHAUSTED at once (never a wait inside grpcio), and the
tree budget a client may ask for is capped by the server (per API key when keys are set)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddtree.config import GatewayConfig
from ddtree.gateway.auth import ApiKeys, KeyPolicy, Unauthorized, parse_key_file
from ddtree.gateway.pipeline import Invalid, Pipeline
from ddtree.launcher import start_stack
from ddtree.protocol.ddtree.v1 import gateway_pb2, verifier_pb2, verifier_pb2_grpc

STREAMS = 40  # max_batch 16 + max_queue 24: every slot taken


def test_budget_cap_from_the_server_and_the_key(tok):
    config = GatewayConfig(max_budget=8)
    pipeline = Pipeline(tok, router=None, config=config)
    messages = [{"role": "user", "content": "hi"}]
    assert pipeline.chat_job(messages, gateway_pb2.GenerationOptions(budget=8)).request.spec.budget == 8
    with pytest.raises(Invalid, match=r"options\.budget: must be <= 8 .*got 9"):
        pipeline.chat_job(messages, gateway_pb2.GenerationOptions(budget=9))
    # A key's own cap replaces the server's, both ways.
    job = pipeline.complete_job("x", gateway_pb2.GenerationOptions(budget=64), max_budget=64)
    assert job.request.spec.budget == 64
    with pytest.raises(Invalid, match="must be <= 2"):
        pipeline.complete_job("x", gateway_pb2.GenerationOptions(budget=3), max_budget=2)


def test_key_file():
    keys = parse_key_file("# comment\nsk-a\nsk-b max_budget=256  # batch jobs\n\n", "keys.txt", 64)
    assert keys == {"sk-a": KeyPolicy("keys.txt:2", 64), "sk-b": KeyPolicy("keys.txt:3", 256)}
    for text, message in [
        ("sk-a max_budget=0\n", "keys.txt:1: expected 'KEY' or 'KEY max_budget=N'"),
        ("sk-a budget=3\n", "keys.txt:1: expected"),
        ("sk-a\nsk-a\n", "keys.txt:2: this key is listed twice"),
        ("# nothing\n", "keys.txt: no keys in the file"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_key_file(text, "keys.txt", 64)
    api = ApiKeys(keys, 64)
    assert api.authorize("Bearer sk-b").max_budget == 256 and api.authorize("bearer  sk-a ").label == "keys.txt:2"
    for value, message in [(None, "missing API key"), ("Bearer sk-c", "invalid API key"), ("sk-a", "malformed")]:
        with pytest.raises(Unauthorized, match=message):
            api.authorize(value)
    assert ApiKeys({}, 16).authorize(None) == KeyPolicy("open", 16)


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.slow
def test_health_and_getinfo_never_wait_behind_streams(default_ckpt, tmp_path):
    """The issue's case: 40 long direct streams on a verifier (its 32 unary threads would all be taken
    before). Every /health poll stays 200, GetInfo and health answer within their deadline, the 41st
    stream is refused at once, and the slots come back when the streams end."""
    with start_stack(
        str(default_ckpt.target),
        None,
        tmp_path / "logs",
        verifier_args=("--max-batch", "16", "--max-queue", "24", "--kv-tokens", "131072"),
        gateway_args=("--health-interval-s", "0.2"),
    ) as stack:
        channel = grpc.insecure_channel(stack.verifier)
        stub = verifier_pb2_grpc.VerifierStub(channel)
        long = verifier_pb2.GenerateRequest(input_ids=[5, 6, 7], max_new_tokens=2000, ignore_eos=True)
        calls = [stub.Generate(long, timeout=300) for _ in range(STREAMS)]
        first_messages = []

        def read(call):
            try:
                for response in call:
                    first_messages.append(response)
                    break
                for _ in call:
                    pass
            except grpc.RpcError:
                pass  # cancelled at the end

        readers = [threading.Thread(target=read, args=(c,), daemon=True) for c in calls]
        for r in readers:
            r.start()
        # Wait until every stream is in the scheduler (running + waiting): then all the slots are taken.
        deadline = time.monotonic() + 60
        while stub.GetInfo(verifier_pb2.VerifierInfoRequest(), timeout=5).running_requests < STREAMS:
            assert time.monotonic() < deadline, "the streams did not all arrive"
            time.sleep(0.05)
        refused = None
        try:
            list(stub.Generate(verifier_pb2.GenerateRequest(input_ids=[5], max_new_tokens=1), timeout=5))
        except grpc.RpcError as err:
            refused = err
        assert refused is not None and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"{STREAMS} streams in progress" in refused.details()
        polls = []
        health = health_pb2_grpc.HealthStub(channel)
        for _ in range(25):
            polls.append(_status(f"http://{stack.gateway_http}/health"))
            info = stub.GetInfo(verifier_pb2.VerifierInfoRequest(), timeout=2)  # raises DEADLINE_EXCEEDED if stuck
            check = health.Check(health_pb2.HealthCheckRequest(), timeout=2)
            assert check.status == health_pb2.HealthCheckResponse.SERVING
            time.sleep(0.2)
        assert polls == [200] * len(polls), polls
        assert info.running_requests == STREAMS  # max_batch running, the rest waiting
        for c in calls:
            c.cancel()
        for r in readers:
            r.join(30)
        # The slots came back: a new stream is served.
        deadline = time.monotonic() + 30
        while True:
            try:
                out = list(stub.Generate(verifier_pb2.GenerateRequest(input_ids=[5], max_new_tokens=2), timeout=30))
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                time.sleep(0.1)
        assert sum(len(r.token_ids) for r in out) == 2
        channel.close()
        print(json.dumps({"health_polls": len(polls), "all_200": True, "streams": STREAMS}))

"""Every service: grpc.health.v1, server reflection, deadlines, graceful SIGTERM, step records."""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ddtree.protocol.ddtree.v1 import (
    common_pb2,
    drafter_pb2,
    drafter_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)

pytestmark = pytest.mark.slow

SERVICE_NAMES = {"drafter": "ddtree.v1.Drafter", "verifier": "ddtree.v1.Verifier", "gateway": "ddtree.v1.Gateway"}


@pytest.fixture(scope="module")
def stack(default_ckpt, tmp_path_factory):
    from ddtree.launcher import start_stack

    s = start_stack(
        str(default_ckpt.target),
        str(default_ckpt.drafter),
        tmp_path_factory.mktemp("lifecycle"),
        verifier_args=("--grace-s", "30"),
        drafter_args=("--window", "8"),
    )
    yield s
    s.stop()


def _reflected_services(address: str) -> set[str]:
    with grpc.insecure_channel(address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        responses = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        return {s.name for r in responses for s in r.list_services_response.service}


@pytest.mark.parametrize("name", ["drafter", "verifier", "gateway"])
def test_health_and_reflection(stack, name):
    address = stack.get(name).address
    with grpc.insecure_channel(address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", SERVICE_NAMES[name]):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    listed = _reflected_services(address)
    assert {SERVICE_NAMES[name], "grpc.health.v1.Health"} <= listed


def _running(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return (
            verifier_pb2_grpc.VerifierStub(ch).GetInfo(verifier_pb2.VerifierInfoRequest(), timeout=10).running_requests
        )


def test_deadline_is_honoured_and_the_request_is_dropped(stack):
    req = verifier_pb2.GenerateRequest(input_ids=[9, 10, 11], max_new_tokens=4000, ignore_eos=True)
    with grpc.insecure_channel(stack.verifier) as ch:
        with pytest.raises(grpc.RpcError) as info:
            for _ in verifier_pb2_grpc.VerifierStub(ch).Generate(req, timeout=1.0):
                pass
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 20
    while _running(stack.verifier) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _running(stack.verifier) == 0, "the verifier kept running a request whose client gave up"
    # The gateway passes the client's remaining time on to the verifier.
    with grpc.insecure_channel(stack.gateway) as ch:
        req = gateway_pb2.CompleteRequest(
            prompt="hello", options=gateway_pb2.GenerationOptions(max_tokens=4000, ignore_eos=True)
        )
        with pytest.raises(grpc.RpcError) as info:
            for _ in gateway_pb2_grpc.GatewayStub(ch).Complete(req, timeout=1.0):
                pass
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_drafter_windows_and_releases_contexts(stack):
    """Window 8: only the last 8 committed tokens' features travel; contexts are freed at the end."""
    req = verifier_pb2.GenerateRequest(
        input_ids=list(range(20, 60)), max_new_tokens=20, ignore_eos=True, spec=common_pb2.SpecOptions(budget=4)
    )
    with grpc.insecure_channel(stack.verifier) as ch:
        steps = [s for m in verifier_pb2_grpc.VerifierStub(ch).Generate(req, timeout=120) for s in m.steps]
    with grpc.insecure_channel(stack.get("drafter").address) as ch:
        info = drafter_pb2_grpc.DrafterStub(ch).GetInfo(drafter_pb2.DrafterInfoRequest(), timeout=10)
        width = len(info.target_layer_ids) * info.hidden_size * 4  # fp32 bytes per token
        assert info.window == 8
        # First step: the 40-token prompt is cut to the window; later: the previous step's commit.
        assert steps[0].feature_bytes == 8 * width
        assert all(s.feature_bytes == prev.accept_length * width for prev, s in zip(steps, steps[1:]))
        deadline = time.monotonic() + 10
        while info.active_sequences and time.monotonic() < deadline:
            time.sleep(0.2)
            info = drafter_pb2_grpc.DrafterStub(ch).GetInfo(drafter_pb2.DrafterInfoRequest(), timeout=10)
        assert info.active_sequences == 0


def test_step_records_are_structlog_json(stack):
    lines = [
        json.loads(line) for line in stack.get("verifier").log_path.read_text().splitlines() if line.startswith("{")
    ]
    steps = [r for r in lines if r.get("event") == "step"]
    assert steps, "no step records in the verifier log"
    for field in (
        "request_id",
        "step",
        "context_tokens",
        "tree_nodes",
        "accept_length",
        "draft_ms",
        "verify_ms",
        "transport_ms",
        "total_ms",
        "feature_bytes",
        "timestamp",
        "level",
    ):
        assert field in steps[-1], field


def test_sigterm_lets_in_flight_requests_finish(default_ckpt, tmp_path):
    """SIGTERM: health turns NOT_SERVING, new calls are refused, the running stream completes, exit 0."""
    from ddtree.launcher import start_service

    verifier = start_service(
        "verifier", ["verifier", "--model", str(default_ckpt.target), "--port", "0", "--grace-s", "60"], tmp_path
    )
    try:
        req = verifier_pb2.GenerateRequest(input_ids=[3, 4, 5], max_new_tokens=300, ignore_eos=True)
        got: list[int] = []
        result: dict = {}

        def consume():
            with grpc.insecure_channel(verifier.address) as ch:
                try:
                    for msg in verifier_pb2_grpc.VerifierStub(ch).Generate(req, timeout=120):
                        got.extend(msg.token_ids)
                        if msg.finish_reason:
                            result["finish"] = msg.finish_reason
                except grpc.RpcError as err:
                    result["error"] = err.code()

        t = threading.Thread(target=consume)
        t.start()
        while len(got) < 5:
            time.sleep(0.05)
        verifier.popen.terminate()
        t.join(120)
        assert result.get("finish") == "length", result
        assert len(got) == 300
        assert verifier.popen.wait(60) == 0
    finally:
        verifier.stop()

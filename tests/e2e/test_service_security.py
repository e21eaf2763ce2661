"""Open doors closed (issue 20, point 7): a service token or mutual TLS between the services, API keys
from a file with per-key budget caps, /metrics and reflection behind the key, health open to probes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ddtree.launcher import start_stack
from ddtree.protocol.ddtree.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from ddtree.protocol.security import TOKEN_METADATA
from scripts.data.make_service_certs import make_certs

pytestmark = pytest.mark.slow

TOKEN = "service-token-for-tests"
KEYS = "# team keys\nsk-small max_budget=4\nsk-big max_budget=32\n"


def _post(http_address: str, path: str, body: dict | None, key: str | None) -> tuple[int, dict | str]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://{http_address}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            text = resp.read().decode()
            status = resp.status
    except urllib.error.HTTPError as e:
        text, status = e.read().decode(), e.code
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def _generate(stub, metadata=None, budget=8) -> list[verifier_pb2.GenerateResponse]:
    request = verifier_pb2.GenerateRequest(
        input_ids=[5, 6, 7, 8], max_new_tokens=8, ignore_eos=True, spec=common_pb2.SpecOptions(budget=budget)
    )
    return list(stub.Generate(request, timeout=60, metadata=metadata))


@pytest.fixture(scope="module")
def token_stack(default_ckpt, tmp_path_factory):
    secrets = tmp_path_factory.mktemp("secrets")
    (secrets / "token").write_text(TOKEN + "\n")
    (secrets / "keys").write_text(KEYS)
    token = ("--service-token-file", str(secrets / "token"))
    stack = start_stack(
        str(default_ckpt.target),
        str(default_ckpt.drafter),
        tmp_path_factory.mktemp("logs-token"),
        drafter_args=token,
        verifier_args=token,
        gateway_args=(*token, "--api-key-file", str(secrets / "keys")),
    )
    yield stack
    stack.stop()


def test_verifier_and_drafter_need_the_token(token_stack):
    with grpc.insecure_channel(token_stack.verifier) as ch:
        stub = verifier_pb2_grpc.VerifierStub(ch)
        for metadata, message in [
            (None, "missing service token"),
            (((TOKEN_METADATA, "wrong"),), "invalid service token"),
        ]:
            with pytest.raises(grpc.RpcError) as err:
                _generate(stub, metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and message in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.GetInfo(verifier_pb2.VerifierInfoRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # With the token: served, and the verifier's own calls to the drafter carried it (trees were verified).
        responses = _generate(stub, ((TOKEN_METADATA, TOKEN),))
        steps = [s for r in responses for s in r.steps]
        assert sum(len(r.token_ids) for r in responses) == 8
        assert any(s.tree_nodes > 0 for s in steps), "no step verified a tree: the drafter refused the verifier?"
        # Health stays open to probes that carry no secret.
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    drafter = token_stack.get("drafter").address
    with grpc.insecure_channel(drafter) as ch:
        with pytest.raises(grpc.RpcError) as err:
            drafter_pb2_grpc.DrafterStub(ch).GetInfo(drafter_pb2.DrafterInfoRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # `ddtree health` (the containers' health check) needs no token either.
    out = subprocess.run(
        [sys.executable, "-m", "ddtree.cli", "health", drafter], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "SERVING" in out.stdout


def test_api_keys_from_a_file_with_budget_caps(token_stack):
    http = token_stack.gateway_http
    body = {"prompt": "def f(", "max_tokens": 4, "temperature": 0}
    status, answer = _post(http, "/v1/completions", body, None)
    assert status == 401 and "missing API key" in answer["error"]["message"]
    status, answer = _post(http, "/v1/completions", {**body, "budget": 8}, "sk-small")
    assert status == 400 and answer["error"]["message"].startswith("budget: must be <= 4")
    status, answer = _post(http, "/v1/completions", {**body, "budget": 8}, "sk-big")
    assert status == 200 and answer["usage"]["completion_tokens"] == 4
    status, answer = _post(http, "/v1/completions", {**body, "budget": 33}, "sk-big")
    assert status == 400 and "must be <= 32" in answer["error"]["message"]
    # The keys came from a file: no process shows one on its command line.
    for p in token_stack.processes:
        cmdline = open(f"/proc/{p.popen.pid}/cmdline", "rb").read().decode()
        assert "sk-small" not in cmdline and "sk-big" not in cmdline and TOKEN not in cmdline


def test_metrics_and_reflection_need_a_key(token_stack):
    http = token_stack.gateway_http
    for key, expected in [(None, 401), ("wrong", 401), ("sk-small", 200)]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        request = urllib.request.Request(f"http://{http}/metrics", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                status, text = resp.status, resp.read().decode()
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode()
        assert status == expected, (key, text[:200])
        if status == 200:
            assert "ddtree_gateway_verifier_healthy" in text
    status, answer = _post(http, "/health", None, None)
    assert status == 200 and answer["status"] == "ok"
    with grpc.insecure_channel(token_stack.gateway) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as err:
            list(stub.ServerReflectionInfo(iter([ask]), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        answers = list(
            stub.ServerReflectionInfo(iter([ask]), timeout=10, metadata=(("authorization", "Bearer sk-big"),))
        )
        names = {s.name for s in answers[0].list_services_response.service}
        assert "ddtree.v1.Gateway" in names


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command line tool")
def test_mutual_tls_between_services(default_ckpt, tmp_path):
    certs = make_certs(tmp_path / "certs")

    def tls(name: str) -> tuple[str, ...]:
        return ("--tls-ca", str(certs / "ca.pem"), "--tls-cert", str(certs / f"{name}.pem"),
                "--tls-key", str(certs / f"{name}.key"))  # fmt: skip

    with start_stack(
        str(default_ckpt.target),
        str(default_ckpt.drafter),
        tmp_path / "logs",
        drafter_args=tls("drafter"),
        verifier_args=tls("verifier"),
        gateway_args=tls("gateway"),
    ) as stack:
        # The whole path works: gateway -> verifier -> drafter over TLS with client certificates. Greedy: at
        # the API's default temperature 1 the random model (near-uniform over ~1,500 tokens, two stop ids)
        # samples a stop token within 6 tokens in about 0.3% of runs, which once ended this completion at 5.
        body = {"prompt": "x = ", "max_tokens": 6, "temperature": 0}
        status, answer = _post(stack.gateway_http, "/v1/completions", body, None)
        assert status == 200 and answer["usage"]["completion_tokens"] == 6, answer
        # ... and the verifier's calls to the drafter: a client with a certificate sees trees verified.
        mine = grpc.ssl_channel_credentials(
            (certs / "ca.pem").read_bytes(), (certs / "gateway.key").read_bytes(), (certs / "gateway.pem").read_bytes()
        )
        with grpc.secure_channel(stack.verifier, mine) as ch:
            steps = [s for r in _generate(verifier_pb2_grpc.VerifierStub(ch)) for s in r.steps]
        assert any(s.tree_nodes > 0 for s in steps), "no tree verified: the drafter refused the verifier?"
        # A plaintext client, or a TLS client without a certificate, gets nowhere.
        with grpc.insecure_channel(stack.verifier) as ch:
            with pytest.raises(grpc.RpcError) as err:
                verifier_pb2_grpc.VerifierStub(ch).GetInfo(verifier_pb2.VerifierInfoRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        anonymous = grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes())
        with grpc.secure_channel(stack.verifier, anonymous) as ch:
            with pytest.raises(grpc.RpcError) as err:
                verifier_pb2_grpc.VerifierStub(ch).GetInfo(verifier_pb2.VerifierInfoRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # `ddtree health` dials TLS with the service's own settings.
        out = subprocess.run(
            [sys.executable, "-m", "ddtree.cli", "health", stack.verifier, *tls("gateway")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and "SERVING" in out.stdout, out.stdout + out.stderr

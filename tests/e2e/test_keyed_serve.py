"""Issue 47 on `ddtree serve --gateway-args '--api-key-file K'` as an operator runs it (the shipped demo pair,
the real DFlash drafter), one stack for the module:
- serve gives its engines a generated service token: Verifier.Generate, Drafter.GetInfo and Drafter.Release
  without it are UNAUTHENTICATED (the key alone no longer leaves the engines open);
- a token holder naming the verifier's instance with a forged incarnation mid-request orphans nothing: the
  request keeps its context (no resend), and its tokens equal AR;
- a context lost mid-request (the verifier stopped past the drafter's lease: the drafter releases it) is sent
  again: ddtree_draft_contexts_resent_total counts it, the request's later steps accept more than one
  token again, and its tokens equal AR;
- `ddtree generate --api-key-file` reaches the keyed gateway;
- a SIGKILLed drafter comes back with its Prometheus endpoint on the same port, printed on serve's line.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest

from ddtree.default_checkpoint import DEMO_DIR
from ddtree.protocol.ddtree.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from ddtree.protocol.security import TOKEN_METADATA
from ddtree.tokenization.tokenizer import Tokenizer
from tests.support.paths import REPO
from tests.support.serve_process import Serve
from tests.support.stack_calls import generate, scrape_metrics

pytestmark = pytest.mark.slow

KEY = "sk-keyed-serve-47"
LEASE_S = 5.0  # the drafter's context lease: a verifier stopped longer loses its contexts
MAX_NEW = 320


@pytest.fixture(scope="module")
def keyed(default_ckpt, tmp_path_factory):
    if not (DEMO_DIR / "target" / "config.json").is_file():
        pytest.fail("the shipped demo pair (checkpoints/demo) is part of the repository")
    tmp = tmp_path_factory.mktemp("keyed-serve")
    (tmp / "keys").write_text(f"{KEY}\n")
    serve = Serve(
        default_ckpt,
        tmp / "logs",
        "--gateway-args", f"--api-key-file {tmp / 'keys'}",
        "--drafter-args", f"--context-lease-s {LEASE_S}",
        metrics=True,
    )  # fmt: skip
    token_line = next(line for line in serve.lines if line.startswith("service token: "))
    serve.token = open(token_line.split()[2]).read().strip()
    serve.key_file = tmp / "keys"
    yield serve
    serve.stop()


def _prompt_ids() -> list[int]:
    return Tokenizer(DEMO_DIR / "target").encode("def fibonacci(n):\n    ")


def _counter(serve: Serve, name: str, family: str, labels: str = "") -> float:
    """A counter of that service (summed over its labels, or the sample with exactly `labels`)."""
    port = int(serve.metrics[name].rsplit(":", 1)[1].split("/")[0])
    return sum(v for k, v in scrape_metrics(port).items() if k.split("{")[0] == family and labels in k)


def test_without_the_service_token_the_engines_refuse(keyed):
    verifier, drafter = keyed.children["verifier"][0], keyed.children["drafter"][0]
    with grpc.insecure_channel(verifier) as ch:
        request = verifier_pb2.GenerateRequest(input_ids=[5, 6, 7], max_new_tokens=4)
        with pytest.raises(grpc.RpcError) as err:
            list(verifier_pb2_grpc.VerifierStub(ch).Generate(request, timeout=30))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(drafter) as ch:
        stub = drafter_pb2_grpc.DrafterStub(ch)
        for call, request in [
            (stub.GetInfo, drafter_pb2.DrafterInfoRequest()),
            (stub.Release, drafter_pb2.ReleaseRequest(seq_ids=["x"])),
        ]:
            with pytest.raises(grpc.RpcError) as err:
                call(request, timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        info = stub.GetInfo(drafter_pb2.DrafterInfoRequest(), timeout=30, metadata=((TOKEN_METADATA, keyed.token),))
        assert info.window > 0  # the token opens it


class TimedStream(threading.Thread):
    """One Generate through the verifier with the token; every message's arrival time and steps."""

    def __init__(self, keyed, ids: list[int], **kw):
        super().__init__(daemon=True)
        self.keyed, self.ids, self.kw = keyed, ids, kw
        self.arrivals: list[tuple[float, list]] = []
        self.first = threading.Event()
        self.tokens: list[int] = []

    def on_message(self, msg) -> None:
        self.arrivals.append((time.monotonic(), list(msg.steps)))
        if msg.token_ids:
            self.first.set()

    def run(self) -> None:
        meta = ((TOKEN_METADATA, self.keyed.token),)
        self.tokens, _, _ = generate(
            self.keyed.children["verifier"][0], self.ids, metadata=meta, on_message=self.on_message, **self.kw
        )


def _ar(keyed) -> list[int]:
    meta = ((TOKEN_METADATA, keyed.token),)
    return generate(keyed.children["verifier"][0], _prompt_ids(), no_spec=True, max_new=MAX_NEW, metadata=meta)[0]


def test_a_forged_incarnation_orphans_nothing(keyed):
    ar = _ar(keyed)
    orphaned = _counter(keyed, "drafter", "ddtree_drafter_contexts_released_total", 'reason="orphaned"')
    stream = TimedStream(keyed, _prompt_ids(), no_spec=False, budget=16, max_new=MAX_NEW)
    stream.start()
    assert stream.first.wait(120)
    name = f"{socket.gethostname()}:{keyed.children['verifier'][0].rsplit(':', 1)[1]}"  # the verifier's instance
    with grpc.insecure_channel(keyed.children["drafter"][0]) as ch:
        forged = drafter_pb2.Caller(name=name, incarnation="evil")
        drafter_pb2_grpc.DrafterStub(ch).GetInfo(
            drafter_pb2.DrafterInfoRequest(caller=forged), timeout=30, metadata=((TOKEN_METADATA, keyed.token),)
        )
    stream.join(300)
    assert stream.tokens == ar
    assert _counter(keyed, "drafter", "ddtree_drafter_contexts_released_total", 'reason="orphaned"') == orphaned


def test_a_context_lost_mid_request_is_resent_and_speculation_resumes(keyed):
    ar = _ar(keyed)
    resent = _counter(keyed, "verifier", "ddtree_draft_contexts_resent_total")
    stream = TimedStream(keyed, _prompt_ids(), no_spec=False, budget=16, max_new=MAX_NEW)
    stream.start()
    assert stream.first.wait(120)
    time.sleep(0.3)
    pid = keyed.children["verifier"][1]
    os.kill(pid, signal.SIGSTOP)  # past the lease: the drafter releases the context at the next call
    time.sleep(2 * LEASE_S + 1)
    os.kill(pid, signal.SIGCONT)
    resumed = time.monotonic() + 1.0  # messages held while stopped arrive first
    stream.join(300)
    assert stream.tokens == ar, "a token changed across the context's loss"
    assert _counter(keyed, "verifier", "ddtree_draft_contexts_resent_total") >= resent + 1
    later = [s.accept_length for at, steps in stream.arrivals if at > resumed for s in steps]
    assert later, "the request ended before the loss; make it longer"
    assert max(later) > 1, f"no speculation after the context was lost: {later}"


def test_generate_takes_the_api_key_from_a_file(keyed):
    gateway = keyed.children["gateway"][0]
    base = [sys.executable, "-m", "ddtree.cli", "generate", "--gateway", gateway, "--prompt", "hi", "--max-tokens", "4"]
    env = {k: v for k, v in os.environ.items() if k != "DDTREE_API_KEY"}
    ok = subprocess.run(
        [*base, "--api-key-file", str(keyed.key_file)], capture_output=True, text=True, env=env, cwd=REPO
    )
    assert ok.returncode == 0, ok.stderr
    refused = subprocess.run(base, capture_output=True, text=True, env=env, cwd=REPO)
    assert refused.returncode == 2 and "refused the API key" in refused.stderr


def test_a_restarted_drafter_keeps_its_metrics_port(keyed):
    address, pid = keyed.children["drafter"]
    url = keyed.metrics["drafter"]
    os.kill(pid, signal.SIGKILL)
    line = keyed.wait_for(f"serve: drafter serving again on {address}   metrics ", 120)
    assert re.search(r"metrics (\S+)", line).group(1) == url
    assert "ddtree_drafter_calls_total" in urllib.request.urlopen(url, timeout=30).read().decode()

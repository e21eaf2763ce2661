"""`ddtree serve` supervises its children: a SIGKILLed verifier, then drafter, is restarted on the same address
with a log line, and a request through the gateway succeeds again within 60 s with no manual step;
`--no-restart` exits non-zero instead, for an outer supervisor."""

from __future__ import annotations

import os
import re
import signal
import time

import grpc
import pytest

from ddtree.protocol.ddtree.v1 import gateway_pb2, gateway_pb2_grpc
from tests.support.serve_process import Serve

RECOVERY_S = 60


def complete(gateway: str, no_spec: bool = False) -> list[int]:
    opts = gateway_pb2.GenerationOptions(max_tokens=8, ignore_eos=True, no_spec=no_spec, budget=4)
    with grpc.insecure_channel(gateway) as ch:
        stream = gateway_pb2_grpc.GatewayStub(ch).Complete(
            gateway_pb2.CompleteRequest(prompt="def parse(", options=opts), timeout=30
        )
        return [t for chunk in stream for t in chunk.token_ids]


def serving_again_within(gateway: str, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while True:
        try:
            return complete(gateway)
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


@pytest.mark.slow
def test_serve_restarts_a_killed_verifier_then_drafter(default_ckpt, tmp_path):
    serve = Serve(default_ckpt, tmp_path)
    try:
        gateway = serve.children["gateway"][0]
        before = complete(gateway)
        assert len(before) == 8
        for name in ("verifier", "drafter"):
            address, pid = serve.children[name]
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            assert serving_again_within(gateway, RECOVERY_S) == before  # greedy: the same tokens
            assert time.monotonic() - killed < RECOVERY_S
            assert serve.wait_for(f"serve: {name} exited with code -9", 5)
            line = serve.wait_for(f"serve: {name} serving again on {address}   pid ", RECOVERY_S)
            serve.children[name] = (address, int(re.search(r"pid (\d+)", line).group(1)))
            assert serve.children[name][1] != pid
        assert serve.popen.poll() is None
    finally:
        serve.stop()
    assert serve.popen.returncode == 0


@pytest.mark.slow
def test_serve_no_restart_exits_non_zero(default_ckpt, tmp_path):
    serve = Serve(default_ckpt, tmp_path, "--no-restart", "--no-drafter")
    try:
        os.kill(serve.children["verifier"][1], signal.SIGKILL)
        assert serve.popen.wait(60) == 1
        serve.wait_for("serve: verifier exited with code -9", 5)
        assert not any("restarting" in line for line in serve.lines)
    finally:
        serve.stop()

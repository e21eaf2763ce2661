"""The small form of the fuzz and fault suite (tests/support/fuzz_suite.py), as CI runs it: a real stack on loopback,
every HTTP endpoint and gRPC RPC fuzzed, the faults injected; the suite's own verdict must be ok."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.fuzz.common import SMALL
from tests.support.fuzz.faults import MARGIN_S
from tests.support.fuzz.grpc_cases import RPCS
from tests.support.fuzz.http_cases import ENDPOINTS
from tests.support.paths import REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    out = tmp_path_factory.mktemp("fuzz") / "result.json"
    logs = out.parent / "logs"
    res = subprocess.run(
        [sys.executable, "-m", "tests.support.fuzz_suite", "--out", str(out), "--log-dir", str(logs)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.is_file(), f"no summary written (exit {res.returncode}):\n{(res.stdout + res.stderr)[-6000:]}"
    data = json.loads(out.read_text())
    data["_output"] = res.stdout[-6000:]
    return data


def test_the_suite_finds_nothing(summary):
    shown = json.dumps(summary["failures"], indent=1)[:8000]
    assert summary["ok"], f"{len(summary['failures'])} failures:\n{shown}\n{summary['_output']}"
    assert summary["http_5xx"] == summary["grpc_unknown"] == summary["grpc_internal_from_project"] == 0


def test_every_endpoint_and_rpc_was_fuzzed(summary):
    assert set(ENDPOINTS) <= set(summary["http"]), sorted(summary["http"])
    assert all(summary["http"][e]["requests"] > 0 for e in ENDPOINTS)
    assert set(RPCS) <= set(summary["grpc"]), sorted(summary["grpc"])
    assert all(summary["grpc"][rpc]["requests"] >= SMALL.grpc_cases for rpc in RPCS)


def test_the_canary_never_changed(summary):
    canary = summary["canary"]
    assert canary["runs"] > 0 and canary["identical"], canary


def test_a_stopped_drafter_stalls_a_stream_one_draft_timeout_at_most(summary):
    stop = summary["faults"]["drafter SIGSTOP"]
    assert stop["streams_running_past_first_timeout"] > 0, stop
    assert stop["stall_max_s"] <= SMALL.draft_timeout_s + MARGIN_S, stop
    assert stop["outputs_identical"], stop
    for fault in ("drafter SIGKILL", "verifier SIGKILL", "mass disconnects", "request-id reuse", "KV exhaustion"):
        assert fault in summary["faults"], f"the {fault} phase did not complete"

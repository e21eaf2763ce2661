"""Prometheus metrics (docs/design.md §8 names) are served and move with real traffic."""

from __future__ import annotations

import re
import time
import urllib.request

import grpc
import pytest

from ddtree.protocol.ddtree.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

pytestmark = pytest.mark.slow


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _metrics_port(log_path) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = re.search(r"LISTENING metrics [\d.]+:(\d+)", log_path.read_text())
        if m:
            return int(m.group(1))
        time.sleep(0.1)
    raise AssertionError("no metrics endpoint announced")


def test_verifier_and_drafter_metrics(default_ckpt, tmp_path):
    from ddtree.launcher import start_stack

    with start_stack(
        str(default_ckpt.target),
        str(default_ckpt.drafter),
        tmp_path,
        verifier_args=("--metrics-port", "0"),
        drafter_args=("--metrics-port", "0"),
    ) as stack:
        vport = _metrics_port(stack.get("verifier").log_path)
        dport = _metrics_port(stack.get("drafter").log_path)
        req = verifier_pb2.GenerateRequest(
            input_ids=[7, 8, 9], max_new_tokens=12, ignore_eos=True, spec=common_pb2.SpecOptions(budget=8)
        )
        with grpc.insecure_channel(stack.verifier) as ch:
            steps = [s for m in verifier_pb2_grpc.VerifierStub(ch).Generate(req, timeout=60) for s in m.steps]
        v = _scrape(vport)
        assert v["ddtree_accept_length_count"] == len(steps)
        assert v["ddtree_accept_length_sum"] == sum(s.accept_length for s in steps)
        for phase in ("draft", "verify", "transport", "total"):
            assert v[f'ddtree_step_seconds_count{{phase="{phase}"}}'] == len(steps)
        assert v["ddtree_tree_nodes_sum"] == sum(s.tree_nodes for s in steps)
        assert v["ddtree_feature_bytes_total"] == sum(s.feature_bytes for s in steps) > 0
        assert v["ddtree_context_tokens_count"] == len(steps)
        assert v['ddtree_requests_total{finish_reason="length"}'] == 1
        assert v["ddtree_time_to_first_token_seconds_count"] == 1
        assert v["ddtree_request_seconds_count"] == 1
        assert v["ddtree_kv_slots_total"] > 0
        d = _scrape(dport)
        assert d["ddtree_drafter_calls_total"] == len(steps)
        assert d["ddtree_drafter_draft_seconds_count"] == len(steps)

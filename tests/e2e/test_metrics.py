"""Prometheus metrics (docs/design.md §8 names): each service exports exactly its own families, from its
own registry; they move with real traffic; the state gauges read the true state when idle."""

from __future__ import annotations

import time
import urllib.request

import grpc
import prometheus_client
import pytest
import torch

from ddtree.protocol.ddtree.v1 import common_pb2, drafter_pb2, gateway_pb2, verifier_pb2, verifier_pb2_grpc
from tests.support.stack_calls import metrics_port, scrape_metrics

DRAFTER_FAMILIES = {
    "ddtree_drafter_calls",
    "ddtree_drafter_draft_seconds",
    "ddtree_drafter_append_chunks",
    "ddtree_drafter_sequences",
    "ddtree_drafter_context_bytes",
    "ddtree_drafter_contexts_released",
    "ddtree_drafter_contexts_unknown",  # Draft calls naming a context the drafter does not hold (resent)
    "ddtree_drafter_calls_refused",  # calls naming another caller's contexts
}
VERIFIER_STATE = ("ddtree_running_sequences", "ddtree_queued_requests", "ddtree_kv_slots_used")


def _families(text: str) -> set[str]:
    """The ddtree_ family names of a scrape (`# TYPE name kind` lines; counters without `_total`)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE ddtree_"):
            name, kind = line.split()[2:4]
            if not name.endswith("_created"):
                names.add(name.removesuffix("_total") if kind == "counter" else name)
    return names


def _kind(name: str) -> str:
    if name in DRAFTER_FAMILIES:
        return "drafter"
    return "gateway" if name.startswith("ddtree_gateway_") else "verifier"


def test_each_service_registry_holds_only_its_own_families():
    from ddtree.drafter import metrics as drafter
    from ddtree.gateway import metrics as gateway
    from ddtree.verifier import metrics as verifier

    seen = {}
    for kind, module in (("verifier", verifier), ("drafter", drafter), ("gateway", gateway)):
        text = prometheus_client.generate_latest(module.REGISTRY).decode()
        names = _families(text)
        assert names and {_kind(n) for n in names} == {kind}, (kind, names)
        assert "process_resident_memory_bytes" in text  # the process's standard families come along
        seen[kind] = names
    assert DRAFTER_FAMILIES == seen["drafter"]
    assert {*VERIFIER_STATE, "ddtree_kv_slots_total", "ddtree_accept_length"} <= seen["verifier"]
    assert {"ddtree_gateway_requests", "ddtree_gateway_verifier_healthy"} <= seen["gateway"]
    # nothing of ours in the process-wide default registry
    assert not _families(prometheus_client.generate_latest().decode())


def test_state_gauges_sum_live_sources_at_scrape_time():
    from ddtree.telemetry.metrics import StateGauges

    class Source:
        def __init__(self, n):
            self.n = n

        def metric_state(self):
            return {"held": self.n}

    class Broken:
        def metric_state(self):
            raise RuntimeError("boom")

    registry = prometheus_client.CollectorRegistry()
    gauges = StateGauges(registry, {"held": ("test_things_held", "Things held")})
    a, b, broken = Source(2), Source(3), Broken()
    for s in (a, b, broken):
        gauges.track(s)
    assert registry.get_sample_value("test_things_held") == 5  # a failing source is skipped, not the scrape
    a.n = 0
    assert registry.get_sample_value("test_things_held") == 3  # read now, not when last set
    gauges.untrack(b)
    del broken
    assert registry.get_sample_value("test_things_held") == 0


class _FakeEngine:
    """Just enough of a draft engine for the servicer: a context per seq id, 100 bytes each."""

    def __init__(self):
        self.contexts = set()

    def knows(self, seq_id):
        return seq_id in self.contexts

    def info(self):
        return {"active_sequences": len(self.contexts)}

    @property
    def context_bytes(self):
        return 100 * len(self.contexts)

    def draft(self, seqs):
        from ddtree.contract.token_tree import EMPTY_TREE

        self.contexts.update(s.seq_id for s in seqs)
        return [EMPTY_TREE for _ in seqs]

    def release(self, ids):
        known = [i for i in ids if i in self.contexts]
        self.contexts.difference_update(known)
        return len(known)


def test_drafter_state_gauges_follow_draft_and_release():
    from ddtree.drafter import metrics
    from ddtree.drafter.server import DrafterServicer
    from ddtree.protocol.tensors import tensor_to_proto

    before = metrics.STATE.values()
    servicer = DrafterServicer(_FakeEngine(), max_sequences=8)
    feats = tensor_to_proto(torch.zeros(0, 4))
    req = drafter_pb2.DraftRequest(
        seqs=[drafter_pb2.SeqDraft(seq_id=f"s{i}", commit_features=feats, budget=4, reset=True) for i in range(3)]
    )
    servicer.Draft(req, None)
    now = metrics.STATE.values()
    assert now["sequences"] - before["sequences"] == 3 and now["context_bytes"] - before["context_bytes"] == 300
    servicer.Release(drafter_pb2.ReleaseRequest(seq_ids=["s0", "s1", "s2"]), None)
    assert metrics.STATE.values() == before  # idle again: no phantom contexts
    metrics.STATE.untrack(servicer)


@pytest.mark.slow
def test_verifier_and_drafter_metrics(default_ckpt, tmp_path):
    from ddtree.client import generate
    from ddtree.launcher import start_stack

    with start_stack(str(default_ckpt.target), str(default_ckpt.drafter), tmp_path, metrics=True) as stack:
        vport = metrics_port(stack.get("verifier").log_path)
        dport = metrics_port(stack.get("drafter").log_path)
        gport = int(stack.metrics_address("gateway").rsplit(":", 1)[1])
        assert stack.metrics_address("verifier").endswith(f":{vport}")
        req = verifier_pb2.GenerateRequest(
            input_ids=[7, 8, 9], max_new_tokens=12, ignore_eos=True, spec=common_pb2.SpecOptions(budget=8)
        )
        with grpc.insecure_channel(stack.verifier) as ch:
            steps = [s for m in verifier_pb2_grpc.VerifierStub(ch).Generate(req, timeout=60) for s in m.steps]
        v = scrape_metrics(vport)
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
        d = scrape_metrics(dport)
        assert d["ddtree_drafter_calls_total"] == len(steps)
        assert d["ddtree_drafter_draft_seconds_count"] == len(steps)
        opts = gateway_pb2.GenerationOptions(max_tokens=6, ignore_eos=True, budget=8)
        assert generate(stack.gateway, "hello", chat=False, options=opts).usage["completion_tokens"] == 6
        # Traffic over: every state gauge reads the idle state (the drafter's Release is asynchronous).
        deadline = time.monotonic() + 15
        while (d := scrape_metrics(dport))["ddtree_drafter_sequences"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert d["ddtree_drafter_sequences"] == 0 and d["ddtree_drafter_context_bytes"] == 0
        v = scrape_metrics(vport)
        assert all(v[name] == 0 for name in VERIFIER_STATE), {n: v[n] for n in VERIFIER_STATE}
        assert 0 <= v["ddtree_kv_slots_cached"] <= v["ddtree_kv_slots_total"] > 0
        g = scrape_metrics(gport)
        assert g["ddtree_gateway_running_requests"] == 0
        assert g['ddtree_gateway_requests_total{api="complete",outcome="length",protocol="grpc"}'] == 1
        assert g[f'ddtree_gateway_verifier_outstanding{{verifier="{stack.verifier}"}}'] == 0
        # Each service's endpoint serves its own families, none of the others'.
        for kind, port in (("verifier", vport), ("drafter", dport), ("gateway", gport)):
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            assert {_kind(n) for n in _families(text)} == {kind}, (kind, _families(text))

"""The deployment part of `ddtree selftest gpu` (tools/selftest/deploy_check.py), dry run on the CPU: the
memory plan admits a KV pool on the stated device, the verifier starts with it, and the first and a warm
request through the gateway are timed. (The timings are reported, not asserted.)"""

from __future__ import annotations

import pytest

from ddtree.tools.selftest.deploy_check import DRY_RUN_DEVICE_BYTES, run_deploy_check


@pytest.mark.slow
def test_deploy_check_dry_run(tmp_path):
    lines = []
    out = run_deploy_check(True, tmp_path, lines.append)
    assert out["errors"] == []
    plan = out["plan"]
    assert plan["device_bytes"] == DRY_RUN_DEVICE_BYTES and 0 <= plan["headroom_bytes"] < plan["device_bytes"]
    assert plan["kv_tokens"] > 0 and plan["items"]["KV pool"] > 0 and plan["items"]["weights"] > 0
    assert plan["used_bytes"] == sum(plan["items"].values())
    for key in ("start_s", "first_request_s", "warm_request_s", "free_after_start_bytes"):
        assert out[key] > 0, key
    assert any(line.startswith("memory plan on 3.0 GB") for line in lines)
    assert any(line.startswith("start ") for line in lines)

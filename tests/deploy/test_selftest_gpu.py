"""The GPU check (`ddtree selftest gpu`, tools/selftest/) cannot rot: its --dry-run runs here on the CPU (shapes
shrunk, kernels interpreted, the three services as processes) and writes the JSON the GPU run writes, and a
spoiled reference makes it fail."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from ddtree.tools.selftest.kernels import kernel_check as gk
from ddtree.tools.selftest.oracle.trees import expected_accept_length
from ddtree.tools.selftest.serving_check import first_mismatch
from tests.support import installed_env as env

KERNELS = {"mla decode", "mla verify", "mla extend", "latent write", "fp8 gemm", "int4 gemm", "fused moe bf16",
           "fused moe int4", "fused moe fp8", "router", "add rms norm", "silu and mul", "rope q", "draft graph"}  # fmt: skip
ROW_KEYS = {"mode", "kind", "context", "prompt_tokens", "tokens", "steps", "tau", "draft_ms", "verify_ms",
            "transport_ms", "step_ms", "decode_tok_s", "ttft_ms", "identical"}  # fmt: skip


def _dry_run(tmp_path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "selftest_gpu.json"
    # part (d), the deployment check, has its own dry-run test (test_selftest_deploy.py), and so has the
    # row-invariance part (`ddtree selftest invariance`) and the lossless part (test_selftest_lossless.py)
    cmd = [
        sys.executable,
        "-m",
        "ddtree.cli",
        "selftest",
        "gpu",
        "--dry-run",
        "--skip-deploy",
        "--skip-invariance",
        "--skip-lossless",
        "--out",
        str(out),
        *extra,
    ]
    res = subprocess.run(cmd, cwd=env.ROOT, capture_output=True, text=True, timeout=900)
    assert out.is_file(), res.stdout[-3000:] + res.stderr[-3000:]
    return res, json.loads(out.read_text())


@pytest.mark.slow
def test_dry_run_checks_every_kernel_and_serves_ar_and_ddtree(tmp_path):
    res, data = _dry_run(tmp_path)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert data["ok"] and data["dry_run"] and data["mismatches"] == 0 and not data["errors"]
    # where it was measured, so that the JSON can be committed under docs/measurements/
    assert data["device"] == "cpu (interpreted)" and data["date"].endswith("+00:00")
    assert re.fullmatch(r"[0-9a-f]{40}|unknown", data["commit"]) and "selftest gpu --dry-run" in data["command"]
    rows = data["kernels"]["rows"]
    assert {r["kernel"] for r in rows} == KERNELS
    assert all(r["ok"] and r["us"] > 0 and r["torch_us"] > 0 and r["bytes"] > 0 for r in rows)
    serving = data["serving"]
    assert serving["cuda_graphs"].startswith(("not available", "not measured", "measured"))
    assert serving["checkpoint"]["bytes"] > 0 and 4 < serving["expected_tau"] < 6
    measured = [r for r in serving["rows"] if r["kind"] != "warmup"]
    assert [p["name"] for p in serving["passes"]] == ["fp32", "bf16"]
    assert [p["strict"] for p in serving["passes"]] == [True, False]
    for p in serving["passes"]:
        got = sorted((r["context"], r["kind"]) for r in measured if r["mode"] == p["name"])
        assert got == sorted((c, k) for c in p["contexts"] for k in ("ar", "ddtree")), (p, got)
    for r in measured:
        assert ROW_KEYS <= set(r) and r["identical"] and r["tokens"] == serving["plan"]["new_tokens"]
        assert r["prompt_tokens"] == r["context"]
    assert serving["mismatches"] == serving["divergences"] == serving["low_acceptance"] == serving["skipped"] == 0
    ddtree = [r for r in measured if r["kind"] == "ddtree"]
    assert all(r["tau"] > 1 and r["draft_ms"] > 0 and r["transport_ms"] > 0 for r in ddtree), ddtree
    assert all(r["tau"] == 1 and r["draft_ms"] == 0 for r in measured if r["kind"] == "ar")
    assert "summary" in res.stdout and "OK" in res.stdout


@pytest.mark.slow
def test_dry_run_fails_on_a_spoiled_reference(tmp_path):
    res, data = _dry_run(tmp_path, "--skip-kernels", "--corrupt-reference", "--contexts", "16", "--new-tokens", "6")
    assert res.returncode == 1, res.stdout[-4000:] + res.stderr[-4000:]
    assert not data["ok"] and data["serving"]["mismatches"] >= 1 and data["serving"]["divergences"] >= 1
    dd = {r["mode"]: r for r in data["serving"]["rows"] if r["kind"] == "ddtree"}
    assert not dd["fp32"]["identical"] and dd["fp32"]["strict"] and dd["fp32"]["first_mismatch"] == 5
    assert not dd["bf16"]["identical"] and not dd["bf16"]["strict"]
    assert "MISMATCH" in res.stdout
    # The divergence is diagnosed from the target's own top-2 there: the spoiled reference is the wrong one,
    # so AR's first choice at that position is DDTree's token (a prefix off by one would name another).
    tie = dd["fp32"]["tie"]
    assert tie["top_ids"][0] == tie["ddtree_token"] and not tie["ddtree_took_second"] and tie["gap"] > 0
    assert "ddtree_token" in dd["bf16"]["tie"] and "top-2 gap" in res.stdout


def test_kernel_rows_fail_on_a_spoiled_reference():
    plan = gk.make_plan(dry_run=True)
    measure = lambda fn: fn() or 1e-6  # noqa: E731  (one call, no timing)
    cpu = torch.device("cpu")
    assert gk.latent_write_case(3, plan, cpu, measure, None, corrupt=False)["ok"]
    row = gk.latent_write_case(3, plan, cpu, measure, None, corrupt=True)
    assert not row["ok"] and "within tolerance" in row["detail"]
    assert "MISMATCH" in gk.format_row(row)


def test_compare_and_first_mismatch():
    x = torch.randn(4, 8)
    assert gk.compare("same", x, x.clone()) == (True, "")
    ok, detail = gk.compare("spoiled", x, x.clone(), corrupt=True)
    assert not ok and "spoiled" in detail
    assert not gk.compare("scaled", x, 1.1 * x)[0]
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 9, 3]) == 1
    assert first_mismatch([1, 2, 3], [1, 2]) == 2


def test_expected_accept_length_of_the_oracle_trees():
    assert 4.5 < expected_accept_length(depth=7, budget=16, trials=2000) < 5.1
    assert expected_accept_length(depth=7, budget=1, trials=2000) < 1.6

"""Part (c) of `ddtree selftest gpu` (tools/selftest/step_check.py), its dry run: the Kimi-shaped TP-8
rank measured by `ddtree bench step`'s library with the Triton kernels interpreted, into the JSON."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_step_part_of_the_selftest_dry_run(tmp_path):
    out = tmp_path / "selftest.json"
    res = subprocess.run(
        [sys.executable, "-m", "ddtree.cli", "selftest", "gpu", "--dry-run", "--skip-kernels", "--skip-serving",
         "--skip-invariance", "--skip-lossless", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ok"] and not result["errors"] and "kernels" not in result and "serving" not in result
    step = result["step"]
    assert step["plan"]["emulate_tp"] == 8 and step["skipped"] == 0
    assert [(r["rows"], r["context"]) for r in step["rows"]] == [(1, 16), (3, 16)]
    assert step["config"]["local_heads"] * 8 == step["config"]["heads"]
    for r in step["rows"]:
        assert r["step_ms"]["eager"] > 0 and r["step_ms"]["graphs"] is None and r["graphs_unavailable"]
        assert r["all_reduces_per_step"] == 2 * 2 + 1 and r["triton_launches_per_step"] > 0
        assert r["ops_per_moe_layer"] > 0 and r["host_syncs_per_step"] >= 0
        assert r["eager_ms_row_invariant_off"] > 0  # the same shape, the attention's throughput plan
    assert "step: 2 shapes measured" in res.stdout


def test_a_rank_too_large_for_the_device_is_measured_at_fewer_layers(monkeypatch):
    """Out of device memory while building: the depth is halved until the rank fits (61 -> 30 -> 15)."""
    import contextlib

    import torch

    from ddtree.tools.selftest import step_check
    from ddtree.tools.step_cost import step_measure

    tried = []

    @contextlib.contextmanager
    def fake_bench(spec):
        tried.append(spec.layers)
        if spec.layers == 0 or spec.layers > 15:
            raise torch.OutOfMemoryError("CUDA out of memory")
        yield "bench"

    monkeypatch.setattr(step_measure, "step_bench", fake_bench)
    spec = step_check.ModelSpec(str(step_check.kimi_checkpoint.K26_CONFIG), random_weights=True, device="cpu")
    lines = []
    stack, bench = step_check.open_bench(spec, lines.append)
    with stack:
        assert bench == "bench"
    assert tried == [0, 30, 15] and len(lines) == 2

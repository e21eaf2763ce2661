"""Part (e) of `ddtree selftest gpu` (tools/selftest/drafter_check.py), its dry run: the transport rows say
which path each commit took, and the device tree build equals the host's heap."""

from __future__ import annotations

import torch

from ddtree.tools.selftest.drafter_check import CASES, TREE_BUDGETS, run_drafter_check


def test_the_drafter_part_of_the_selftest_dry_run():
    lines = []
    out = run_drafter_check(True, torch.device("cpu"), lines.append)
    assert not out["errors"] and out["mismatches"] == 0
    paths = {(r["asked"], r["commit"], r["gap_ms"]): r["path"] for r in out["transport"]}
    assert paths == {("shared", *case): "shared" for case in CASES} | {("grpc", *case): "grpc" for case in CASES}
    # the dry run's commits are all under the chunk size (2048 x 128 x 2 bytes = 512 KB): nothing goes ahead
    assert all(r["chunks_ahead"] == 0 for r in out["transport"])
    assert all(r["transport_ms"] > 0 for r in out["transport"])
    assert [r["budget"] for r in out["tree"]] == list(TREE_BUDGETS) and all(r["equal"] for r in out["tree"])
    assert len(lines) == 2 + 2 * len(CASES) + len(TREE_BUDGETS)

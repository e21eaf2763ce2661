"""The lossless part of `ddtree selftest gpu` (tools/selftest/lossless_check.py): its dry run through the CLI (a
shrunk Kimi-shaped checkpoint served on the CPU, every prompt in flight, AR then DDTree, with the verifier's
row invariance on and then off: no prompt diverges, the oracle's trees are followed), and its comparison
and verdict against hand-built runs (a divergence is found at its first token and diagnosed from AR's own
top-2; one with row invariance on fails the check, one with it off is reported)."""

from __future__ import annotations

import json
import subprocess
import sys

from ddtree.tools.selftest.lossless_check import compare, make_lossless_plan, make_prompts, tally
from tests.support import installed_env as env


def test_the_dry_run_serves_every_prompt_with_row_invariance_on_and_off(tmp_path):
    out = tmp_path / "selftest.json"
    cmd = [sys.executable, "-m", "ddtree.cli", "selftest", "gpu", "--dry-run", "--skip-step", "--skip-drafter",
           "--skip-kernels", "--skip-invariance", "--skip-deploy", "--skip-serving", "--out", str(out)]  # fmt: skip
    res = subprocess.run(cmd, cwd=env.ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["ok"] and data["parts"] == {"lossless": "done"} and data["mismatches"] == 0, data
    lossless = data["lossless"]
    plan = lossless["plan"]
    assert [r["row_invariant"] for r in lossless["rows"]] == ["on", "off"]
    for row in lossless["rows"]:
        assert row["prompts"] == plan["prompts"] == 3 and row["tokens"] == 3 * plan["new_tokens"], row
        assert row["diverged"] == 0 and row["divergences"] == [] and row["tau"] > 2, row
        assert row["exit_codes"] == {"verifier": 0, "drafter": 0}, row
        assert 0 <= row["exact_ties"] <= row["near_ties"] <= row["tokens"], row
    assert lossless["mismatches"] == 0 and lossless["divergences_off"] == 0 and lossless["low_acceptance"] == 0
    assert "lossless: prompts diverged from AR with row invariance on 0 (mismatches), off 0" in res.stdout


def _run(tokens: list[int], gaps: list[float] | None = None, top_ids: list[list[int]] | None = None) -> dict:
    return dict(tokens=tokens, gaps=gaps or [1.0] * len(tokens), top_ids=top_ids or [[t, 0] for t in tokens])


def test_compare_finds_the_first_divergence_and_ar_s_top_two_there():
    ar = [_run([5, 6, 7]), _run([3, 4, 9], gaps=[1.0, 0.01, 2.0], top_ids=[[3, 0], [4, 8], [9, 1]]), _run([2, 2])]
    dd = [_run([5, 6, 7]), _run([3, 8, 1]), _run([2])]
    got = compare(ar, dd)
    assert got[0] == dict(prompt=1, at=1, ar_top_ids=[4, 8], ar_gap=0.01, ddtree_token=8, ddtree_took_second=True)
    assert got[1] == dict(prompt=2, at=1)  # DDTree ended early: a divergence with nothing to diagnose
    assert len(got) == 2


def test_a_divergence_fails_the_check_only_with_row_invariance_on():
    row = lambda setting, diverged, tau=4.0: dict(row_invariant=setting, diverged=diverged, low_acceptance=tau < 2)  # noqa: E731
    assert tally([row("on", 0), row("off", 3)]) == dict(mismatches=0, divergences_off=3, low_acceptance=0)
    assert tally([row("on", 2), row("off", 0)])["mismatches"] == 2
    # a setting skipped past the deadline is not measured; a DDTree run at tau 1 that matches tested nothing
    assert tally([row("on", 0, tau=1.0), dict(row_invariant="off", skipped="past the deadline")]) == dict(
        mismatches=0, divergences_off=None, low_acceptance=1
    )


def test_the_prompts_are_distinct_spread_and_inside_the_vocabulary():
    plan = make_lossless_plan(dry_run=False)
    assert (plan.prompts, plan.new_tokens, plan.dtype) == (16, 256, "bfloat16")
    prompts = make_prompts(plan, vocab_size=1000)
    assert len({tuple(p) for p in prompts}) == 16 and all(2 <= t < 1000 for p in prompts for t in p)
    lengths = sorted(map(len, prompts))
    # they cross the MLA split edges (every 256 keys) at different places: lengths on both sides of 512
    assert lengths[0] >= plan.lengths[0] and lengths[-1] <= plan.lengths[1] and lengths[0] < 512 < lengths[-1]

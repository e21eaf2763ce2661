"""`ddtree bench context | twopoint | compare` and `ddtree diagnose` as a user runs them, on the random
default checkpoint with tiny sizes (the numbers mean nothing here; the plumbing is what is checked)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.paths import REPO

pytestmark = pytest.mark.slow


def _ddtree(*args, timeout=120):
    res = subprocess.run(
        [sys.executable, "-m", "ddtree.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def _script(name: str, *args, timeout=300) -> subprocess.CompletedProcess:
    """`python -m scripts.bench.NAME ARGS` from the checkout, output captured (the caller checks the exit code)."""
    return subprocess.run(
        [sys.executable, "-m", f"scripts.bench.{name}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def _dirs(ckpt):
    return ["--model", str(ckpt.target), "--drafter", str(ckpt.drafter)]


def test_bench_context(default_ckpt, tmp_path):
    try:
        import matplotlib  # noqa: F401  (the `bench` extra)

        plot = []
    except ModuleNotFoundError:
        plot = ["--no-plot"]
    out = tmp_path / "ctx.json"
    text = _ddtree(
        "bench",
        "context",
        "--contexts",
        "16,40",
        "--tokens",
        "10",
        "--out",
        str(out),
        "--log-dir",
        str(tmp_path / "logs"),
        *plot,
        *_dirs(default_ckpt),
    )
    assert "avg commit" in text and "speedup" in text
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kind"], r["context"]) for r in rows] == [(k, c) for k in ("padding", "code", "prose") for c in (16, 40)]
    for r in rows:
        assert r["lossless"] and r["tau"] >= 1.0 and r["tok_s"] > 0 and r["ar_tok_s"] > 0 and r["step_ms"] > 0
        assert r["runs"][0]["ddtree"]["prompt_tokens"] == r["context"]
        assert r["runs"][0]["ddtree"]["completion_tokens"] == 10
    assert plot or out.with_suffix(".png").stat().st_size > 10_000


def test_bench_twopoint(default_ckpt, tmp_path):
    out = tmp_path / "tp.json"
    text = _ddtree(
        "bench",
        "twopoint",
        "--contexts",
        "16",
        "--short",
        "4",
        "--long",
        "12",
        "--full",
        "24",
        "--out",
        str(out),
        "--log-dir",
        str(tmp_path / "logs"),
        *_dirs(default_ckpt),
    )
    assert "two-point tok/s" in text
    (row,) = json.loads(out.read_text())["rows"]
    assert row["two_point_tok_s"] > 0 and row["full_tok_s"] > 0
    assert row["runs"]["full"]["completion_tokens"] == 24


def test_bench_compare_with_chain_and_hf(default_ckpt, tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "cmp.json"
    text = _ddtree(
        "bench",
        "compare",
        "--context",
        "24",
        "--tokens",
        "10",
        "--budgets",
        "4,16",
        "--hf",
        "on",
        "--out",
        str(out),
        "--log-dir",
        str(tmp_path / "logs"),
        *_dirs(default_ckpt),
    )
    assert "HF generate" in text
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["AR", "DDTree b=4", "DDTree b=16", "chain", "HF generate"]
    assert rows["AR"]["vs_ar"] == 1.0 and rows["AR"]["max_nodes"] == 0
    assert rows["DDTree b=4"]["max_nodes"] == 4 and rows["DDTree b=16"]["max_nodes"] == 16
    assert rows["chain"]["max_nodes"] == 7  # block size 8: depth 7, width 1
    assert all(rows[m]["lossless"] for m in ("DDTree b=4", "DDTree b=16", "chain"))
    assert rows["HF generate"]["tok_s"] > 0


DIAG_SIZES = (
    "--contexts",
    "16,40",
    "--tokens",
    "10",
    "--drift-context",
    "16",
    "--drift-tokens",
    "40",
    "--head-tokens",
    "10",
)


def test_diagnose_reconciles_a_real_run(default_ckpt, tmp_path):
    """A deployment writing a step-log file; a user's request on it is the observed figure."""
    from ddtree.tools.bench.runner import VerifierEndpoint, private_verifier

    steps = tmp_path / "steps.jsonl"
    with private_verifier(
        str(default_ckpt.target),
        str(default_ckpt.drafter),
        512,
        tmp_path / "deploy",
        verifier_args=("--step-log", str(steps)),
    ) as addr:
        ep = VerifierEndpoint(addr)
        observed = ep.generate(list(range(100, 116)), 12)
        ep.close()
        assert len(steps.read_text().splitlines()) == len(observed.steps)
        out = tmp_path / "diag.json"
        text = _ddtree(
            "diagnose",
            "--verifier",
            addr,
            *DIAG_SIZES,
            "--model",
            str(default_ckpt.target),
            "--observed-tps",
            f"{observed.decode_tok_s:.2f}",
            "--context",
            "16",
            "--output",
            "12",
            "--step-log",
            str(steps),
            "--last",
            "1",
            "--out",
            str(out),
        )
    assert "reconciliation:" in text and "flags:" in text
    report = json.loads(out.read_text())
    assert len(report["flags"]) == 5 and all(f["evidence"] for f in report["flags"])
    assert [r["context"] for r in report["rows"]] == [16, 40]
    assert not report["flags"][1]["checked"]  # window 2048: no context past it
    labels = [r["label"] for r in report["reconciliation"]]
    assert labels[0] == "observed" and labels[1] == f"spec request {observed.steps[0]['request_id']}"


def test_diagnose_window_on_and_off(default_ckpt, tmp_path):
    """A deployment with a 24-token draft window; diagnose starts the window-off control itself. The text is a
    kind of the user's own (--corpus DIR with heldout_notes.txt)."""
    from ddtree.tools.bench.runner import private_verifier

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "heldout_notes.txt").write_text(
        " ".join(f"Note {i}: the meeting moved to room {i % 7} at {9 + i % 8} o'clock." for i in range(200)),
        encoding="utf-8",
    )

    with private_verifier(
        str(default_ckpt.target), str(default_ckpt.drafter), 512, tmp_path / "deploy", drafter_args=("--window", "24")
    ) as addr:
        out = tmp_path / "diag.json"
        text = _ddtree(
            "diagnose",
            "--verifier",
            addr,
            *DIAG_SIZES,
            "--start-window-off",
            "--model",
            str(default_ckpt.target),
            "--drafter-model",
            str(default_ckpt.drafter),
            "--out",
            str(out),
            "--log-dir",
            str(tmp_path / "logs"),
            "--kind",
            "notes",
            "--corpus",
            str(corpus),
        )
    assert "window 24" in text and "profile: notes text" in text
    report = json.loads(out.read_text())
    window = report["flags"][1]
    assert window["checked"] and "context 40" in window["evidence"]  # measured with the window on and off
    assert list(report["tau_window_off"]) == ["40"]


def test_bench_serving_batching_and_prefix(default_ckpt, tmp_path):
    """scripts.bench.bench_serving's batching (solo, burst, sustained) and prefix parts, tiny sizes."""
    out = tmp_path / "serving.json"
    res = _script(
        "bench_serving",
        "--only",
        "prefix,batching",
        "--streams",
        "3",
        "--tokens",
        "12",
        "--rounds",
        "3",
        "--out",
        str(out),
        *_dirs(default_ckpt),
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    results = json.loads(out.read_text())
    b = results["batching"]
    assert b["identical_to_solo"] and b["streams"] == 3 and b["rounds"] == 3
    assert b["single_stream_tok_s"] > 0 and b["sustained_tok_s"] > 0 and b["burst_tok_s"] > 0
    assert b["sustained"]["tau"] >= 1.0 and b["solo"]["tau"] >= 1.0
    p = results["prefix"]
    assert p["same_output"] and p["same_acceptance"] and p["ttft_ratio"] < 1.0  # the second prompt hits the cache
    bad = _script("bench_serving", "--only", "nonsense", timeout=60)
    assert bad.returncode == 2 and "--only takes" in bad.stderr


def test_bench_ab_runs_every_arm_on_every_prompt(default_ckpt, tmp_path):
    """scripts.bench.bench_ab: two arms (whole trees, cost cut), interleaved, lossless, one row each."""
    out = tmp_path / "ab.json"
    res = _script(
        "bench_ab",
        "--kind",
        "padding",
        "--context",
        "48",
        "--prompts",
        "2",
        "--tokens",
        "12",
        "--arm",
        "fixed=--tree-cut fixed",
        "--arm",
        "cost=--tree-cut cost",
        "--out",
        str(out),
        *_dirs(default_ckpt),
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["arm"] for r in report["rows"]] == ["fixed", "cost"]
    assert all(len(report["runs"][arm]) == 2 for arm in ("fixed", "cost"))
    assert all(r["speedup"] > 0 and r["tau"] >= 1.0 for r in report["rows"])
    bad = _script("bench_ab", "--arm", "no-equals-sign", timeout=60)
    assert bad.returncode == 2 and "NAME=FLAGS" in bad.stderr

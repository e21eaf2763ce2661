"""The arithmetic of `ddtree diagnose` (services/telemetry/report.py) on synthetic step records, and the
step-log sink and reader (services/telemetry/step_log.py). Each flag is raised when its condition holds
and not otherwise; without the data to decide it says so (checked=False)."""

from __future__ import annotations

import json

import pytest

from ddtree.telemetry import report
from ddtree.telemetry.report import Flag, ProfilePoint
from ddtree.telemetry.step_log import last_requests, open_step_log, parse_step_records, read_step_records


def rec(rid="r", step=0, ctx=100, accept=2, nodes=16, draft=2.0, verify=5.0, transport=0.5, total=None, fb=1024):
    total = draft + verify + transport if total is None else total
    return {
        "request_id": rid,
        "step": step,
        "context_tokens": ctx,
        "tree_nodes": nodes,
        "accept_length": accept,
        "draft_ms": draft,
        "verify_ms": verify,
        "transport_ms": transport,
        "total_ms": total,
        "feature_bytes": fb,
    }


def generation(rid: str, ctx: int, tokens: int, accept=lambda pos: 2, verify=lambda ctx, pos: 5.0, **kw) -> list[dict]:
    """One request's records: each step commits accept(pos) tokens; context grows by what it commits."""
    out, pos, step = [], 0, 0
    while pos < tokens:
        a = accept(pos)
        out.append(rec(rid, step, ctx + pos, a, verify=verify(ctx + pos, pos), **kw))
        pos += a
        step += 1
    return out


def assert_flag(flag: Flag, raised: bool, checked: bool = True):
    assert (flag.raised, flag.checked) == (raised, checked), flag.line()
    assert flag.evidence and flag.line().startswith("[FLAG]" if raised else ("[ok  ]" if checked else "[n/a ]"))


# ---- summaries ---------------------------------------------------------------------------------------
def test_summarize_keeps_both_factors():
    rs = [rec(accept=3, total=10.0), rec(step=1, accept=1, total=30.0)]
    s = report.summarize(rs)
    assert (s.steps, s.tokens, s.tau, s.step_ms) == (2, 4, 2.0, 20.0)
    assert s.tok_s == pytest.approx(4 / 0.040)
    assert report.summarize([]).steps == 0


def test_output_positions_and_span():
    recs = generation("a", 50, 20, accept=lambda pos: 4)
    assert report.output_positions(recs) == [0, 4, 8, 12, 16]
    assert report.summarize_span(recs, 4, 12).steps == 2


# ---- prediction and reconciliation -------------------------------------------------------------------
FLAT = [ProfilePoint(16, tau=3.0, step_ms=10.0, tok_s=300.0), ProfilePoint(4096, tau=3.0, step_ms=10.0, tok_s=300.0)]


def test_interpolate_and_extrapolate():
    pts = [ProfilePoint(0, 4.0, 10.0, 400.0), ProfilePoint(1000, 2.0, 20.0, 100.0)]
    assert report.interpolate(pts, 500, "tau") == pytest.approx(3.0)
    assert report.interpolate(pts, 500, "step_ms") == pytest.approx(15.0)
    assert report.interpolate(pts, 2000, "tau") == 2.0  # tau stays flat past the profile
    assert report.interpolate(pts, 2000, "step_ms") == pytest.approx(30.0)  # step time keeps its slope
    assert report.interpolate(pts, -5, "step_ms") == 10.0
    assert report.interpolate(pts[:1], 123, "tau") == 4.0


def test_predict_walks_the_generation():
    p = report.predict(FLAT, 100, 300)
    assert (p.tau, p.step_ms, p.steps) == (pytest.approx(3.0), pytest.approx(10.0), pytest.approx(100.0))
    assert p.tok_s == pytest.approx(300.0) and not p.extrapolated
    # AR-like profile whose step time grows linearly 10 -> 20 ms over 0..1000: mean 15 ms over the walk
    ramp = [ProfilePoint(0, 1.0, 10.0, 100.0), ProfilePoint(1000, 1.0, 20.0, 50.0)]
    q = report.predict(ramp, 0, 1000, step_key="step_ms")
    assert q.step_ms == pytest.approx(15.0, rel=1e-3) and q.tok_s == pytest.approx(1e3 / 15, rel=1e-3)
    assert report.predict(ramp, 900, 500).extrapolated
    with pytest.raises(ValueError):
        report.predict(FLAT, 0, 0)


def test_reconcile_within_and_outside_tolerance():
    pred = report.predict(FLAT, 100, 300)  # 300 tok/s
    ok = report.reconcile(270.0, pred)
    assert ok.within and "reconciled" in ok.explain()
    bad = report.reconcile(200.0, pred)
    assert not bad.within and "NOT within" in bad.explain()
    assert bad.implied_step_ms == pytest.approx(15.0) and bad.implied_tau == pytest.approx(2.0)


def test_reconcile_requests_from_records():
    pts = [ProfilePoint(0, 2.0, 10.0, 180.0), ProfilePoint(1000, 2.0, 10.0, 180.0)]
    reqs = {"a": generation("a", 100, 60, total=10.0), "b": generation("b", 300, 40, total=13.0)}
    rows, total = report.reconcile_requests(pts, reqs)
    by = dict(rows)
    assert by["a"].within and by["a"].ratio == pytest.approx(1.0)
    assert not by["b"].within and by["b"].ratio == pytest.approx(10 / 13)
    assert total.observed_tok_s == pytest.approx(100 / (0.3 + 0.26))
    assert report.reconcile_requests(pts, {}) == ([], None)


def test_two_point_method():
    assert report.two_point_tok_s(50, 1.0, 200, 2.5) == pytest.approx(100.0)
    with pytest.raises(ValueError):
        report.two_point_tok_s(200, 1.0, 50, 2.0)


# ---- flags -------------------------------------------------------------------------------------------
def point(ctx, tok_s, ar_tok_s, tau=3.0):
    return ProfilePoint(ctx, tau, 1e3 * tau / tok_s, tok_s, ar_tok_s)


@pytest.mark.parametrize(
    "points,raised,checked",
    [
        ([point(16, 140, 60), point(5000, 29, 25)], False, True),  # the field case: 1.16x at 5k, barely ahead
        ([point(16, 140, 60), point(5000, 27, 25)], True, True),  # 1.08x at 5k
        ([point(16, 110, 100)], True, True),  # exactly 1.1x counts as not paying
        ([point(16, 140, 60), point(5000, 40, 25)], False, True),  # 1.6x or more everywhere
        ([point(16, 140, 0)], False, False),  # no AR measurement
    ],
)
def test_flag_speculation_not_paying(points, raised, checked):
    assert_flag(report.flag_speculation_not_paying(points), raised, checked)


def test_flag_speculation_not_paying_evidence_names_the_context():
    f = report.flag_speculation_not_paying([point(16, 140, 60), point(5000, 27, 25)])
    assert "context 5000" in f.evidence and "1.08x" in f.evidence


@pytest.mark.parametrize(
    "window,on,off,raised,checked",
    [
        (256, {16: 4.0, 1024: 2.0}, {1024: 3.0}, True, True),  # -33% past the window
        (256, {16: 4.0, 1024: 2.9}, {1024: 3.0}, False, True),  # -3%: noise
        (256, {16: 4.0, 200: 3.0}, {200: 4.0}, False, False),  # nothing measured past the window
        (256, {1024: 2.0}, {}, False, False),  # no window-off run
        (0, {1024: 2.0}, {1024: 3.0}, False, True),  # unlimited window
    ],
)
def test_flag_draft_window(window, on, off, raised, checked):
    assert_flag(report.flag_draft_window(window, on, off), raised, checked)


def two_generations(verify):
    """A: context 100, 200 tokens; B: context 200, 100 tokens. Contexts 200..299 are reached by A late
    (output position >= 100) and by B early (< 100)."""
    return generation("A", 100, 200, accept=lambda p: 1, verify=verify) + generation(
        "B", 200, 100, accept=lambda p: 1, verify=verify
    )


def test_flag_step_drift():
    drifting = two_generations(lambda ctx, pos: 5.0 + 0.02 * pos)  # +2 ms at equal context, late vs early
    assert_flag(report.flag_step_drift(drifting, split_tokens=100), True)
    by_context = two_generations(lambda ctx, pos: 5.0 + 0.01 * ctx)  # grows with context only: no drift
    assert_flag(report.flag_step_drift(by_context, split_tokens=100), False)
    alone = generation("A", 100, 200, accept=lambda p: 1, verify=lambda ctx, pos: 5.0 + 0.02 * pos)
    assert_flag(report.flag_step_drift(alone, split_tokens=100), False, checked=False)


def test_flag_acceptance_decay():
    decaying = generation("a", 500, 1500, accept=lambda pos: 5 if pos < 200 else 3)
    assert_flag(report.flag_acceptance_decay(decaying), True)
    steady = generation("a", 500, 1500, accept=lambda pos: 3)
    assert_flag(report.flag_acceptance_decay(steady), False)
    rising = generation("a", 500, 1500, accept=lambda pos: 2 if pos < 200 else 3)
    assert_flag(report.flag_acceptance_decay(rising), False)
    short = generation("a", 500, 150, accept=lambda pos: 5)
    assert_flag(report.flag_acceptance_decay(short), False, checked=False)


def test_flag_transport():
    assert_flag(report.flag_transport([rec(draft=2.0, verify=3.0, transport=5.0)] * 5), True)
    assert_flag(report.flag_transport([rec(draft=2.0, verify=7.5, transport=0.5)] * 5), False)
    ar_only = [rec(nodes=0, draft=0.0, transport=0.0)] * 5
    assert_flag(report.flag_transport(ar_only), False, checked=False)


# ---- step log ----------------------------------------------------------------------------------------
def test_step_log_file_sink_round_trip(tmp_path):
    path = tmp_path / "steps" / "steps.jsonl"
    log = open_step_log(str(path))
    for i in range(3):
        log.info("step", request_id=f"r{i % 2}", **{k: v for k, v in rec(step=i).items() if k != "request_id"})
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[0])["event"] == "step" and "timestamp" in json.loads(lines[0])
    records = read_step_records(path)
    assert [r["request_id"] for r in records] == ["r0", "r1", "r0"] and records[2]["step"] == 2
    assert open_step_log("off") is None and open_step_log("") is not None


def test_parse_step_records_skips_other_lines():
    lines = [
        "LISTENING verifier 127.0.0.1:5",
        "{not json",
        json.dumps({"event": "verifier_ready"}),
        json.dumps({**rec("x"), "event": "step", "level": "info"}),
        "",
    ]
    assert parse_step_records(lines) == [rec("x")]


def test_last_requests_by_last_record():
    records = [rec("a"), rec("b"), rec("a", 1), rec("c"), rec("b", 1)]
    assert list(last_requests(records, 2)) == ["c", "b"]
    assert [r["step"] for r in last_requests(records, 3)["a"]] == [0, 1]
    assert last_requests(records, 0) == {}


# ---- bench output helpers ----------------------------------------------------------------------------
def test_plot_without_matplotlib_says_what_to_install(monkeypatch):
    import sys

    from ddtree.tools.bench.output import pyplot

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit, match=r"ddtree-serve\[bench\].*--no-plot"):
        pyplot()


def test_progress_and_table():
    import io

    from ddtree.tools.bench.output import format_table
    from ddtree.training.progress import Progress

    buf = io.StringIO()
    bar = Progress(2, "x", stream=buf, width=4)
    bar.advance("a")
    bar.advance("b")
    assert buf.getvalue().splitlines()[0].startswith("x [##..] 1/2") and "2/2" in buf.getvalue()
    assert format_table(["a", "bb"], [[1, 2.5]]).splitlines() == ["a |   bb", "--+-----", "1 | 2.50"]

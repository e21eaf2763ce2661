"""The GPU check cannot lose its results (tools/selftest/record.py, parts.py): its JSON is on disk after every
row, whole at every moment, and a run killed in the middle of a part keeps the rows that part finished."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from ddtree.tools.selftest import parts
from ddtree.tools.selftest.record import DONE, RUNNING, SKIPPED, Deadline, Record
from tests.support import installed_env as env


def test_the_parts_run_in_the_order_of_value():
    names = [p.name for p in parts.PARTS]
    assert names == ["step", "drafter", "lossless", "kernels", "invariance", "deploy", "serving"]
    assert {p.name: p.budget for p in parts.PARTS if p.budget} == {"step": "step_deadline_s",
                                                                   "lossless": "lossless_budget_s",
                                                                   "serving": "serving_budget_s"}  # fmt: skip


def test_the_record_is_saved_after_every_row_and_says_what_ran(tmp_path):
    path = tmp_path / "out" / "run.json"
    record = Record(path, {"date": "d", "errors": []})
    on_row = record.part("step")
    assert json.loads(path.read_text())["parts"] == {"step": RUNNING}
    partial = {"rows": [], "errors": []}
    for i in range(3):
        partial["rows"].append({"i": i})
        on_row(partial)
        assert json.loads(path.read_text())["step"]["rows"] == [{"i": j} for j in range(i + 1)]
    record.finish("step", partial, 1.5)
    record.skip("serving")
    data = json.loads(path.read_text())
    assert data["parts"] == {"step": DONE, "serving": SKIPPED} and data["step_s"] == 1.5
    assert [p.name for p in tmp_path.joinpath("out").iterdir()] == ["run.json"]  # no temp file left behind


def test_a_deadline_and_a_part_budget():
    assert not Deadline().passed() and Deadline(time.perf_counter() - 1).passed()
    later = Deadline.after(100.0)
    assert later.sooner(1.0).at < later.at and later.sooner(1000.0).at == later.at
    assert 99 < later.left_s() <= 100


def _rows(path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def test_a_run_killed_in_the_middle_of_a_part_keeps_its_finished_rows(tmp_path):
    """The dry run's kernel part (interpreted kernels, a few seconds a row) is SIGKILLed as soon as its first
    rows are on disk: the JSON left is whole, says the part was running, and holds those rows."""
    out = tmp_path / "selftest.json"
    cmd = [sys.executable, "-m", "ddtree.cli", "selftest", "gpu", "--dry-run", "--skip-step", "--skip-drafter",
           "--skip-invariance", "--skip-deploy", "--skip-serving", "--skip-lossless", "--out", str(out)]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=env.ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        limit = time.monotonic() + 300
        while time.monotonic() < limit and proc.poll() is None:
            if _rows(out).get("kernels", {}).get("rows"):
                break
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()[-3000:]
    data = json.loads(out.read_text())  # whole: every save was a rename of a finished file
    assert data["dry_run"] and data["parts"] == {"kernels": RUNNING}
    rows = data["kernels"]["rows"]
    assert rows and all(r["ok"] and r["kernel"] and r["us"] > 0 for r in rows)
    assert len(rows) < 14  # killed in the middle: the part has 14 kernels

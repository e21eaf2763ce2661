"""Step records: where the verifier writes them, and how tools read them back.

The verifier logs one record per sequence and step (`services/verifier/sequence.py:StepRecord` plus
the request id) as a structlog JSON event named `step`. `--step-log` picks the sink:

  ''    (default) the service log on stderr, at level info, so `--log-level warning` hides them;
  off   nowhere (the records still stream to the client in GenerateResponse.steps);
  PATH  a JSON-lines file of step records only, appended, line-buffered, whatever --log-level says.

Either way a line is `{"request_id": ..., "step": ..., "context_tokens": ..., ..., "event": "step",
"level": "info", "timestamp": ...}`, so `read_step_records` reads a service log and a step file alike.
A record costs one JSON render and one write (tens of microseconds; README "Measuring").
"""

from __future__ import annotations

import json
import logging
import pathlib
from collections.abc import Iterable

import structlog

from ddtree.contract.step_record import STEP_FIELDS


def open_step_log(spec: str):
    """A logger whose `.info("step", **record)` writes a step record, or None for 'off'."""
    if spec == "off":
        return None
    if not spec:
        return structlog.get_logger("ddtree.steps")
    path = pathlib.Path(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    sink = open(path, "a", buffering=1)  # line-buffered: a reader sees every finished step
    return structlog.wrap_logger(
        structlog.WriteLogger(sink),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    )


def parse_step_records(lines: Iterable[str]) -> list[dict]:
    """Step records among log lines, in file order; other lines (other events, text) are skipped."""
    out = []
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict) and event.get("event") == "step" and "request_id" in event:
            out.append({"request_id": event["request_id"], **{k: event.get(k, 0) for k in STEP_FIELDS}})
    return out


def read_step_records(path: str | pathlib.Path) -> list[dict]:
    with open(path, errors="replace") as f:
        return parse_step_records(f)


def last_requests(records: list[dict], n: int) -> dict[str, list[dict]]:
    """The step records of the last `n` requests to appear (by their last record), oldest first."""
    by_id: dict[str, list[dict]] = {}
    last: dict[str, int] = {}
    for i, r in enumerate(records):
        by_id.setdefault(r["request_id"], []).append(r)
        last[r["request_id"]] = i
    order = sorted(by_id, key=last.__getitem__)
    return {rid: by_id[rid] for rid in order[-n:]} if n > 0 else {}

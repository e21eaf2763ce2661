"""The GPU check's JSON as it grows: saved after every row of every part, so that a run killed at any point
(the device tool's time limit, `timeout`, a crash) leaves every finished row on disk.

    record = Record(path, result)       # result: the run's dict (provenance, errors, ...)
    on_row = record.part("step")         # result["parts"]["step"] = "running"
    on_row(partial)                      # result["step"] = partial; saved
    record.finish("step", partial, s)    # result["parts"]["step"] = "done"; saved

A save writes `<path>.tmp` and renames it over `path` (os.replace, atomic on one file system): a reader,
or a kill in the middle of a write, sees the previous whole JSON or the new one, never half of one.
`Deadline` is the time past which no part starts a new shape, stack or pass (each part checks it before
each); what it skips the part counts in its own "skipped".
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time
from collections.abc import Callable

RUNNING, DONE, SKIPPED = "running", "done", "skipped: past the deadline"


@dataclasses.dataclass(frozen=True)
class Deadline:
    at: float = float("inf")  # time.perf_counter() past which nothing new starts

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.perf_counter() + seconds)

    def passed(self) -> bool:
        return time.perf_counter() > self.at

    def left_s(self) -> float:
        return self.at - time.perf_counter()

    def sooner(self, seconds: float) -> Deadline:
        """This deadline, or `seconds` from now when that comes first (a part's own budget)."""
        return Deadline(min(self.at, time.perf_counter() + seconds))


def save_json(path: pathlib.Path, data: dict) -> None:
    """data as JSON at path, atomically: a temp file beside it, then renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(data, indent=1, default=str))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Record:
    """The run's result dict and where it is saved; every change below is saved at once."""

    def __init__(self, path: pathlib.Path, result: dict):
        self.path = path
        self.result = result
        result.setdefault("parts", {})  # part name -> RUNNING / DONE / SKIPPED / "error", in run order

    def save(self) -> None:
        save_json(self.path, self.result)

    def part(self, name: str) -> Callable[[dict], None]:
        """Mark `name` running (saved); returns on_row(partial), which stores the part's dict so far."""
        self.result["parts"][name] = RUNNING
        self.save()

        def on_row(partial: dict) -> None:
            self.result[name] = partial
            self.save()

        return on_row

    def finish(self, name: str, out: dict | None, seconds: float, state: str = DONE) -> None:
        if out is not None:
            self.result[name] = out
        self.result["parts"][name] = state
        self.result[f"{name}_s"] = seconds
        self.save()

    def skip(self, name: str) -> None:
        self.result["parts"][name] = SKIPPED
        self.save()

"""The one progress bar (training loops, bench and diagnose runs), dependency-free: redrawn in place on a
terminal, otherwise one line per `every` updates (and the last).

    label [####....] step/total field value ... | 1.25 s/step elapsed 0:01:05 eta 0:03:10 note
"""

from __future__ import annotations

import sys
import time


def _hms(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    def __init__(self, total: int, label: str = "", start: int = 0, every: int = 1, stream=None, width: int = 24):
        """total = steps of the whole run (0 = not known yet); start = steps already done before this bar
        (a resumed run: the rate and eta count only this run's steps)."""
        self.total, self.label, self.start, self.step = total, label, start, start
        self.every, self.width = max(every, 1), width
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()
        self._open_line = False  # a redrawn line not ended yet

    def update(self, step: int, note: str = "", eta_s: float | None = None, **fields) -> None:
        """step = steps done so far (1-based). `fields` are shown as "name value" (floats with 4 significant
        digits, anything else as str); eta_s replaces the eta estimated from the rate (e.g. a time limit)."""
        self.step = step
        if not self.tty and step % self.every and step != self.total:
            return
        done = step - self.start
        elapsed = time.perf_counter() - self.t0
        rate = elapsed / done if done else 0.0
        eta = rate * (self.total - step) if eta_s is None else eta_s
        fill = int(self.width * min(step / self.total, 1.0)) if self.total > 0 else 0
        info = " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())
        parts = (
            self.label,
            f"[{'#' * fill}{'.' * (self.width - fill)}]",
            f"{step}/{self.total}",
            info,
            f"| {rate:.2f} s/step elapsed {_hms(elapsed)} eta {_hms(eta)}",
            note,
        )
        line = " ".join(p for p in parts if p)
        if self.tty:
            self.stream.write("\r\x1b[2K" + line)
            self._open_line = self.total <= 0 or step < self.total
            if not self._open_line:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def advance(self, note: str = "", **fields) -> None:
        """One more step done."""
        self.update(self.step + 1, note, **fields)

    def close(self) -> None:
        """End a redrawn line that is still open (a run stopped before its last step)."""
        if self._open_line:
            self.stream.write("\n")
            self.stream.flush()
            self._open_line = False

"""A dependency-free progress bar: redrawn in place on a terminal, one line per `every` steps otherwise."""

from __future__ import annotations

import sys
import time


def _hms(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    def __init__(self, total: int, start: int = 0, every: int = 10, stream=None, width: int = 24):
        self.total, self.start, self.every, self.width = total, start, max(every, 1), width
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()

    def update(self, step: int, **fields) -> None:
        """step = optimizer steps done so far (1-based)."""
        if not self.tty and step % self.every and step != self.total:
            return
        done = step - self.start
        elapsed = time.perf_counter() - self.t0
        rate = elapsed / done if done else 0.0
        frac = step / self.total if self.total else 0.0
        bar = "#" * int(frac * self.width)
        info = " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())
        line = (
            f"step {step}/{self.total} [{bar:<{self.width}}] {info} | {rate:.2f} s/step "
            f"elapsed {_hms(elapsed)} eta {_hms(rate * (self.total - step))}"
        )
        self.stream.write(("\r" + line + "\033[K") if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

"""`ddtree serve` as a process, as the serve tests drive it: its stdout lines collected as they come, each
child's address and pid from what serve prints (and its Prometheus endpoint unless --no-metrics)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

from tests.support.paths import REPO


class Serve:
    """`ddtree serve` as a process; its stdout lines collected as they come."""

    def __init__(self, default_ckpt, tmp_path, *flags: str, metrics: bool = False):
        env = {**os.environ, "DDTREE_HOME": str(default_ckpt.root.parent), "DDTREE_THREADS": "1"}
        prom = [] if metrics else ["--no-metrics"]
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "ddtree.cli", "serve", *prom, "--log-dir", str(tmp_path), *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=REPO, text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.wait_for("serving; Ctrl-C stops", 240)
        self.children = {}  # name -> (gRPC address, pid)
        self.metrics = {}  # name -> its Prometheus URL
        for line in self.lines:
            m = re.match(r"(drafter|verifier|gateway)\s+(\S+)(?:\s+metrics (\S+))?\s+pid (\d+)", line)
            if m:
                self.children[m.group(1)] = (m.group(2), int(m.group(4)))
                if m.group(3):
                    self.metrics[m.group(1)] = m.group(3)

    def _read(self):
        for line in self.popen.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [line for line in self.lines if text in line]
            if found:
                return found[-1]
            if self.popen.poll() is not None and not found:
                time.sleep(0.5)  # the reader may still hold the last lines
                if not any(text in line for line in self.lines):
                    raise AssertionError(f"serve exited ({self.popen.returncode}):\n" + "\n".join(self.lines))
            time.sleep(0.2)
        raise AssertionError(f"no {text!r} within {timeout}s:\n" + "\n".join(self.lines))

    def stop(self):
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(60)
            except subprocess.TimeoutExpired:
                self.popen.kill()

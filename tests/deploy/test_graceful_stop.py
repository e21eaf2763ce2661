"""A service process's graceful stop (protocol/server.py), as `python -m` runs one: SIGTERM logs
`service_stopping` and `service_stopped` (with its drain and engine seconds) and exits 0; a stop that hangs
writes every thread's stack to the log once it is `stuck_after_s` past the drain's grace, naming the frame
it hangs in."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from tests.support import installed_env as env

# A server with no servicers of its own (health and reflection only) whose engine stop takes ENGINE_S.
SERVICE = """
import sys, time
from ddtree.protocol.server import serve_until_stopped, start_server
from ddtree.telemetry.logging import configure_logging

configure_logging("info", "json")

def engine_stop_that_hangs():
    time.sleep(float(sys.argv[1]))

running = start_server("probe", lambda server: [], "127.0.0.1", 0, 1, 0.1, engine_stop_that_hangs)
serve_until_stopped(running, stuck_after_s=1.0)
"""


def _stop(engine_s: float, tmp_path) -> tuple[int, str]:
    log = tmp_path / "probe.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-c", SERVICE, str(engine_s)], cwd=env.ROOT,
                                stdout=subprocess.PIPE, stderr=sink)  # fmt: skip
        assert proc.stdout.readline().startswith(b"LISTENING probe 127.0.0.1:")
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    return rc, log.read_text()


def test_a_stop_is_logged_and_exits_0_without_stacks(tmp_path):
    rc, log = _stop(0.0, tmp_path)
    assert rc == 0, log
    assert '"event": "service_stopping"' in log and '"event": "service_stopped"' in log, log
    assert "engine_stop_that_hangs" not in log and "Thread 0x" not in log, log


def test_a_hung_stop_writes_every_threads_stack_to_the_log(tmp_path):
    rc, log = _stop(4.0, tmp_path)  # the stacks come at 0.1 s grace + 1 s; the stop ends at about 4 s
    assert rc == 0, log
    stacks = log.index("Thread 0x")
    assert "engine_stop_that_hangs" in log[stacks:], log
    assert log.index('"event": "service_stopping"') < stacks < log.index('"event": "service_stopped"'), log

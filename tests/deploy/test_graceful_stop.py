"""A service process's graceful stop (protocol/server.py), as `python -m` runs one: SIGTERM logs
`service_stopping` and `service_stopped` (with its drain and engine seconds) and exits 0; a stop that hangs
writes every thread's stack to the log once it is `stuck_after_s` past the drain's grace, naming the frame
it hangs in. A SIGTERM that the kernel hands to a thread other than the main one stops it too, and a
supervisor that gives up on a stop gets the stacks (SIGUSR1) before it kills."""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys
import time

from ddtree.launcher import ServiceProcess
from tests.support import installed_env as env

# A server with no servicers of its own (health and reflection only) whose engine stop takes ENGINE_S.
SERVICE = """
import signal, sys, threading, time
from ddtree.protocol.server import serve_until_stopped, start_server
from ddtree.telemetry.logging import configure_logging

configure_logging("info", "json")
engine_s, stuck_after_s = float(sys.argv[1]), float(sys.argv[2])

def engine_stop_that_hangs():
    time.sleep(engine_s)

def sigterm_to_this_thread():  # the kernel may give a process's signal to any thread that does not block it
    time.sleep(0.5)
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

running = start_server("probe", lambda server: [], "127.0.0.1", 0, 1, 0.1, engine_stop_that_hangs)
if "--sigterm-off-main" in sys.argv:
    threading.Thread(target=sigterm_to_this_thread, daemon=True).start()
serve_until_stopped(running, stuck_after_s=stuck_after_s)
"""


def _start(tmp_path, engine_s: float, stuck_after_s: float, *flags: str) -> tuple[subprocess.Popen, object]:
    log = tmp_path / "probe.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-c", SERVICE, str(engine_s), str(stuck_after_s), *flags],
                                cwd=env.ROOT, stdout=subprocess.PIPE, stderr=sink)  # fmt: skip
    assert proc.stdout.readline().startswith(b"LISTENING probe 127.0.0.1:")
    _wait_until(lambda: _catches_sigterm(proc.pid), "the probe installed no SIGTERM handler")
    return proc, log


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has a handler for SIGTERM (Linux: the SigCgt mask). LISTENING comes before the
    handler is installed, and a SIGTERM in between ends the process by the default action (-15)."""
    status = pathlib.Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def _wait_until(condition, message: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.05)


def _stop(engine_s: float, tmp_path) -> tuple[int, str]:
    proc, log = _start(tmp_path, engine_s, 1.0)
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


def test_a_sigterm_taken_by_another_thread_still_stops_the_service(tmp_path):
    # Python runs handlers on the main thread only; a main thread parked in a lock wait without a timeout
    # never wakes for a signal another thread took (the CI hang of a verifier that logged no stop at all).
    proc, log = _start(tmp_path, 0.0, 30.0, "--sigterm-off-main")
    try:
        rc = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    text = log.read_text()
    assert rc == 0, text
    assert '"event": "service_stopped"' in text, text


def test_a_supervisor_that_gives_up_gets_the_stacks_before_it_kills(tmp_path):
    proc, log = _start(tmp_path, 60.0, 60.0)  # a stop that hangs past the supervisor's patience
    proc.send_signal(signal.SIGTERM)  # the stop begins (and hangs) before the supervisor's own SIGTERM
    _wait_until(lambda: '"event": "service_stopping"' in log.read_text(), "the probe's stop did not begin")
    service = ServiceProcess("probe", proc, "", log)
    assert service.stop(timeout=1.0) == -signal.SIGKILL
    text = service.log_tail()
    stacks = text.index("Thread 0x")
    assert text.index('"event": "service_stopping"') < stacks, text
    assert "engine_stop_that_hangs" in text[stacks:] and '"event": "service_stopped"' not in text, text

"""Start ddtree services as child processes and find their addresses.

Used by `ddtree serve`, `ddtree generate` (when no gateway is given) and the process-boundary tests.
Each child is `python -m ddtree.cli <service> --port P ...` (P 0 = any free port; `ddtree serve` picks its
ports up front with free_ports, so that `supervise` restarts a child on the same address); it prints
`LISTENING <name> host:port` on stdout once serving, and logs JSON to stderr, which goes to
`<log_dir>/<name>.log`. The first
LISTENING line is the service's gRPC address (`ServiceProcess.address`); a process may announce more
endpoints after it (the gateway's `gateway-http`; `metrics`, each service's Prometheus endpoint when it
has `--metrics-port`), collected in `ServiceProcess.addresses` by name.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time


class ServiceStartError(RuntimeError):
    pass


TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model")
STACK_DUMP_S = 2.0  # what a service that did not stop gets to write its stacks (SIGUSR1) before SIGKILL


def check_checkpoint_dir(path: str, flag: str) -> str:
    """`path` made absolute (the children run in another working directory), once it is a directory with
    config.json and safetensors weights; else ValueError naming the flag, before any child starts."""
    root = pathlib.Path(path).expanduser().resolve()
    if not root.is_dir():
        raise ValueError(f"{flag} {path}: {'not a directory' if root.exists() else 'no such directory'}")
    if not (root / "config.json").is_file():
        raise ValueError(f"{flag} {path}: no config.json (not a checkpoint directory)")
    if not any(root.glob("*.safetensors")) and not (root / "model.safetensors.index.json").is_file():
        raise ValueError(f"{flag} {path}: no weights (no *.safetensors file)")
    return str(root)


def check_tokenizer_dir(path: str, flag: str) -> str:
    """`path` made absolute, once it holds a tokenizer (the gateway's); else ValueError naming the flag."""
    root = pathlib.Path(path).expanduser().resolve()
    if not any((root / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{flag} {path}: no tokenizer ({' or '.join(TOKENIZER_FILES)}); pass --tokenizer DIR")
    return str(root)


@dataclasses.dataclass
class ServiceProcess:
    name: str
    popen: subprocess.Popen
    address: str
    log_path: pathlib.Path
    addresses: dict[str, str] = dataclasses.field(default_factory=dict)  # every LISTENING line, by name
    _announced: threading.Condition = dataclasses.field(default_factory=threading.Condition, repr=False)

    def wait_address(self, name: str, timeout: float = 30.0) -> str:
        """The address announced as `LISTENING <name> ...` (waits for the line, e.g. gateway-http)."""
        with self._announced:
            if not self._announced.wait_for(lambda: name in self.addresses or self.popen.poll() is not None, timeout):
                raise ServiceStartError(f"{self.name} announced no {name!r} endpoint within {timeout:.0f}s")
        if name not in self.addresses:
            raise ServiceStartError(f"{self.name} exited before announcing {name!r}; log: {self.log_path}")
        return self.addresses[name]

    def log_tail(self, chars: int = 16000) -> str:
        """The end of the process's log (its stderr and non-LISTENING stdout), for a failure message."""
        return f"log {self.log_path}:\n" + self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM (graceful), then SIGKILL after `timeout` seconds. Returns the exit code. Before the kill,
        SIGUSR1 asks a service for every thread's stack (protocol/server.py), so its log says where it hung."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.send_signal(signal.SIGUSR1)
                try:
                    self.popen.wait(STACK_DUMP_S)
                except subprocess.TimeoutExpired:
                    pass
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode


def start_service(
    name: str,
    args: list[str],
    log_dir: pathlib.Path,
    env: dict[str, str] | None = None,
    timeout: float = 180.0,
    module: str = "ddtree.cli",
    python: str | None = None,
) -> ServiceProcess:
    """`python -m MODULE ARGS` as a child that announces `LISTENING <name> host:port` (module: the
    `ddtree` command, or a stand-in that speaks the same protocol, such as the tests' oracle drafter;
    python: the interpreter, this one by default, or another install's to run its code)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    log_file = open(log_path, "ab")
    cmd = [python or sys.executable, "-m", module, *args]
    child_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    popen = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=log_file, env=child_env, cwd=pathlib.Path(__file__).resolve().parent.parent
    )
    log_file.close()
    found: dict[str, str] = {}
    addresses: dict[str, str] = {}
    announced = threading.Condition()
    ready = threading.Event()

    def pump():
        # Read the LISTENING lines, and keep draining stdout into the log so the child never blocks.
        with open(log_path, "ab", buffering=0) as sink:
            for line in popen.stdout:
                text = line.decode(errors="replace").strip()
                parts = text.split()
                if len(parts) == 3 and parts[0] == "LISTENING":
                    with announced:
                        addresses.setdefault(parts[1], parts[2])
                        announced.notify_all()
                if text.startswith("LISTENING ") and not ready.is_set():
                    found["address"] = text.split()[-1]
                    ready.set()
                else:
                    sink.write(line)
        with announced:
            announced.notify_all()
        ready.set()

    threading.Thread(target=pump, name=f"{name}-stdout", daemon=True).start()
    deadline = time.monotonic() + timeout
    while not ready.wait(0.2):
        if time.monotonic() > deadline:
            popen.kill()
            raise ServiceStartError(f"{name} did not start within {timeout:.0f}s; log: {log_path}")
    if "address" not in found:
        popen.wait(5)
        tail = log_path.read_text(errors="replace")[-3000:]
        raise ServiceStartError(f"{name} exited with code {popen.returncode} before serving; log {log_path}:\n{tail}")
    return ServiceProcess(name, popen, found["address"], log_path, addresses, announced)


def default_engine_threads(service: str) -> int:
    """Torch threads for an engine process on a machine it shares with the other engine: the verifier
    takes every core, the drafter half. The two take turns within a step (draft, then verify), so the
    verifier's tree forwards, the part that grows with context, get the whole machine. The drafter stays
    at half: a second drafter thread barely pays and, without the engines' short OpenMP spin
    (models/runtime/cpu), spins through the verifier's turn (docs/performance.md has the measurements)."""
    cores = os.cpu_count() or 2
    if service not in ("verifier", "drafter"):
        raise ValueError(f"service must be 'verifier' or 'drafter', got {service!r}")
    return cores if service == "verifier" else max(1, cores // 2)


@dataclasses.dataclass
class Stack:
    """The three services, started in dependency order and stopped in reverse."""

    processes: list[ServiceProcess]

    def get(self, name: str) -> ServiceProcess:
        return next(p for p in self.processes if p.name == name)

    @property
    def gateway(self) -> str:
        return self.get("gateway").address

    @property
    def verifier(self) -> str:
        return self.get("verifier").address

    @property
    def gateway_http(self) -> str:
        """host:port of the gateway's OpenAI-compatible HTTP API."""
        return self.get("gateway").wait_address("gateway-http")

    def metrics_address(self, name: str) -> str:
        """host:port of that service's Prometheus endpoint (GET /metrics; a stack started with metrics=True,
        or with --metrics-port in that service's args)."""
        return self.get(name).wait_address("metrics")

    def stop(self) -> dict[str, int]:
        return {p.name: p.stop() for p in reversed(self.processes)}

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_stack(
    model_dir: str,
    drafter_dir: str | None,
    log_dir: pathlib.Path,
    host: str = "127.0.0.1",
    verifier_args: tuple[str, ...] = (),
    drafter_args: tuple[str, ...] = (),
    gateway_args: tuple[str, ...] = (),
    ports: tuple[int, int, int] = (0, 0, 0),
    drafter_module: str = "ddtree.cli",
    metrics: bool = False,
    metrics_ports: tuple[int, int, int] = (0, 0, 0),
    service_token_file: str = "",
) -> Stack:
    """drafter_dir None = AR only (no drafter process). metrics: every service serves its Prometheus
    metrics (`--metrics-port`, before the service's own args, which may override it) on its port of
    metrics_ports (gateway, verifier, drafter; 0 = a free one); `Stack.metrics_address(name)` is where.
    service_token_file: given to all three (`--service-token-file`), '' = none.

    The drafter and the verifier take turns within a step: unless told otherwise default_engine_threads
    shares the cores between them.
    """
    procs: list[ServiceProcess] = []
    prom = {
        name: ["--metrics-port", str(port)] if metrics else []
        for name, port in zip(("gateway", "verifier", "drafter"), metrics_ports)
    }
    token = ["--service-token-file", service_token_file] if service_token_file else []
    model_dir = str(pathlib.Path(model_dir).resolve())  # the children run in the repository's directory
    drafter_dir = None if drafter_dir is None else str(pathlib.Path(drafter_dir).resolve())
    try:
        verifier_flags = ["--model", model_dir, "--host", host, "--port", str(ports[1])]
        verifier_flags += ["--threads", str(default_engine_threads("verifier")), *token, *prom["verifier"]]
        verifier_flags += verifier_args
        if drafter_dir is not None:
            d = start_service(
                "drafter",
                [
                    "drafter",
                    "--model",
                    drafter_dir,
                    "--target",
                    model_dir,
                    "--host",
                    host,
                    "--port",
                    str(ports[2]),
                    "--threads",
                    str(default_engine_threads("drafter")),
                    *token,
                    *prom["drafter"],
                    *drafter_args,
                ],
                log_dir,
                module=drafter_module,
            )
            procs.append(d)
            verifier_flags += ["--drafter", d.address]
        procs.append(start_service("verifier", ["verifier", *verifier_flags], log_dir))
        procs.append(
            start_service(
                "gateway",
                [
                    "gateway",
                    "--verifier",
                    procs[-1].address,
                    "--tokenizer",
                    model_dir,
                    "--host",
                    host,
                    "--port",
                    str(ports[0]),
                    *token,
                    *prom["gateway"],
                    *gateway_args,
                ],
                log_dir,
            )
        )
    except BaseException:
        for p in reversed(procs):
            p.stop()
        raise
    return Stack(procs)


def write_service_token(directory: pathlib.Path) -> pathlib.Path:
    """A new random service token (256 bits) in `directory`/service-token, readable by this user only:
    what `ddtree serve` gives its children when it is given none."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "service-token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


def free_ports(n: int, host: str = "127.0.0.1") -> tuple[int, ...]:
    """n distinct TCP ports free on `host` now: picked up front, so that a child restarted with the same
    arguments comes back on the same address and the services that dial it reconnect."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return tuple(s.getsockname()[1] for s in socks)
    finally:
        for s in socks:
            s.close()


FIRST_RESTART_DELAY_S = 1.0  # doubled after each restart, up to MAX_RESTART_DELAY_S
MAX_RESTART_DELAY_S = 30.0
STABLE_AFTER_S = 60.0  # a child that served this long before exiting restarts after the first delay again


def restart_service(p: ServiceProcess) -> ServiceProcess:
    """The same child again: same interpreter, module and arguments (so the same ports), same log."""
    python, _, module, *args = p.popen.args
    return start_service(p.name, list(args), p.log_path.parent, module=module, python=python)


def describe(p: ServiceProcess) -> str:
    """`ADDRESS[   metrics http://HOST:PORT/metrics]   pid N`: a service's addresses as serve prints them (the
    metrics endpoint when it has one: waited for, it is announced after the gRPC address)."""
    text, args = p.address, list(p.popen.args)
    port = next((args[i + 1] for i in range(len(args) - 2, -1, -1) if args[i] == "--metrics-port"), "-1")
    if port != "-1":
        try:
            text += f"   metrics http://{p.wait_address('metrics', timeout=10.0)}/metrics"
        except ServiceStartError:
            text += "   metrics (not announced)"
    return f"{text}   pid {p.popen.pid}"


def supervise(stack: Stack, stop: threading.Event, restart: bool = True, log=print) -> int:
    """Watch the stack's children until `stop` is set (then 0). A child that exits is reaped, logged and,
    with `restart`, started again after a backoff (FIRST_RESTART_DELAY_S, doubling to MAX_RESTART_DELAY_S,
    back to the first once it had served STABLE_AFTER_S); without `restart` the first exit returns 1, for
    an outer supervisor to act on."""
    delay = dict.fromkeys((p.name for p in stack.processes), FIRST_RESTART_DELAY_S)
    since = dict.fromkeys((p.name for p in stack.processes), time.monotonic())
    while not stop.wait(0.5):
        for i, p in enumerate(stack.processes):
            code = p.popen.poll()
            if code is None:
                continue
            log(f"{p.name} exited with code {code}; log {p.log_path}")
            if not restart:
                return 1
            if time.monotonic() - since[p.name] >= STABLE_AFTER_S:
                delay[p.name] = FIRST_RESTART_DELAY_S
            log(f"restarting {p.name} in {delay[p.name]:.0f}s on {p.address}")
            if stop.wait(delay[p.name]):
                return 0
            delay[p.name] = min(2 * delay[p.name], MAX_RESTART_DELAY_S)
            since[p.name] = time.monotonic()
            try:
                stack.processes[i] = restart_service(p)
            except ServiceStartError as err:  # still dead: the next pass tries again, later
                log(f"{p.name} did not start: {str(err).splitlines()[0]}")
                continue
            log(f"{p.name} serving again on {describe(stack.processes[i])}")
    return 0

"""What every phase of the fuzz and fault suite shares: settings, the result record, the stack on loopback
(with restarts of its drafter and verifier on their ports), a plain JSON request, threads."""

from __future__ import annotations

import collections
import dataclasses
import http.client
import json
import os
import pathlib
import signal
import socket
import threading
import time

import grpc

from ddtree.launcher import Stack, default_engine_threads, start_service, start_stack
from ddtree.protocol.ddtree.v1 import (
    drafter_pb2,
    drafter_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)

MODEL = "ddtree-demo"
# grpcio's own answer to bytes that do not parse as the request message (no project code runs).
GRPC_DESERIALIZE_ERROR = "Exception deserializing request!"


@dataclasses.dataclass(frozen=True)
class Settings:
    """One form of the suite: the small one CI runs, or --long."""

    name: str
    http_cases: int  # per POST endpoint (GET endpoints get a third)
    grpc_cases: int  # per RPC
    workers: int  # fuzz requests in flight at once
    draft_timeout_s: float  # the verifier's --draft-timeout-s
    stop_s: float  # how long the drafter stays SIGSTOPped
    stop_streams: int  # streams running across the stop
    stream_tokens: int  # tokens of each stream across the drafter stop
    kill_streams: int  # streams running across a drafter or verifier SIGKILL
    kill_tokens: int  # tokens of those (and of the load beside the request-id reuse)
    disconnect_clients: int
    reuse_rounds: int  # back-to-back requests with one request id
    kv_requests: int  # concurrent requests against the small KV pool
    max_string: int  # longest fuzzed string, characters (bodies stay under ~2 MB)


SMALL = Settings("small", 96, 60, 4, 2.0, 5.0, 8, 160, 4, 80, 24, 4, 8, 20_000)
LONG = Settings("long", 1000, 600, 6, 3.0, 10.0, 8, 480, 8, 240, 120, 40, 16, 200_000)


class Report:
    """Status histograms per endpoint / RPC, fault figures, canary runs, failures. Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self.http: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.grpc: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.faults: dict[str, dict] = {}
        self.canary_runs: list[dict] = []
        self.failures: list[dict] = []
        self.phase_seconds: dict[str, float] = {}

    def status(self, kind: str, endpoint: str, status: str) -> None:
        with self._lock:
            (self.http if kind == "http" else self.grpc)[endpoint][status] += 1

    def fail(self, phase: str, message: str, **reproduction) -> None:
        """One failure; the same (phase, message) again only counts, after three reproductions."""
        with self._lock:
            same = next((f for f in self.failures if (f["phase"], f["message"]) == (phase, message)), None)
            if same is None:
                same = {"phase": phase, "message": message, "count": 0, "reproductions": []}
                self.failures.append(same)
            same["count"] += 1
            if len(same["reproductions"]) >= 3:
                return
            same["reproductions"].append(reproduction)
        print(f"  FAIL [{phase}] {message}" + (f"\n    {json.dumps(reproduction)[:1500]}" if reproduction else ""))

    def summary(self, settings: Settings, seed: int) -> dict:
        def table(d):
            return {k: {"requests": sum(c.values()), "statuses": dict(sorted(c.items()))} for k, c in sorted(d.items())}

        identical = [r["identical"] for r in self.canary_runs]
        grpc_codes = collections.Counter()
        for c in self.grpc.values():
            grpc_codes.update(c)
        return {
            "ok": not self.failures,
            "http_5xx": sum(n for c in self.http.values() for k, n in c.items() if k.isdigit() and int(k) >= 500),
            "grpc_unknown": grpc_codes["UNKNOWN"],
            "grpc_internal_from_project": grpc_codes["INTERNAL"],  # grpcio's parse failures are counted apart
            "form": settings.name,
            "seed": seed,
            "settings": dataclasses.asdict(settings),
            "canary": {
                "runs": len(identical),
                "identical": all(identical) and bool(identical),
                "by_phase": self._by_phase(),
            },
            "http": table(self.http),
            "grpc": table(self.grpc),
            "faults": self.faults,
            "phase_seconds": self.phase_seconds,
            "failures": self.failures,
        }

    def _by_phase(self) -> dict:
        out: dict[str, list[int]] = {}
        for r in self.canary_runs:
            n = out.setdefault(r["phase"], [0, 0])
            n[0] += 1
            n[1] += r["identical"]
        return {k: {"runs": a, "identical": b} for k, (a, b) in out.items()}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class FuzzStack:
    """start_stack on fixed loopback ports, so that a killed drafter or verifier comes back at its address."""

    def __init__(self, model: str, drafter: str | None, log_dir: pathlib.Path, verifier_args: tuple[str, ...]):
        self.model, self.drafter_dir, self.log_dir = model, drafter, log_dir
        self.ports = (0, free_port(), free_port() if drafter else 0)
        self.verifier_args = verifier_args
        self.stack: Stack = start_stack(model, drafter, log_dir, verifier_args=verifier_args, ports=self.ports)
        self.http = self.stack.gateway_http
        self.gateway = self.stack.gateway

    @property
    def verifier(self) -> str:
        return self.stack.verifier

    def proc(self, name: str):
        return self.stack.get(name)

    def signal(self, name: str, sig: int) -> None:
        os.kill(self.proc(name).popen.pid, sig)

    def kill(self, name: str) -> None:
        p = self.proc(name).popen
        p.send_signal(signal.SIGKILL)
        p.wait(30)

    def _replace(self, name: str, args: list[str]) -> float:
        t0 = time.monotonic()
        i = next(i for i, p in enumerate(self.stack.processes) if p.name == name)
        self.stack.processes[i] = start_service(name, args, self.log_dir)
        return time.monotonic() - t0

    def restart_drafter(self) -> float:
        """The same command start_stack ran, on the same port (the verifier finds it again by itself)."""
        threads = ["--threads", str(default_engine_threads("drafter"))]
        return self._replace(
            "drafter",
            ["drafter", "--model", self.drafter_dir, "--target", self.model, "--host", "127.0.0.1",
             "--port", str(self.ports[2]), *threads],
        )  # fmt: skip

    def restart_verifier(self) -> float:
        threads = ["--threads", str(default_engine_threads("verifier"))]
        args = ["verifier", "--model", self.model, "--host", "127.0.0.1", "--port", str(self.ports[1]), *threads]
        args += [*self.verifier_args, *(["--drafter", self.proc("drafter").address] if self.drafter_dir else [])]
        return self._replace("verifier", args)

    def verifier_info(self) -> verifier_pb2.VerifierInfo:
        with grpc.insecure_channel(self.verifier) as ch:
            return verifier_pb2_grpc.VerifierStub(ch).GetInfo(verifier_pb2.VerifierInfoRequest(), timeout=10)

    def drafter_info(self) -> drafter_pb2.DrafterInfo:
        with grpc.insecure_channel(self.proc("drafter").address) as ch:
            return drafter_pb2_grpc.DrafterStub(ch).GetInfo(drafter_pb2.DrafterInfoRequest(), timeout=10)

    def health(self) -> int:
        try:
            return http_json(self.http, "GET", "/health", None, timeout=5)[0]
        except OSError:
            return 0

    def wait_health(self, status: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.health() == status:
                return True
            time.sleep(0.2)
        return False

    def wait_idle(self, timeout: float = 30.0) -> tuple[bool, verifier_pb2.VerifierInfo]:
        """Until the verifier runs nothing and holds no KV slot for a request (the finish event comes
        just before the slots are freed)."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.verifier_info()
            if (info.running_requests == 0 and info.kv_used_tokens == 0) or time.monotonic() > deadline:
                return info.running_requests == 0 and info.kv_used_tokens == 0, info
            time.sleep(0.1)

    def stop(self) -> None:
        self.stack.stop()


def http_json(address: str, method: str, path: str, body: dict | None, timeout: float = 60.0) -> tuple[int, dict]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, data, {"content-type": "application/json"} if data else {})
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, {"raw": raw[:2000].decode(errors="replace")}
    finally:
        conn.close()


def run_threads(fns, start_gap_s: float = 0.0) -> list:
    """Run every fn in its own thread; the results in order (an exception is returned as the result)."""
    results: list = [None] * len(fns)

    def one(i, fn):
        try:
            results[i] = fn()
        except Exception as e:  # reported by the caller
            results[i] = e

    threads = [threading.Thread(target=one, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
        time.sleep(start_gap_s)
    for t in threads:
        t.join()
    return results

"""Resident memory of all three services over rounds of mixed traffic (issue 47, point 3).

    nice python -m scripts.bench.soak [--rounds 5] [--requests 400] [--concurrency 8] [--log /tmp/soak.log]
        [--serve-args '--verifier-args "--kv-tokens 8192"'] [--seed 0]

Starts `ddtree serve` (the demo pair by default) and sends `--rounds` rounds of `--requests` requests each
through the gateway's OpenAI HTTP API, `--concurrency` at a time. The mix, the same in every round (seeded):
- short: a completion of 2..8 tokens after a short prompt;
- long: a completion of 4..12 tokens after a prompt of 60..240 words (prefill chunks, the prefix cache);
- streaming: a chat completion streamed as server-sent events, read to [DONE];
- cancelled: a streamed completion of up to 200 tokens whose connection is closed after its first chunks
  (the gateway aborts the verifier's request, the drafter's context is released);
a quarter each, with random sampling settings (greedy, temperature, top-p; seeded) and tree budgets.

After each round, once the verifier reports no running sequence and each service's periodic malloc_trim has
run (telemetry/memory.py), VmRSS of the drafter, verifier and gateway
(/proc/PID/status) is printed and appended to the log, one line per round; the end prints, per service, the
largest change of rounds 2.. against round 1, and whether it is within 5% (the bound in
docs/performance.md). Exit status 1 when a service restarted (its pid changed) or a request failed with a
5xx.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import http.client
import json
import os
import pathlib
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time

from ddtree.telemetry.memory import DEFAULT_TRIM_INTERVAL_S

SERVICES = ("drafter", "verifier", "gateway")
WORDS = (
    "def class import return for while if else the river stone light quiet number value list dict "
    "print range open file read write data model token step tree draft verify accept"
).split()
TOLERANCE = 0.05


def rss_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Serve:
    """`ddtree serve` as a child: its printed pids, HTTP address and verifier metrics address."""

    def __init__(self, log_dir: pathlib.Path, extra: list[str]):
        cmd = [sys.executable, "-m", "ddtree.cli", "serve", "--log-dir", str(log_dir), *extra]
        self.popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.pids: dict[str, int] = {}
        self.metrics: dict[str, str] = {}
        self.http = ""
        deadline = time.monotonic() + 600
        for line in self.popen.stdout:
            m = re.match(r"(drafter|verifier|gateway)\s+(\S+)(?:\s+metrics (\S+))?\s+pid (\d+)", line)
            if m:
                self.pids[m.group(1)] = int(m.group(4))
                self.metrics[m.group(1)] = m.group(3) or ""
            if line.startswith("http "):
                self.http = line.split()[1].removeprefix("http://").removesuffix("/v1")
            if line.startswith("serving;"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("serve did not start")
        if set(self.pids) != set(SERVICES) or not self.http:
            raise RuntimeError(f"serve did not print its services: {self.pids} {self.http!r}")
        threading.Thread(target=lambda: [None for _ in self.popen.stdout], daemon=True).start()  # drain

    def running_sequences(self) -> float:
        url = self.metrics["verifier"]
        host, _, path = url.removeprefix("http://").partition("/")
        conn = http.client.HTTPConnection(host, timeout=30)
        conn.request("GET", "/" + path)
        text = conn.getresponse().read().decode()
        m = re.search(r"^ddtree_running_sequences ([\d.e+]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def stop(self) -> None:
        self.popen.send_signal(signal.SIGINT)
        try:
            self.popen.wait(60)
        except subprocess.TimeoutExpired:
            self.popen.kill()


def make_mix(n: int, seed: int) -> list[dict]:
    """n request specs (kind, path, body), the same for the same seed."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = ("short", "long", "streaming", "cancelled")[i % 4]
        words = rng.randint(60, 240) if kind == "long" else rng.randint(2, 24)
        prompt = " ".join(rng.choice(WORDS) for _ in range(words))
        # seeded: every round sends the same requests and gets the same answers, so what the verifier keeps
        # by design (the prefix cache, up to its bounds) holds the same prefixes after each round
        sampling = rng.choice(
            ({"temperature": 0}, {"temperature": 0.8, "seed": i}, {"temperature": 1.0, "top_p": 0.9, "seed": i})
        )
        extra = {**sampling, "budget": rng.choice((4, 8, 16, 32))}
        if kind == "streaming":
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": rng.randint(4, 12), "stream": True}
            path = "/v1/chat/completions"
        else:
            max_tokens = {"short": rng.randint(2, 8), "long": rng.randint(4, 12), "cancelled": 200}[kind]
            body = {"prompt": prompt, "max_tokens": max_tokens, "stream": kind == "cancelled", "ignore_eos": True}
            path = "/v1/completions"
        out.append({"kind": kind, "path": path, "body": {"model": "ddtree-demo", **body, **extra}})
    return out


def send(address: str, spec: dict) -> int:
    """One request; its HTTP status (a cancelled one reads two chunks, then closes the connection)."""
    host, port = address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    try:
        conn.request("POST", spec["path"], json.dumps(spec["body"]), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if spec["kind"] == "cancelled" and resp.status == 200:
            resp.readline()
            resp.readline()
            conn.sock.close()  # the client goes away mid-stream
            return resp.status
        resp.read()
        return resp.status
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", default="", help="append one line per round here too (default: only stdout)")
    ap.add_argument("--serve-args", default="", help="extra `ddtree serve` flags, one string")
    args = ap.parse_args(argv)

    def note(line: str) -> None:
        print(line, flush=True)
        if args.log:
            with open(args.log, "a") as f:
                f.write(line + "\n")

    serve = Serve(pathlib.Path(tempfile.mkdtemp(prefix="ddtree-soak-")), shlex.split(args.serve_args))
    mix = make_mix(args.requests, args.seed)
    rows: list[dict[str, float]] = []
    errors = 0
    try:
        note(
            f"soak: {args.rounds} rounds x {args.requests} requests, concurrency {args.concurrency}; pids {serve.pids}"
        )
        note("round  seconds  " + "  ".join(f"{s:>10s}" for s in SERVICES) + "   (VmRSS MiB)")
        start = {s: rss_mb(p) for s, p in serve.pids.items()}
        note(f"{'start':>5s}  {0:7.0f}  " + "  ".join(f"{start[s]:10.1f}" for s in SERVICES))
        for r in range(1, args.rounds + 1):
            t0 = time.monotonic()
            with cf.ThreadPoolExecutor(args.concurrency) as pool:
                statuses = list(pool.map(lambda spec: send(serve.http, spec), mix))
            errors += sum(s >= 500 for s in statuses)
            deadline = time.monotonic() + 60
            while serve.running_sequences() > 0 and time.monotonic() < deadline:
                time.sleep(0.5)
            # the last releases and aborts land, and each service's allocator trim (telemetry/memory.py) runs once
            time.sleep(DEFAULT_TRIM_INTERVAL_S + 2.0)
            row = {s: rss_mb(p) for s, p in serve.pids.items()}
            rows.append(row)
            bad = sorted({s for s in statuses if s != 200})
            note(
                f"{r:5d}  {time.monotonic() - t0:7.0f}  "
                + "  ".join(f"{row[s]:10.1f}" for s in SERVICES)
                + (f"   statuses other than 200: {bad}" if bad else "")
            )
        ok = True
        if len(rows) > 1:
            for s in SERVICES:
                change = max(abs(row[s] - rows[0][s]) / rows[0][s] for row in rows[1:])
                ok &= change <= TOLERANCE
                note(
                    f"{s}: largest change after round 1: {100 * change:.1f}% ({'within' if change <= TOLERANCE else 'OVER'} 5%)"
                )
        restarted = [s for s, p in serve.pids.items() if not os.path.exists(f"/proc/{p}")]
        if restarted or errors:
            note(f"FAILED: restarted {restarted}, {errors} responses 5xx")
            return 1
        return 0 if ok else 1
    finally:
        serve.stop()


if __name__ == "__main__":
    sys.exit(main())

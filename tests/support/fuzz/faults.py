"""The fault phases. Each returns its figures (also stored in the report) and reports what broke.

- drafter SIGSTOP: N streams run while the drafter is stopped for `stop_s`; no stream waits more than one
  `--draft-timeout-s` between two chunks, requests that start during the stop are not slowed by more than
  one timeout, and every output is the undisturbed one.
- drafter SIGKILL: streams in flight finish with the same outputs (AR after the loss); the drafter restarts.
- verifier SIGKILL and restart: streams in flight end with UNAVAILABLE / 503 and a correct prefix, requests
  while it is down get the same clear status, and after the restart on the same port answers are identical.
- mass disconnects: clients that drop streams (and requests not yet answered) at every stage leave the
  verifier with nothing running and no KV slot held.
- request-id reuse: one request id, back to back and concurrently: every answer whole and identical.
- KV exhaustion (its own stack, a small `--kv-tokens`): requests beyond the cache queue and complete,
  beyond the queue get 429 / RESOURCE_EXHAUSTED, one that can never fit 400 / INVALID_ARGUMENT.
"""

from __future__ import annotations

import json
import pathlib
import random
import signal
import socket
import threading
import time

import grpc

from ddtree.protocol.ddtree.v1 import gateway_pb2_grpc
from tests.support.fuzz.common import FuzzStack, Report, Settings, http_json, run_threads
from tests.support.fuzz.streams import (
    PROMPTS,
    Canary,
    References,
    StreamResult,
    complete_request,
    completion_body,
    grpc_stream,
    http_stream,
    same_output,
    workload_stream,
)

MARGIN_S = 1.5  # scheduling slack on top of one draft timeout (a step, thread wake-ups, a loaded 2-core box)
PROBE, PROBE_TOKENS = "Hello", 32


def _wait(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def _start_streams(stack: FuzzStack, prompts, tokens: int) -> tuple[list[StreamResult], threading.Thread]:
    """Workload streams in background threads (even: gRPC, odd: HTTP), results filled in live."""
    live = [StreamResult() for _ in prompts]
    fns = [lambda i=i, p=p: workload_stream(stack, i, p, tokens, r=live[i]) for i, p in enumerate(prompts)]
    runner = threading.Thread(target=run_threads, args=(fns,), daemon=True)
    runner.start()
    return live, runner


def _check_outputs(report: Report, phase: str, results: list[StreamResult], refs: list[StreamResult]) -> int:
    """How many results differ from their references; each one is reported."""
    bad = 0
    for i, (r, ref) in enumerate(zip(results, refs)):
        if not same_output(r, ref, over_grpc=i % 2 == 0):
            bad += 1
            report.fail(phase, f"stream {i} ({'gRPC' if i % 2 == 0 else 'HTTP'}) differs from its undisturbed run",
                        status=r.status, error=r.error, got_tokens=len(r.tokens), got_text=r.text[:300],
                        want_tokens=len(ref.tokens), want_text=ref.text[:300])  # fmt: skip
    return bad


def _log_events(stack: FuzzStack, name: str, event: str) -> int:
    return stack.proc(name).log_path.read_text(errors="replace").count(f'"event": "{event}"')


def drafter_stop(stack: FuzzStack, refs: References, report: Report, s: Settings) -> dict:
    phase, timeout = "drafter SIGSTOP", s.draft_timeout_s
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(s.stop_streams)]
    want = refs.get(prompts, s.stream_tokens)
    probe_ref = refs.get([PROBE], PROBE_TOKENS)[0]
    set_aside_before = _log_events(stack, "verifier", "drafter_replica_set_aside")
    live, runner = _start_streams(stack, prompts, s.stream_tokens)
    if not _wait(lambda: all(len(r.times) >= 2 for r in live), 60):
        report.fail(phase, "the streams did not start", statuses=[r.status for r in live])
    probes: dict[str, StreamResult] = {}

    def probe(name: str, delay: float) -> None:
        time.sleep(delay)
        probes[name] = grpc_stream(stack.gateway, "Complete", complete_request(PROBE, PROBE_TOKENS))

    stack.signal("drafter", signal.SIGSTOP)
    t_stop = time.monotonic()
    try:
        # one probe meets the hung Draft call; one starts once the replica has been set aside
        threads = [
            threading.Thread(target=probe, args=(n, d)) for n, d in (("at_stop", 0.1), ("set_aside", timeout + 0.5))
        ]
        for t in threads:
            t.start()
        time.sleep(max(0.0, t_stop + s.stop_s - time.monotonic()))
    finally:
        stack.signal("drafter", signal.SIGCONT)
    t_cont = time.monotonic()
    for t in threads:
        t.join()
    runner.join()
    stall = max(r.max_gap for r in [*live, *probes.values()])
    spanning = sum(r.spans(t_stop + timeout) for r in live)
    figures = {
        "draft_timeout_s": timeout,
        "stop_s": round(t_cont - t_stop, 2),
        "streams": len(live),
        "streams_running_past_first_timeout": spanning,
        "stall_max_s": round(stall, 3),
        "stall_bound_s": timeout + MARGIN_S,
        "per_stream_max_gap_s": [round(r.max_gap, 3) for r in live],
        "start_during_stop": {
            n: {"ttft_s": round(p.ttft, 3), "max_gap_s": round(p.max_gap, 3), "total_s": round(p.total, 3)}
            for n, p in probes.items()
        },
        "replica_set_aside_events": _log_events(stack, "verifier", "drafter_replica_set_aside") - set_aside_before,
    }
    bad = _check_outputs(report, phase, live, want)
    bad += sum(not same_output(p, probe_ref, True) for p in probes.values())
    figures["outputs_identical"] = bad == 0
    if stall > timeout + MARGIN_S:
        report.fail(phase, f"a stream waited {stall:.2f} s between two chunks (draft timeout {timeout} s)", **figures)
    if spanning == 0:
        report.fail(phase, "no stream was still running one draft timeout into the stop: nothing was measured")
    a, b = probes.get("at_stop"), probes.get("set_aside")
    if a and b and a.total > b.total + timeout + MARGIN_S:
        report.fail(phase, f"a request started during the stop took {a.total:.2f} s, one started after the "
                    f"replica was set aside {b.total:.2f} s: slowed by more than one timeout")  # fmt: skip
    return figures


def drafter_kill(stack: FuzzStack, refs: References, report: Report, s: Settings) -> dict:
    phase = "drafter SIGKILL"
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(s.kill_streams)]
    want = refs.get(prompts, s.kill_tokens)
    live, runner = _start_streams(stack, prompts, s.kill_tokens)
    _wait(lambda: all(len(r.times) >= 2 for r in live), 60)
    stack.kill("drafter")
    t_kill = time.monotonic()
    runner.join()
    figures = {
        "streams": len(live),
        "streams_running_at_kill": sum(r.spans(t_kill) for r in live),
        "outputs_identical": _check_outputs(report, phase, live, want) == 0,
        "stall_max_s": round(max(r.max_gap for r in live), 3),
        "drafter_restart_s": round(stack.restart_drafter(), 2),
    }
    return figures


def verifier_kill(stack: FuzzStack, refs: References, canary: Canary, report: Report, s: Settings) -> dict:
    phase = "verifier SIGKILL"
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(s.kill_streams)]
    want = refs.get(prompts, s.kill_tokens)
    live, runner = _start_streams(stack, prompts, s.kill_tokens)
    _wait(lambda: all(len(r.times) >= 2 for r in live), 60)
    stack.kill("verifier")
    runner.join()
    in_flight = []
    for i, (r, ref) in enumerate(zip(live, want)):
        over_grpc = i % 2 == 0
        status = r.status if over_grpc or r.status != "200" else (str(r.error_code) if r.error_code else "200")
        in_flight.append(status)
        prefix = ref.tokens[: len(r.tokens)] == r.tokens if over_grpc else ref.text.startswith(r.text)
        finished = r.status in ("OK", "200") and not r.error and same_output(r, ref, over_grpc)
        if not finished and status not in ("UNAVAILABLE", "503"):
            report.fail(phase, f"stream {i} ended with {status} {r.error!r}, not UNAVAILABLE / 503")
        if not prefix:
            report.fail(phase, f"stream {i} sent tokens that are not its undisturbed output before failing")
    # while it is down: the same clear status for new requests, and /health says so
    down_grpc = grpc_stream(stack.gateway, "Complete", complete_request(PROBE, 8), timeout=20)
    down_http = http_stream(stack.http, "/v1/completions", completion_body(PROBE, 8), timeout=20)
    health_503 = stack.wait_health(503, 15)
    if down_grpc.status != "UNAVAILABLE" or down_http.status != "503" or not health_503:
        report.fail(phase, "a request while the verifier was down got no clear UNAVAILABLE / 503",
                    grpc=[down_grpc.status, down_grpc.error], http=[down_http.status, down_http.error],
                    health_503=health_503)  # fmt: skip
    t0 = time.monotonic()
    start_s = stack.restart_verifier()
    healthy = stack.wait_health(200, 30)
    back_s = time.monotonic() - t0
    if not healthy:
        report.fail(phase, "the gateway did not see the restarted verifier as healthy within 30 s")
    after = [workload_stream(stack, i, p, s.kill_tokens) for i, p in enumerate(prompts[:2])]
    bad = _check_outputs(report, phase, after, want[:2])
    identical = canary.check(stack, f"{phase} (after restart)")
    return {
        "streams": len(live),
        "in_flight_statuses": in_flight,
        "while_down": {"grpc": down_grpc.status, "http": down_http.status, "health_503": health_503},
        "restart_s": round(start_s, 2),
        "healthy_again_s": round(back_s, 2),
        "outputs_identical_after_restart": bad == 0 and identical,
    }


def _raw_http(address: str, body: dict, mode: str, rng: random.Random) -> str:
    """A client that leaves: before the answer, after the first event, or half-way through its body."""
    host, port = address.rsplit(":", 1)
    data = json.dumps(body).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nhost: {address}\r\ncontent-type: application/json\r\n"
    head += f"content-length: {len(data)}\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        if mode == "partial-body":
            sock.sendall(head.encode() + data[: len(data) // 2])
            time.sleep(rng.random() * 0.3)
            return mode
        sock.sendall(head.encode() + data)
        if mode == "first-event":
            seen = b""
            while b"data: " not in seen:
                piece = sock.recv(4096)
                if not piece:
                    break
                seen += piece
        else:
            time.sleep(rng.random() * 0.5)
    return mode


def mass_disconnects(stack: FuzzStack, report: Report, rng: random.Random, s: Settings) -> dict:
    phase = "mass disconnects"
    drafter_before = stack.drafter_info().active_sequences
    http_modes = {  # mode -> (stream, how the client leaves)
        "http-stream-first-event": (True, "first-event"),
        "http-stream-before-answer": (True, "before-answer"),
        "http-whole-before-answer": (False, "before-answer"),
        "http-partial-body": (False, "partial-body"),
    }
    modes = [*http_modes, "grpc-cancel-after-first", "grpc-cancel-at-once", "grpc-deadline"]
    tokens = 1500  # what each would generate if its leaving went unnoticed

    def client(i: int):
        mode, prompt = modes[i % len(modes)], PROMPTS[i % len(PROMPTS)]
        if mode in http_modes:
            stream, how = http_modes[mode]
            return _raw_http(stack.http, {**completion_body(prompt, tokens), "stream": stream}, how, rng)
        if mode == "grpc-cancel-after-first":
            keep = threading.Event()  # cleared: the stream is cancelled after its first chunk
            return grpc_stream(stack.gateway, "Complete", complete_request(prompt, tokens), keep=keep).status
        if mode == "grpc-deadline":
            return grpc_stream(stack.gateway, "Complete", complete_request(prompt, tokens), timeout=0.5).status
        with grpc.insecure_channel(stack.gateway) as ch:
            call = gateway_pb2_grpc.GatewayStub(ch).Complete(complete_request(prompt, tokens), timeout=60)
            time.sleep(rng.random() * 0.3)
            call.cancel()
        return "CANCELLED"

    t0 = time.monotonic()
    outcomes = run_threads([lambda i=i: client(i) for i in range(s.disconnect_clients)], start_gap_s=0.01)
    errors = [repr(o) for o in outcomes if isinstance(o, Exception)]
    idle, info = stack.wait_idle(30)
    drain_s = time.monotonic() - t0
    drafter_ok = _wait(lambda: stack.drafter_info().active_sequences <= drafter_before, 20, 0.2)
    figures = {
        "clients": s.disconnect_clients,
        "modes": modes,
        "client_errors": errors,
        "seconds_until_idle": round(drain_s, 2),
        "verifier_running_requests": info.running_requests,
        "verifier_kv_used_tokens": info.kv_used_tokens,
        "drafter_active_sequences": [drafter_before, stack.drafter_info().active_sequences],
    }
    if not idle:
        report.fail(phase, "the verifier still runs requests or holds KV after every client left", **figures)
    if not drafter_ok:
        report.fail(phase, "the drafter holds more draft contexts than before the disconnects", **figures)
    if errors:
        report.fail(phase, "clients failed in an unexpected way", errors=errors[:5])
    return figures


def request_id_reuse(stack: FuzzStack, refs: References, report: Report, s: Settings) -> dict:
    phase, rid, tokens = "request-id reuse", "fuzz-reused-id", 48
    prompt = PROMPTS[0]
    want = refs.get([prompt], tokens)[0]
    load, runner = _start_streams(stack, PROMPTS[1:3], s.kill_tokens)  # keeps the scheduler busy meanwhile
    back_to_back = [grpc_stream(stack.gateway, "Complete", complete_request(prompt, tokens, rid))
                    for _ in range(s.reuse_rounds)]  # fmt: skip
    together = run_threads([lambda: grpc_stream(stack.gateway, "Complete", complete_request(prompt, tokens, rid))] * 2)
    runner.join()
    seq_bad = [i for i, r in enumerate(back_to_back) if r.status != "OK" or r.tokens != want.tokens]
    conc = [f"{r.status} {r.error}".strip() if r.status != "OK" else ("OK" if r.tokens == want.tokens else "WRONG")
            for r in together]  # fmt: skip
    if seq_bad:
        r = back_to_back[seq_bad[0]]
        report.fail(phase, f"{len(seq_bad)} of {len(back_to_back)} back-to-back reuses came back short or different",
                    first=[r.status, r.error, r.finish_reason, len(r.tokens)])  # fmt: skip
    # The contract (verifier.proto): ids are unique among running requests. A second request with a
    # running request's id is refused with ALREADY_EXISTS naming it; the first is untouched. (When the
    # first has finished before the second arrives, both complete.)
    refused = [c for c in conc if c.startswith("ALREADY_EXISTS") and rid in c]
    if sorted(conc) not in (["OK", "OK"], sorted(["OK", *refused])) or len(refused) > 1:
        report.fail(phase, "two concurrent requests with one request_id: expected OK and ALREADY_EXISTS (or OK twice)",
                    outcomes=conc, request=str(complete_request(prompt, tokens, rid)))  # fmt: skip
    return {"back_to_back": len(back_to_back), "back_to_back_identical": not seq_bad, "concurrent_outcomes": conc}


# Two requests (prompt + 120 + 1 slots) fit at a time, and the batch is two: the verifier admits
# max_batch + max_queue = 4 requests (running + waiting) and refuses the rest.
KV_TOKENS, KV_REQUEST_TOKENS, KV_QUEUE, KV_BATCH = 320, 120, 2, 2


def kv_exhaustion(model: str, log_dir: pathlib.Path, refs_tokens: dict, canary: Canary, report: Report,
                  s: Settings) -> dict:  # fmt: skip
    """refs_tokens: prompt -> the main stack's StreamResult for KV_REQUEST_TOKENS tokens."""
    phase = "KV exhaustion"
    args = (
        "--kv-tokens",
        str(KV_TOKENS),
        "--max-queue",
        str(KV_QUEUE),
        "--max-batch",
        str(KV_BATCH),
        "--max-context",
        "2048",
    )
    stack = FuzzStack(model, None, log_dir, verifier_args=args)
    try:
        canary.check(stack, f"{phase} (before)")
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(s.kv_requests)]
        results = run_threads([lambda i=i, p=p: workload_stream(stack, i, p, KV_REQUEST_TOKENS)
                               for i, p in enumerate(prompts)])  # fmt: skip
        statuses, completed, refused = [], 0, 0
        for i, (r, p) in enumerate(zip(results, prompts)):
            statuses.append(r.status if not isinstance(r, Exception) else repr(r))
            if isinstance(r, Exception):
                report.fail(phase, f"request {i} raised {r!r}")
            elif r.status in ("OK", "200") and not r.error:
                completed += 1
                if not same_output(r, refs_tokens[p], over_grpc=i % 2 == 0):
                    report.fail(phase, f"request {i} completed with a different output", got=r.text[:200])
            elif r.status in ("RESOURCE_EXHAUSTED", "429"):
                refused += 1
            else:
                report.fail(
                    phase, f"request {i} got {r.status} {r.error!r}, not a completion or 429 / RESOURCE_EXHAUSTED"
                )
        never_grpc = grpc_stream(stack.gateway, "Complete", complete_request(PROBE, KV_TOKENS), timeout=30)
        never_http = http_json(stack.http, "POST", "/v1/completions", completion_body(PROBE, KV_TOKENS), timeout=30)
        if never_grpc.status != "INVALID_ARGUMENT" or never_http[0] != 400:
            report.fail(phase, "a request that can never fit the cache did not get INVALID_ARGUMENT / 400",
                        grpc=[never_grpc.status, never_grpc.error], http=never_http)  # fmt: skip
        if refused == 0 or completed < 2:
            report.fail(phase, f"{completed} completed, {refused} refused: the pool and queue limits did not show")
        idle, info = stack.wait_idle(20)
        if not idle:
            report.fail(phase, "KV slots still held after every request ended", kv_used=info.kv_used_tokens)
        identical = canary.check(stack, f"{phase} (after)")
        return {
            "kv_tokens": KV_TOKENS,
            "max_queue": KV_QUEUE,
            "requests": len(prompts),
            "statuses": statuses,
            "completed": completed,
            "refused_429": refused,
            "never_fits": {"grpc": never_grpc.status, "http": never_http[0]},
            "kv_used_after": info.kv_used_tokens,
            "canary_identical": identical,
        }
    finally:
        stack.stop()

"""The fuzz and fault suite of issue 20 ("hardening"): bounded, seeded, loopback only.

    python -m tests.support.fuzz_suite [--long] [--seed N] [--out result.json] [--log-dir DIR]

It starts a real stack (drafter, verifier, gateway as processes, `ddtree.launcher.start_stack`, the default
checkpoint: the shipped demo pair) on 127.0.0.1 and checks, in order:

1. the canary: a fixed greedy chat request, over gRPC (token ids) and HTTP SSE, recorded once; it runs
   again during (in a loop) and after every phase and must be identical every time;
2. HTTP fuzzing of every gateway endpoint (tests/support/fuzz/http_cases.py): no 5xx, every well-formed request
   answered;
3. gRPC fuzzing of every RPC of the gateway, verifier and drafter (tests/support/fuzz/grpc_cases.py): no UNKNOWN,
   no INTERNAL from project code;
4. faults (tests/support/fuzz/faults.py): drafter SIGSTOP (the longest stall between two chunks is at most one
   `--draft-timeout-s`, plus MARGIN_S), drafter SIGKILL, verifier SIGKILL and restart, mass disconnects,
   request-id reuse, and KV exhaustion on a second stack with a small `--kv-tokens`.

It prints a summary and writes it as JSON (`--out`): per endpoint / RPC the requests and status-code
histogram, per fault its figures, the canary runs, `ok` and the failures (each with the request that caused
it). The small form (default) takes about 1-2 minutes on 2 cores; `--long` runs for several minutes with
more cases and a 10 s drafter stop. Exit code 0 when ok, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import sys
import tempfile
import time
import traceback

from ddtree.default_checkpoint import default_checkpoint
from tests.support.fuzz import faults
from tests.support.fuzz.common import LONG, SMALL, FuzzStack, Report, Settings
from tests.support.fuzz.grpc_cases import check_special_token_escaping, run_grpc_fuzz
from tests.support.fuzz.http_cases import run_http_fuzz
from tests.support.fuzz.streams import PROMPTS, Canary, CanaryLoop, References


def phase(report: Report, name: str, fn, *args):
    """Run one phase; a crash is a failure of that phase, not the end of the suite."""
    print(f"== {name}", flush=True)
    t0 = time.monotonic()
    try:
        figures = fn(*args)
        if isinstance(figures, dict):
            report.faults[name] = figures
        return figures
    except Exception as e:
        report.fail(name, f"the phase crashed: {type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
        return None
    finally:
        report.phase_seconds[name] = round(time.monotonic() - t0, 1)
        print(f"   {report.phase_seconds[name]} s", flush=True)


def fuzz_http(stack, canary, report, rng, s: Settings) -> None:
    with CanaryLoop(canary, stack, "http fuzz"):
        run_http_fuzz(stack.http, report, rng, s.http_cases, s.workers, s.max_string)
    canary.check(stack, "http fuzz (after)")


def fuzz_grpc(stack, canary, report, rng, s: Settings) -> dict:
    with CanaryLoop(canary, stack, "grpc fuzz"):
        run_grpc_fuzz(stack, report, rng, s.grpc_cases, s.workers, s.max_string)
    canary.check(stack, "grpc fuzz (after)")
    return {"special_tokens_in_chat_messages": check_special_token_escaping(stack, report)}


def with_canary(canary, stack, name, during: bool, fn, *args):
    """A fault phase with the canary in a loop meanwhile (when the stack stays up) and once after."""
    if during:
        with CanaryLoop(canary, stack, name):
            out = fn(*args)
    else:
        out = fn(*args)
    canary.check(stack, f"{name} (after)")
    return out


def run(s: Settings, seed: int, log_dir: pathlib.Path) -> Report:
    report, rng = Report(), random.Random(seed)
    ckpt = default_checkpoint()
    model = str(ckpt.target)
    canary = Canary(report)
    verifier_args = ("--max-batch", "16", "--max-context", "2048", "--draft-timeout-s", str(s.draft_timeout_s))
    print(f"checkpoint {ckpt.root}, logs {log_dir}", flush=True)
    try:
        stack = FuzzStack(model, str(ckpt.drafter), log_dir / "main", verifier_args)
    except Exception as e:
        report.fail("startup", f"the stack did not start: {type(e).__name__}: {e}")
        return report
    kv_refs = {}
    try:
        refs = References(stack)
        phase(report, "baseline", canary.record_baseline, stack)
        if canary.baseline is None:
            return report  # nothing to compare against
        phase(report, "http fuzz", fuzz_http, stack, canary, report, rng, s)
        phase(report, "grpc fuzz", fuzz_grpc, stack, canary, report, rng, s)
        for name, during, fn, args in [
            ("drafter SIGSTOP", True, faults.drafter_stop, (stack, refs, report, s)),
            ("drafter SIGKILL", True, faults.drafter_kill, (stack, refs, report, s)),
            ("verifier SIGKILL", False, faults.verifier_kill, (stack, refs, canary, report, s)),
            ("mass disconnects", False, faults.mass_disconnects, (stack, report, rng, s)),
            ("request-id reuse", True, faults.request_id_reuse, (stack, refs, report, s)),
        ]:
            phase(report, name, with_canary, canary, stack, name, during, fn, *args)
        kv_prompts = list(dict.fromkeys(PROMPTS[i % len(PROMPTS)] for i in range(s.kv_requests)))
        kv_refs = dict(zip(kv_prompts, refs.get(kv_prompts, faults.KV_REQUEST_TOKENS)))
    finally:
        stack.stop()
    if kv_refs:
        phase(report, "KV exhaustion", faults.kv_exhaustion, model, log_dir / "kv", kv_refs, canary, report, s)
    return report


def print_summary(summary: dict) -> None:
    print("\n== summary", "OK" if summary["ok"] else f"FAILED ({len(summary['failures'])} failures)")
    c = summary["canary"]
    print(f"canary: {c['runs']} runs, identical: {c['identical']}")
    print(f"HTTP 5xx: {summary['http_5xx']}, gRPC UNKNOWN: {summary['grpc_unknown']}, "
          f"gRPC INTERNAL from project code: {summary['grpc_internal_from_project']}")  # fmt: skip
    for kind in ("http", "grpc"):
        for name, row in summary[kind].items():
            print(f"  {kind:4} {name:32} {row['requests']:5}  {row['statuses']}")
    for name, figures in summary["faults"].items():
        print(f"  {name}: {json.dumps(figures)[:600]}")
    for f in summary["failures"]:
        print(f"  FAIL [{f['phase']}] {f['message']}" + (f" ({f['count']} times)" if f["count"] > 1 else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.fuzz_suite", description=__doc__.split("\n\n")[0])
    parser.add_argument("--long", action="store_true", help="more cases and a longer drafter stop (minutes)")
    parser.add_argument("--seed", type=int, default=20, help="seed of every mutation (default 20)")
    parser.add_argument("--out", type=pathlib.Path, help="write the JSON summary here")
    parser.add_argument("--log-dir", type=pathlib.Path, help="service logs (default: a new temp dir)")
    args = parser.parse_args(argv)
    s = LONG if args.long else SMALL
    log_dir = args.log_dir or pathlib.Path(tempfile.mkdtemp(prefix="ddtree-fuzz-"))
    t0 = time.monotonic()
    report = run(s, args.seed, log_dir)
    summary = report.summary(s, args.seed)
    summary["seconds"] = round(time.monotonic() - t0, 1)
    summary["logs"] = str(log_dir)
    print_summary(summary)
    print(f"{summary['seconds']} s")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2, default=str))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

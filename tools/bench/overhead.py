"""`ddtree bench overhead`: what a step record and the step metrics cost the verifier, per step.

The verifier's scheduler thread writes one step record per sequence and step (`--step-log`: the
service log, a file, or off) and observes the step metrics (`services/verifier/metrics.py`). This
times exactly those calls in-process, as the scheduler makes them, and prints them as a share of a
step of the given lengths; `--verifier` / a private verifier also measures AR decode speed with step
records on and off, side by side (alternating runs, medians).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import tempfile
import time

from ddtree.telemetry.logging import configure_logging
from ddtree.telemetry.step_log import open_step_log
from ddtree.tools.bench.output import format_table
from ddtree.verifier import metrics

# A step record's fields as the scheduler logs them (services/verifier/sequence.py:StepRecord).
RECORD = dict(
    step=417,
    context_tokens=5123,
    tree_nodes=16,
    accept_length=3,
    draft_ms=4.123,
    verify_ms=61.27,
    transport_ms=0.731,
    total_ms=66.5,
    feature_bytes=43008,
)


def time_per_call(fn, n: int) -> float:
    """Microseconds per call, best of 3 rounds of n calls."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def micro(n: int) -> dict[str, float]:
    fields = RECORD
    phases = {
        "draft": RECORD["draft_ms"],
        "verify": RECORD["verify_ms"],
        "transport": RECORD["transport_ms"],
        "total": RECORD["total_ms"],
    }
    out = {}
    with open(os.devnull, "w") as null, tempfile.TemporaryDirectory() as tmp:
        configure_logging("info", "json", stream=null)
        service_log = open_step_log("")
        out["step record, service log (JSON)"] = time_per_call(
            lambda: service_log.info("step", request_id="0123456789abcdef", **fields), n
        )
        file_log = open_step_log(str(pathlib.Path(tmp) / "steps.jsonl"))
        out["step record, --step-log FILE"] = time_per_call(
            lambda: file_log.info("step", request_id="0123456789abcdef", **fields), n
        )
        configure_logging("warning", "json", stream=null)
        filtered = open_step_log("")
        out["step record, filtered (--log-level warning)"] = time_per_call(
            lambda: filtered.info("step", request_id="0123456789abcdef", **fields), n
        )
    out["step metrics (observe_step)"] = time_per_call(
        lambda: metrics.observe_step(
            phases, RECORD["accept_length"], RECORD["context_tokens"], RECORD["tree_nodes"], RECORD["feature_bytes"]
        ),
        n,
    )
    return out


def run(args) -> int:
    costs = micro(args.calls)
    step_ms = [float(x) for x in args.step_ms.split(",")]
    on = costs["step record, service log (JSON)"] + costs["step metrics (observe_step)"]
    rows = [[name, f"{us:.1f}", *(f"{us / (1e3 * ms):.3%}" for ms in step_ms)] for name, us in costs.items()]
    rows.append(["record + metrics (default)", f"{on:.1f}", *(f"{on / (1e3 * ms):.3%}" for ms in step_ms)])
    print(f"cost per sequence and step, best of 3 x {args.calls} calls, one thread")
    print(format_table(["what", "us", *(f"of a {ms:g} ms step" for ms in step_ms)], rows))
    if args.e2e:
        from ddtree.tools.bench.prompts import make_prompts
        from ddtree.tools.bench.runner import (
            VerifierEndpoint,
            checkpoint_dirs,
            load_tokenizer,
            make_log_dir,
            private_verifier,
        )

        model, drafter = checkpoint_dirs(args)
        ids = make_prompts(load_tokenizer(args), "prose", args.context, 1)[0]
        log_dir = make_log_dir(args)
        rates: dict[str, list[float]] = {"on": [], "off": []}
        with (
            private_verifier(model, drafter, args.context + args.tokens + 8, log_dir, name="-on") as a,
            private_verifier(
                model,
                drafter,
                args.context + args.tokens + 8,
                log_dir,
                verifier_args=("--step-log", "off"),
                name="-off",
            ) as b,
        ):
            eps = {"on": VerifierEndpoint(a), "off": VerifierEndpoint(b)}
            for ep in eps.values():
                ep.generate(ids, 8, no_spec=True)
            for i in range(args.repeats):
                for k in ("on", "off") if i % 2 == 0 else ("off", "on"):  # neither always goes first
                    rates[k].append(eps[k].generate(ids, args.tokens, no_spec=True).decode_tok_s)
        on_s, off_s = statistics.median(rates["on"]), statistics.median(rates["off"])
        paired = sorted(a / b - 1 for a, b in zip(rates["on"], rates["off"]))
        q = statistics.quantiles(paired, n=4) if len(paired) > 1 else [paired[0]] * 3
        print(
            f"\nAR decode, {args.tokens} tokens at context {args.context}, {args.repeats} alternating runs each: "
            f"step records on {on_s:.1f} tok/s, off {off_s:.1f} tok/s; paired on/off - 1: median {q[1]:+.1%}, "
            f"quartiles {q[0]:+.1%} .. {q[2]:+.1%} (metrics on in both)"
        )
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "overhead", help="cost of step records and step metrics per step", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--step-ms", default="5,30,100", help="step times to express the cost against")
    p.add_argument("--e2e", action="store_true", help="also AR decode speed with step records on and off")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", default="", help="target dir for --e2e (default: the embedded default)")
    p.add_argument("--drafter", default="", help="drafter dir for --e2e (default: the embedded default)")
    p.add_argument("--tokenizer", default="")
    p.add_argument("--log-dir", default="")
    p.set_defaults(fn=run)
    return p

"""`ddtree diagnose`: why is it slow? One command against a running deployment (docs/design.md §2).

It measures, on the verifier it is pointed at (greedy, fixed length, --prompts texts per point):
  1. a profile: DDTree and AR at each context: tau, step time (draft / verify / transport), tok/s;
  2. with the drafter's window W > 0 and contexts past it: DDTree tau there again on a verifier whose
     drafter has the same weights and no window (--window-off-verifier, or --start-window-off to start
     one here from --model/--drafter-model). The window is a deployment setting (the verifier trims
     what it sends to the drafter's window), so a second drafter is the clean control: same weights,
     same prompts, only the window differs; a per-request override would touch every step's hot path;
  3. one long generation from --drift-context and a second one that starts halfway through its
     contexts: equal contexts reached early and late in a generation (step drift, acceptance decay).
Then it reconciles an observed speed (--observed-tps with --context / --output, or the last requests'
step records of a --step-log file) with the profile's prediction, and raises flags, each with its
evidence. The arithmetic is services/telemetry/report.py.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import time

import grpc

from ddtree.protocol.ddtree.v1 import drafter_pb2, drafter_pb2_grpc
from ddtree.protocol.server import GRPC_OPTIONS
from ddtree.telemetry import report
from ddtree.telemetry.step_log import last_requests, read_step_records
from ddtree.tools.bench.context import measure_context, parse_ints, profile_point, warm_up
from ddtree.tools.bench.output import format_table, save_json
from ddtree.tools.bench.prompts import make_prompts
from ddtree.tools.bench.runner import VerifierEndpoint, engine_security, load_tokenizer, make_log_dir, private_verifier
from ddtree.training.progress import Progress

PROFILE_HEADERS = [
    "context",
    "tau",
    "step ms",
    "draft",
    "verify",
    "transport",
    "tok/s",
    "AR tok/s",
    "AR step ms",
    "speedup",
]


def drafter_info(address: str):
    """The drafter's GetInfo, or None when it cannot be reached (e.g. an internal address)."""
    if not address:
        return None
    try:
        with engine_security().channel(address, GRPC_OPTIONS) as ch:
            return drafter_pb2_grpc.DrafterStub(ch).GetInfo(drafter_pb2.DrafterInfoRequest(), timeout=5)
    except grpc.RpcError:
        return None


@contextlib.contextmanager
def window_off_endpoint(args, max_context: int):
    if args.window_off_verifier:
        ep = VerifierEndpoint(args.window_off_verifier)
        try:
            yield ep
        finally:
            ep.close()
    elif args.start_window_off:
        from ddtree.tools.bench.runner import checkpoint_dirs

        model, drafter = checkpoint_dirs(argparse.Namespace(model=args.model, drafter=args.drafter_model))
        log_dir = make_log_dir(args)
        print(f"starting a window-off drafter + verifier (logs in {log_dir}) ...", flush=True)
        with private_verifier(model, drafter, max_context, log_dir, ("--window", "0"), name="-window-off") as addr:
            ep = VerifierEndpoint(addr)
            try:
                yield ep
            finally:
                ep.close()
    else:
        yield None


def _split_ar(requests: dict[str, list[dict]]) -> tuple[dict, dict]:
    spec, ar = {}, {}
    for rid, recs in requests.items():
        is_ar = all(int(r["tree_nodes"]) == 0 and float(r["draft_ms"]) == 0 for r in recs)
        (ar if is_ar else spec)[rid] = recs
    return spec, ar


def diagnose(args) -> dict:
    t0 = time.monotonic()
    logged = {}
    if args.step_log:  # read before measuring: our own runs may land in the same log
        logged = last_requests(read_step_records(args.step_log), args.last)
        if not logged:
            raise ValueError(f"no step records in {args.step_log}")
    tok = load_tokenizer(argparse.Namespace(tokenizer=args.tokenizer, model=args.model, drafter=args.drafter_model))
    ep = VerifierEndpoint(args.verifier)
    try:
        info = ep.info
        dinfo = drafter_info(args.drafter or info.drafter_address)
        window = dinfo.window if dinfo is not None else args.window
        window = window if info.spec_enabled else 0  # no drafter: nothing to window
        room = info.max_context - args.tokens - 8
        contexts = sorted(
            {c for c in parse_ints(args.contexts) if c <= room}
            | ({args.context} if args.observed_tps and 0 < args.context <= room else set())
        )
        skipped = [c for c in parse_ints(args.contexts) if c > room]
        drift_tokens = min(args.drift_tokens, info.max_context - args.drift_context - 8)
        window_contexts = [c for c in contexts if window > 0 and c > window]
        # --prompts texts; the prompts of context c are their first c tokens (so contexts differ only in length).
        corpus = pathlib.Path(args.corpus) if args.corpus else None
        longest = max(contexts + [args.drift_context + drift_tokens // 2])
        streams = make_prompts(tok, args.kind, longest, args.prompts, corpus)
        prompts = lambda n: [s[:n] for s in streams]  # noqa: E731
        prompt = lambda n: streams[0][:n]  # noqa: E731  the drift generations use the first text
        print(
            f"diagnose {args.verifier}: model {info.model_id}, max_context {info.max_context}, speculation "
            f"{'on' if info.spec_enabled else 'OFF'}; drafter "
            + (
                f"{dinfo.model_id}, window {dinfo.window or 'unlimited'}, block {dinfo.block_size}, default budget "
                f"{dinfo.default_budget}"
                if dinfo is not None
                else f"not reachable (window taken as {window})"
            ),
            flush=True,
        )
        warm_up(ep, tok, args.budget)
        can_window_off = bool(args.window_off_verifier or args.start_window_off)
        n = args.prompts
        units = 2 * n * len(contexts) + (n * len(window_contexts) if can_window_off else 0) + 2
        progress = Progress(units, "diagnose")
        rows = []
        for c in contexts:
            rows.append(measure_context(ep, prompts(c), args.tokens, args.budget, progress, note=f"context {c}"))
        points = [profile_point(r) for r in rows]
        ar_points = [report.ProfilePoint(r["context"], 1.0, r["ar_record_step_ms"], r["ar_tok_s"]) for r in rows]
        tau_off = {}
        if window_contexts:
            with window_off_endpoint(args, max(window_contexts) + args.tokens + 8) as off:
                for c in window_contexts if off is not None else []:
                    tau_off[c] = measure_context(
                        off, prompts(c), args.tokens, args.budget, progress, ar=False, note=f"window off, context {c}"
                    )["tau"]
        long = ep.generate(prompt(args.drift_context), drift_tokens, budget=args.budget)
        progress.advance("drift: long generation")
        late = ep.generate(prompt(args.drift_context + drift_tokens // 2), drift_tokens // 2, budget=args.budget)
        progress.advance("drift: second generation")
    finally:
        ep.close()

    records = [s for r in rows for s in r["step_records"]] + long.steps + late.steps
    tau_on = {r["context"]: r["tau"] for r in rows}
    flags = [
        report.flag_speculation_not_paying(points, args.min_speedup),
        report.flag_draft_window(window, tau_on, tau_off),
        report.flag_step_drift(
            long.steps + late.steps, split_tokens=drift_tokens // 2, bin_tokens=max(8, drift_tokens // 16)
        ),
        report.flag_acceptance_decay(
            long.steps + [s for r in rows if r["tokens"] > 2 * args.head_tokens for s in r["step_records"]],
            head_tokens=args.head_tokens,
        ),
        report.flag_transport(records),
    ]
    if window_contexts and not tau_off:
        flags[1] = report.Flag(
            flags[1].name,
            False,
            f"contexts {window_contexts} exceed the window {window}, but no "
            f"window-off verifier: pass --window-off-verifier ADDR or "
            f"--start-window-off",
            checked=False,
        )
    elif window > 0 and not window_contexts:
        flags[1] = report.Flag(
            flags[1].name,
            False,
            f"no measured context exceeds the window {window}: add a larger one to --contexts",
            checked=False,
        )
    recon = []
    if args.observed_tps:
        pred = report.predict(points, args.context, args.output)
        recon.append(("observed", report.reconcile(args.observed_tps, pred, args.tolerance)))
    if logged:
        spec, ar = _split_ar(logged)
        for label, reqs, pts in (("spec", spec, points), ("AR", ar, ar_points)):
            per, total = report.reconcile_requests(pts, reqs, args.tolerance) if reqs else ([], None)
            recon += [(f"{label} request {rid}", r) for rid, r in per]
            if total is not None and len(per) > 1:
                recon.append((f"{label} requests, all {len(per)}", total))
    return {
        "verifier": args.verifier,
        "model_id": info.model_id,
        "window": window,
        "rows": rows,
        "skipped_contexts": skipped,
        "tau_window_off": tau_off,
        "flags": flags,
        "reconciliation": recon,
        "drift": {"long": long.to_json(), "second": late.to_json(), "split_tokens": drift_tokens // 2},
        "seconds": time.monotonic() - t0,
    }


def print_report(result: dict, args) -> None:
    rows = result["rows"]
    print(
        f"\nprofile: {args.kind} text, {args.tokens} tokens per generation (greedy, ignore_eos), budget "
        f"{args.budget or 'server default'}; step ms = decode time / steps; draft / verify / transport = "
        f"step-record means"
    )
    print(
        format_table(
            PROFILE_HEADERS,
            [
                [
                    r["context"],
                    f"{r['tau']:.2f}",
                    f"{r['step_ms']:.1f}",
                    f"{r['record_step_ms']['draft']:.1f}",
                    f"{r['record_step_ms']['verify']:.1f}",
                    f"{r['record_step_ms']['transport']:.1f}",
                    f"{r['tok_s']:.1f}",
                    f"{r['ar_tok_s']:.1f}",
                    f"{r['ar_step_ms']:.1f}",
                    f"{r['speedup']:.2f}x",
                ]
                for r in rows
            ],
        )
    )
    if result["skipped_contexts"]:
        print(f"(skipped contexts {result['skipped_contexts']}: past the verifier's max_context)")
    if result["reconciliation"]:
        print("\nreconciliation:")
        for label, r in result["reconciliation"]:
            print(f"  {label}: {r.explain()}")
    print("\nflags:")
    for f in result["flags"]:
        print("  " + f.line())
    print(f"\ntook {result['seconds']:.0f} s")


def _jsonable(result: dict) -> dict:
    out = dict(result)
    out["flags"] = [f.__dict__ for f in result["flags"]]
    out["reconciliation"] = [
        {
            "label": label,
            "observed_tok_s": r.observed_tok_s,
            "predicted": r.predicted.__dict__,
            "ratio": r.ratio,
            "within": r.within,
            "text": r.explain(),
        }
        for label, r in result["reconciliation"]
    ]
    out["rows"] = [{k: v for k, v in r.items() if k != "step_records"} for r in result["rows"]]
    return out


def run(args) -> int:
    if args.observed_tps and not (args.context > 0 and args.output > 0):
        raise ValueError(
            "--observed-tps needs --context and --output (the observed request's prompt and answer lengths in tokens)"
        )
    result = diagnose(args)
    print_report(result, args)
    if args.out:
        save_json(pathlib.Path(args.out), _jsonable(result))
        print(f"saved {args.out}")
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "diagnose",
        help="explain a deployment's speed: tau and step time per context, "
        "reconciliation of an observed speed, flags with evidence",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--verifier", required=True, help="the deployment's verifier HOST:PORT")
    p.add_argument(
        "--drafter", default="", help="its drafter HOST:PORT, for GetInfo (default: the address the verifier reports)"
    )
    p.add_argument("--window", type=int, default=2048, help="the drafter's window when its GetInfo is unreachable")
    p.add_argument(
        "--model",
        default="",
        help="the served target dir: its tokenizer (and the window-off stack's "
        "target); default: checkpoints/demo, else the random default",
    )
    p.add_argument("--tokenizer", default="", help="tokenizer dir (default: --model)")
    p.add_argument("--drafter-model", default="", help="drafter dir for --start-window-off (default: like --model)")
    p.add_argument(
        "--window-off-verifier", default="", help="a verifier whose drafter has the same weights and --window 0"
    )
    p.add_argument(
        "--start-window-off",
        action="store_true",
        help="start that window-off drafter + verifier here, from --model / --drafter-model",
    )
    p.add_argument("--log-dir", default="", help="logs of services started here (default: a temp dir)")
    p.add_argument("--contexts", default="16,1024,2048,4096", help="prompt lengths of the profile")
    p.add_argument("--tokens", type=int, default=256, help="output tokens per profile generation")
    p.add_argument("--prompts", type=int, default=3, help="prompts (texts) per context; tau is pooled over them")
    p.add_argument("--kind", default="prose", help="padding | code | prose (| KIND with --corpus)")
    p.add_argument("--corpus", default="", help="dir with heldout_{kind}.txt (default: the standard library)")
    p.add_argument("--budget", type=int, default=0, help="tree node budget (0 = the verifier's default)")
    p.add_argument("--drift-context", type=int, default=256, help="prompt length of the long generation")
    p.add_argument("--drift-tokens", type=int, default=512, help="tokens of the long generation")
    p.add_argument("--head-tokens", type=int, default=200, help="the head of a generation for acceptance decay")
    p.add_argument("--min-speedup", type=float, default=1.1, help="DDTree / AR at or below this: not paying")
    p.add_argument("--observed-tps", type=float, default=0.0, help="an observed decode speed to reconcile")
    p.add_argument("--context", type=int, default=0, help="its prompt length in tokens")
    p.add_argument("--output", type=int, default=0, help="its answer length in tokens")
    p.add_argument("--step-log", default="", help="a verifier log or --step-log file: reconcile its last requests")
    p.add_argument("--last", type=int, default=3, help="how many of the log's last requests")
    p.add_argument("--tolerance", type=float, default=0.15, help="reconciled when within this fraction")
    p.add_argument("--out", default="runs/diagnose.json", help="JSON report ('' = none)")
    p.set_defaults(fn=run)
    return p

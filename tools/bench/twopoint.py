"""`ddtree bench twopoint`: the two-point method beside the full-generation measure, same prompts.

The two-point method times two generations of one prompt end to end (a stopwatch around each request)
and divides the extra tokens by the extra time: (long - short) / (t_long - t_short). Prefill cancels,
but the rate covers only tokens short..long, the early part of an answer, where acceptance is often
highest and the context shortest (docs/design.md §2). The full measure decodes `--full` tokens and reads
the verifier's clock. Both columns, and tau / step time over tokens short..long vs the whole
generation, show the bias and where it comes from.
"""

from __future__ import annotations

import argparse

from ddtree.telemetry.report import summarize, summarize_span, two_point_tok_s
from ddtree.tools.bench.context import parse_ints, warm_up
from ddtree.tools.bench.output import format_table, save_report
from ddtree.tools.bench.prompts import prompt_grid
from ddtree.tools.bench.runner import add_endpoint_args, load_tokenizer, open_endpoint
from ddtree.training.progress import Progress

HEADERS = [
    "kind",
    "context",
    "two-point tok/s",
    "full tok/s",
    "bias",
    "tau short..long",
    "tau full",
    "step ms short..long",
    "step ms full",
]


def measure(ep, ids: list[int], short: int, long: int, full: int, budget: int, progress: Progress, note: str) -> dict:
    runs = {}
    for name, n in (("short", short), ("long", long), ("full", full)):
        runs[name] = ep.generate(ids, n, budget=budget)
        progress.advance(f"{note} {name}")
    s, lg, f = runs["short"], runs["long"], runs["full"]
    two_point = two_point_tok_s(s.completion_tokens, s.wall_s, lg.completion_tokens, lg.wall_s)
    two_point_server = two_point_tok_s(
        s.completion_tokens, (s.ttft_ms + s.decode_ms) / 1e3, lg.completion_tokens, (lg.ttft_ms + lg.decode_ms) / 1e3
    )
    span, whole = summarize_span(f.steps, short, long), summarize(f.steps)
    return {
        "context": len(ids),
        "short": short,
        "long": long,
        "full": full,
        "budget": budget,
        "two_point_tok_s": two_point,
        "two_point_server_tok_s": two_point_server,
        "full_tok_s": f.decode_tok_s,
        "bias": two_point / f.decode_tok_s - 1 if f.decode_tok_s > 0 else 0.0,
        "tau_span": span.tau,
        "tau_full": whole.tau,
        "step_ms_span": span.step_ms,
        "step_ms_full": whole.step_ms,
        "runs": {k: r.to_json() for k, r in runs.items()},
    }


def run(args) -> int:
    if not 0 < args.short < args.long <= args.full:
        raise ValueError(f"need 0 < --short < --long <= --full, got {args.short}, {args.long}, {args.full}")
    kinds = [k for k in args.kinds.split(",") if k]
    contexts = parse_ints(args.contexts)
    tok = load_tokenizer(args)
    prompts = prompt_grid(tok, kinds, contexts, args.prompts, args.corpus)
    rows = []
    with open_endpoint(args, max(contexts) + args.full + 8, tok) as ep:
        warm_up(ep, tok, args.budget)
        progress = Progress(3 * len(prompts) * args.prompts, "bench twopoint")
        for (kind, context), ps in prompts.items():
            for ids in ps:
                rows.append(
                    {
                        "kind": kind,
                        **measure(
                            ep, ids, args.short, args.long, args.full, args.budget, progress, f"{kind}@{context}"
                        ),
                    }
                )
        where = f"{ep.kind} {ep.address}"
    print(
        f"\ntwo-point ({args.long} - {args.short} tokens, client wall clock) vs full generation ({args.full} tokens, "
        f"verifier clock), DDTree budget {args.budget or 'server default'}, on {where}"
    )
    print(
        format_table(
            HEADERS,
            [
                [
                    r["kind"],
                    r["context"],
                    f"{r['two_point_tok_s']:.1f}",
                    f"{r['full_tok_s']:.1f}",
                    f"{r['bias']:+.0%}",
                    f"{r['tau_span']:.2f}",
                    f"{r['tau_full']:.2f}",
                    f"{r['step_ms_span']:.1f}",
                    f"{r['step_ms_full']:.1f}",
                ]
                for r in rows
            ],
        )
    )
    save_report(args, "bench twopoint", where, rows)
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "twopoint", help="the two-point method beside the full-generation measure", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--kinds", default="prose")
    p.add_argument("--contexts", default="16,1024")
    p.add_argument("--prompts", type=int, default=1)
    p.add_argument("--short", type=int, default=50, help="tokens of the short generation")
    p.add_argument("--long", type=int, default=200, help="tokens of the long generation")
    p.add_argument("--full", type=int, default=1000, help="tokens of the full generation")
    p.add_argument("--budget", type=int, default=0, help="tree node budget (0 = the verifier's default)")
    p.add_argument("--corpus", default="", help="dir with heldout_{kind}.txt (default: the standard library)")
    p.add_argument("--out", default="runs/bench_twopoint.json")
    add_endpoint_args(p)
    p.set_defaults(fn=run)
    return p

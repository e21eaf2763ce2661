"""`ddtree bench context`: decode speed against context length, per kind of text (docs/design.md §2, §8).

The field case's controlled experiment: prompts padded to fixed context lengths, a fixed output
length (ignore_eos, greedy), speed from the verifier's own clock (non-streaming measure), each prompt
decoded AR then DDTree on the same verifier. Per kind and context the table shows decode tok/s, the
average commit (tau, tokens per step), the step time (decode time / steps, so tok/s = tau / step),
AR tok/s and the speedup; JSON keeps every run, a PNG plots the three factors against context.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from ddtree.telemetry.report import ProfilePoint
from ddtree.tools.bench.output import format_table, plot_context, save_report
from ddtree.tools.bench.prompts import make_prompts, prompt_grid
from ddtree.tools.bench.runner import add_endpoint_args, load_tokenizer, open_endpoint
from ddtree.training.progress import Progress

PHASES = {"draft": "draft_ms", "verify": "verify_ms", "transport": "transport_ms", "total": "step_ms"}
HEADERS = ["kind", "context", "tok/s", "avg commit", "step ms", "AR tok/s", "speedup"]


def measure_context(
    ep,
    prompts: list[list[int]],
    tokens: int,
    budget: int,
    progress: Progress | None = None,
    ar: bool = True,
    note: str = "",
) -> dict:
    """AR (optional) then DDTree on each prompt; medians over prompts, tau pooled over all steps."""
    ars, dds, lossless = [], [], True
    for ids in prompts:
        if ar:
            ars.append(ep.generate(ids, tokens, no_spec=True))
            if progress:
                progress.advance(f"{note} AR")
        dds.append(ep.generate(ids, tokens, budget=budget))
        if progress:
            progress.advance(f"{note} DDTree")
        if ar and ars[-1].token_ids != dds[-1].token_ids:
            lossless = False
            print(
                f"WARNING {note}: DDTree output differs from AR (greedy): not lossless on this run",
                file=sys.stderr,
                flush=True,
            )
    steps = sum(len(r.steps) for r in dds)
    row = {
        "context": len(prompts[0]),
        "prompts": len(prompts),
        "tokens": tokens,
        "budget": budget,
        "tok_s": statistics.median(r.decode_tok_s for r in dds),
        "tau": sum(sum(s["accept_length"] for s in r.steps) for r in dds) / steps if steps else 0.0,
        "step_ms": statistics.median(r.wall_step_ms for r in dds),
        "record_step_ms": {k: statistics.median(getattr(r.summary, attr) for r in dds) for k, attr in PHASES.items()},
        "ar_tok_s": statistics.median(r.decode_tok_s for r in ars) if ars else 0.0,
        "ar_step_ms": statistics.median(r.wall_step_ms for r in ars) if ars else 0.0,
        "ar_record_step_ms": statistics.median(r.summary.step_ms for r in ars) if ars else 0.0,
        "lossless": lossless,
        "runs": [
            {"ar": a.to_json() if a else None, "ddtree": d.to_json()} for a, d in zip(ars or [None] * len(dds), dds)
        ],
        "step_records": [s for r in dds for s in r.steps],
    }
    row["speedup"] = row["tok_s"] / row["ar_tok_s"] if row["ar_tok_s"] > 0 else 0.0
    return row


def profile_point(row: dict) -> ProfilePoint:
    return ProfilePoint(
        context=row["context"],
        tau=row["tau"],
        step_ms=row["record_step_ms"]["total"],
        tok_s=row["tok_s"],
        ar_tok_s=row["ar_tok_s"],
    )


def table_row(row: dict) -> list:
    return [
        row["kind"],
        row["context"],
        f"{row['tok_s']:.1f}",
        f"{row['tau']:.2f}",
        f"{row['step_ms']:.1f}",
        f"{row['ar_tok_s']:.1f}",
        f"{row['speedup']:.2f}x",
    ]


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def warm_up(ep, tokenizer, budget: int) -> None:
    ids = make_prompts(tokenizer, "padding", 16, 1)[0]
    ep.generate(ids, 8, no_spec=True)
    ep.generate(ids, 8, budget=budget)


def run(args) -> int:
    kinds = [k for k in args.kinds.split(",") if k]
    contexts = parse_ints(args.contexts)
    tok = load_tokenizer(args)
    prompts = prompt_grid(tok, kinds, contexts, args.prompts, args.corpus)
    rows = []
    with open_endpoint(args, max(contexts) + args.tokens + 8, tok) as ep:
        warm_up(ep, tok, args.budget)
        progress = Progress(2 * len(prompts) * args.prompts, "bench context")
        for (kind, context), ps in prompts.items():
            rows.append(
                {"kind": kind, **measure_context(ep, ps, args.tokens, args.budget, progress, note=f"{kind}@{context}")}
            )
        where = f"{ep.kind} {ep.address}"
    print(
        f"\nDDTree vs AR, {args.tokens} tokens (ignore_eos, greedy), {args.prompts} prompt(s) per cell, "
        f"budget {args.budget or 'server default'}, on {where}; step ms = decode time / steps "
        f"(tok/s = avg commit x 1000 / step ms)"
    )
    print(format_table(HEADERS, [table_row(r) for r in rows]))
    out = save_report(args, "bench context", where, rows)
    if not args.no_plot:
        png = out.with_suffix(".png")
        plot_context(
            rows, png, f"DDTree vs AR by context: {args.tokens} tokens, budget {args.budget or 'default'}, {where}"
        )
        print(f"saved {png}")
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "context",
        help="decode speed, tau and step time against context length, per kind of text; DDTree vs AR",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--kinds", default="padding,code,prose", help="padding | code | prose (| KIND with --corpus)")
    p.add_argument("--contexts", default="16,1024,2048,4096", help="prompt lengths in tokens")
    p.add_argument("--tokens", type=int, default=256, help="output tokens per generation (ignore_eos)")
    p.add_argument("--prompts", type=int, default=1, help="prompts per kind and context")
    p.add_argument("--budget", type=int, default=0, help="tree node budget (0 = the verifier's default)")
    p.add_argument("--corpus", default="", help="dir with heldout_{kind}.txt (default: the standard library)")
    p.add_argument("--out", default="runs/bench_context.json", help="JSON path; the PNG goes beside it")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    add_endpoint_args(p)
    p.set_defaults(fn=run)
    return p

"""DDTree vs AR decode speed and acceptance on held-out text, through the real services.

    python -m scripts.bench.bench_speed --corpus DIR [--model DIR --drafter DIR | --verifier HOST:PORT]
        [--kinds code,prose,chat] [--contexts 512,4096] [--prompts 4] [--tokens 256] [--budget 16]
        [--out runs/bench_speed.json]

For each kind of held-out text and each context length, prompts are the first `context` tokens of
held-out documents (documents are concatenated when one is too short). Every prompt is generated twice
on the same verifier, AR (no_spec) then DDTree, with a fixed output length (ignore_eos), greedy; the
outputs must be identical (lossless), and the script fails loudly if they are not. Decode speed is
measured on the verifier's clock (first token to last token, from the usage record), so client and
network time are excluded; throughput is always shown with its two factors: tokens per step and step
time. Results are printed as a table and saved as JSON (with a sha256 of each row's outputs, to compare
runs of other commits or settings).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import statistics
import tempfile

from ddtree.tokenization.tokenizer import Tokenizer
from ddtree.tools.bench.prompts import make_prompts
from ddtree.tools.bench.runner import VerifierEndpoint, private_verifier

PHASES = {"draft_ms": "draft_ms", "verify_ms": "verify_ms", "transport_ms": "transport_ms", "total_ms": "step_ms"}


def run_one(ep: VerifierEndpoint, ids: list[int], tokens: int, no_spec: bool, budget: int) -> dict:
    r = ep.generate(ids, tokens, no_spec=no_spec, budget=budget)
    s = r.summary
    return {
        "tokens": r.token_ids,
        "steps": s.steps,
        "tau": s.tau,
        "decode_tok_s": r.decode_tok_s,
        "step_ms": {k: getattr(s, a) for k, a in PHASES.items()},
        "ttft_ms": r.ttft_ms,
    }


def bench(
    verifier: str, corpus: pathlib.Path, tok: Tokenizer, kinds, contexts, prompts: int, tokens: int, budget: int
) -> list[dict]:
    rows = []
    ep = VerifierEndpoint(verifier)
    try:
        run_one(ep, make_prompts(tok, kinds[0], 64, 1, corpus)[0], 8, False, budget)  # warm-up
        for kind in kinds:
            for context in contexts:
                ar, dd = [], []
                for ids in make_prompts(tok, kind, context, prompts, corpus):
                    a = run_one(ep, ids, tokens, True, budget)
                    d = run_one(ep, ids, tokens, False, budget)
                    if a["tokens"] != d["tokens"]:
                        raise AssertionError(f"{kind} @ {context}: DDTree output differs from AR")
                    ar.append(a)
                    dd.append(d)
                med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
                row = {
                    "kind": kind,
                    "context": context,
                    "prompts": prompts,
                    "tokens": tokens,
                    "budget": budget,
                    "ar_tok_s": med(ar, "decode_tok_s"),
                    "dd_tok_s": med(dd, "decode_tok_s"),
                    "tau": sum(r["tau"] * r["steps"] for r in dd) / sum(r["steps"] for r in dd),
                    "ar_step_ms": statistics.median(r["step_ms"]["total_ms"] for r in ar),
                    "dd_step_ms": {
                        k: statistics.median(r["step_ms"][k] for r in dd)
                        for k in ("draft_ms", "verify_ms", "transport_ms", "total_ms")
                    },
                    "per_prompt_speedup": [d["decode_tok_s"] / a["decode_tok_s"] for a, d in zip(ar, dd)],
                    # the outputs themselves, to compare runs of other commits or settings
                    "outputs_sha256": hashlib.sha256(json.dumps([r["tokens"] for r in ar]).encode()).hexdigest(),
                }
                row["speedup"] = row["dd_tok_s"] / row["ar_tok_s"]
                rows.append(row)
                print(format_row(row), flush=True)
    finally:
        ep.close()
    return rows


HEADER = "kind   context |  AR tok/s  DDTree tok/s  speedup |  tau  | step ms: AR | DDTree draft/verify/transport/total"


def format_row(r: dict) -> str:
    s = r["dd_step_ms"]
    return (
        f"{r['kind']:6s} {r['context']:7d} | {r['ar_tok_s']:9.1f} {r['dd_tok_s']:13.1f} {r['speedup']:7.2f}x | "
        f"{r['tau']:5.2f} | {r['ar_step_ms']:11.1f} | {s['draft_ms']:.1f}/{s['verify_ms']:.1f}/"
        f"{s['transport_ms']:.1f}/{s['total_ms']:.1f}"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True, type=pathlib.Path)
    p.add_argument("--model", default="", help="target dir (default: the embedded default)")
    p.add_argument("--drafter", default="", help="drafter dir (default: the embedded default)")
    p.add_argument("--verifier", default="", help="use a running verifier instead of starting one")
    p.add_argument("--tokenizer", default="", help="tokenizer dir (default: the target dir)")
    p.add_argument("--kinds", default="code,prose,chat")
    p.add_argument("--contexts", default="512,4096")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--verifier-args", default="", help="extra verifier flags, one string")
    p.add_argument("--drafter-args", default="", help="extra drafter flags, one string (e.g. '--window 256')")
    p.add_argument(
        "--engine-threads",
        type=int,
        default=0,
        help="torch threads of the drafter and the verifier it starts (0 = the launcher's default)",
    )
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/bench_speed.json"))
    args = p.parse_args(argv)
    kinds, contexts = args.kinds.split(","), [int(c) for c in args.contexts.split(",")]
    model, drafter = args.model, args.drafter
    if not model or not drafter:
        from ddtree.default_checkpoint import default_checkpoint

        d = default_checkpoint()
        model, drafter = model or str(d.target), drafter or str(d.drafter)
    tok = Tokenizer(args.tokenizer or model)
    print(HEADER)
    if args.verifier:
        rows = bench(args.verifier, args.corpus, tok, kinds, contexts, args.prompts, args.tokens, args.budget)
    else:
        log_dir = pathlib.Path(tempfile.mkdtemp(prefix="ddtree-bench-"))
        threads = ("--threads", str(args.engine_threads)) if args.engine_threads else ()
        with private_verifier(
            model,
            drafter,
            max(contexts) + args.tokens + 64,
            log_dir,
            drafter_args=threads + tuple(args.drafter_args.split()),
            verifier_args=threads + tuple(args.verifier_args.split()),
        ) as address:
            rows = bench(address, args.corpus, tok, kinds, contexts, args.prompts, args.tokens, args.budget)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "args": {k: str(v) for k, v in vars(args).items()}}, indent=2))
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Tensor-parallel verifier step time: the same prompts at --tp 1 and --tp 2 (docs/design.md §7.5).

    python -m scripts.bench.bench_tp [--model DIR --drafter DIR] [--configs 1x1,1x2,2x1] [--prompts 4]
        [--tokens 64] [--budget 16] [--out runs/bench_tp.json]

A config TPxT is `--tp TP` with T torch threads per rank (so TP·T cores for the verifier). Each config gets
a private drafter + verifier (tools/bench/runner.py); every prompt is generated greedily AR (no_spec) and
with DDTree, fixed length. Reported per config and mode: decode tokens/s on the verifier's clock, mean
step ms and mean verify (target forward) ms from the step records. Outputs must be identical across
configs (TP is lossless) or the script fails.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile

from ddtree.default_checkpoint import default_checkpoint
from ddtree.tokenization.tokenizer import Tokenizer
from ddtree.tools.bench.runner import VerifierEndpoint, private_verifier

PROMPTS = [
    "def fibonacci(n):\n    ",
    "The quick brown fox jumps over the lazy dog. The",
    "import os\nimport sys\n\nclass Config:\n",
    "Once upon a time, in a small village by the sea,",
    "Write a Python function that returns the n-th Fibonacci number, and explain it briefly.",
    "<|im_start|>user\nWhat is a binary search tree?<|im_end|>\n<|im_start|>assistant\n",
]


def measure(address: str, prompts: list[list[int]], tokens: int, budget: int) -> dict:
    ep = VerifierEndpoint(address)
    try:
        ep.generate(prompts[0], 8, budget=budget)  # warm-up
        out = {}
        for mode, no_spec in (("ar", True), ("ddtree", False)):
            runs = [ep.generate(ids, tokens, no_spec=no_spec, budget=budget) for ids in prompts]
            steps = [s for r in runs for s in r.steps]
            out[mode] = {
                "tokens": [r.token_ids for r in runs],
                "decode_tok_s": statistics.mean(r.decode_tok_s for r in runs),
                "step_ms": statistics.mean(s["total_ms"] for s in steps),
                "verify_ms": statistics.mean(s["verify_ms"] for s in steps),
                "tau": sum(s["accept_length"] for s in steps) / len(steps),
            }
        return out
    finally:
        ep.close()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="")
    p.add_argument("--drafter", default="")
    p.add_argument("--configs", default="1x1,1x2,2x1", help="TPxTHREADS per rank, comma-separated")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    d = default_checkpoint()
    model, drafter = args.model or str(d.target), args.drafter or str(d.drafter)
    tok = Tokenizer(model)
    prompts = [tok.encode(t) for t in PROMPTS[: args.prompts]]
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="ddtree-bench-tp-"))
    results = {}
    for cfg in args.configs.split(","):
        tp, threads = (int(x) for x in cfg.split("x"))
        with private_verifier(
            model, drafter, 2048, log_dir, name=f"-{cfg}", verifier_args=("--tp", str(tp), "--threads", str(threads))
        ) as address:
            results[cfg] = measure(address, prompts, args.tokens, args.budget)
    first = next(iter(results.values()))
    for cfg, r in results.items():
        for mode in ("ar", "ddtree"):
            if r[mode]["tokens"] != first["ar"]["tokens"]:
                raise AssertionError(f"{cfg} {mode}: output differs from {next(iter(results))} AR")
    print(f"{'config':8s} {'mode':7s} {'tok/s':>8s} {'step ms':>8s} {'verify ms':>10s} {'tau':>5s}")
    for cfg, r in results.items():
        for mode in ("ar", "ddtree"):
            m = r[mode]
            print(
                f"{cfg:8s} {mode:7s} {m['decode_tok_s']:8.1f} {m['step_ms']:8.2f} {m['verify_ms']:10.2f} "
                f"{m['tau']:5.2f}"
            )
    if args.out:
        summary = {
            cfg: {mode: {k: v for k, v in m.items() if k != "tokens"} for mode, m in r.items()}
            for cfg, r in results.items()
        }
        pathlib.Path(args.out).write_text(
            json.dumps(
                {"prompts": len(prompts), "tokens": args.tokens, "budget": args.budget, "results": summary}, indent=2
            )
        )
    print(f"logs in {log_dir}")


if __name__ == "__main__":
    main()

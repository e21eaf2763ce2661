"""Structured outputs on trees, measured: AR, DDTree with the drafter's tree pruned by the grammar, DDTree with
the tree built from the drafter's top-K table (verifier setting `grammar_tree`: prune | table).

    python -m scripts.bench.bench_grammar [--budgets 8,32] [--max-new 64] [--out runs/bench_grammar.json]

On the demo pair (`ddtree.default_checkpoint.default_checkpoint()`), in one process (scripts/bench/grammar_runs.py:
the pair's DFlash drafter served on a loopback port, the verifier's scheduler with the pair's target in
fp32), the JSON-schema prompts of scripts/bench/grammar_runs.py at temperature 0, one request at a time. Per
setting: tau (tokens committed per verify step, the accept length), tokens/s (generated tokens over the
requests' wall time, prefill included), tree nodes drafted and kept per step, and the grammar's mask
time per step (SequenceGrammar.mask_s: every mask the step computed, the build's and prepare's). Fails
(exit 1) when an output differs from AR's. Prints one line per setting and the JSON it saves.
"""

from __future__ import annotations

import argparse
import json
import sys


def summary(runs) -> dict:
    steps = sum(len(r.accept_lengths) for r in runs)
    tokens = sum(len(r.tokens) for r in runs)
    wall = sum(r.wall_s for r in runs)
    return {
        "tau": round(sum(sum(r.accept_lengths) for r in runs) / max(steps, 1), 4),
        "tokens_per_s": round(tokens / wall, 2) if wall else 0.0,
        "steps": steps,
        "generated_tokens": tokens,
        "wall_s": round(wall, 3),
        "drafted_nodes_per_step": round(sum(r.drafted_nodes for r in runs) / max(steps, 1), 3),
        "kept_nodes_per_step": round(sum(r.kept_nodes for r in runs) / max(steps, 1), 3),
        "masks_per_step": round(sum(r.mask_count for r in runs) / max(steps, 1), 3),
        "mask_ms_per_step": round(sum(r.mask_s for r in runs) * 1e3 / max(steps, 1), 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.bench_grammar", description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", default="8,32", help="comma-separated tree budgets")
    parser.add_argument("--max-new", type=int, default=64, help="max new tokens per request")
    parser.add_argument("--drafter-dtype", default="float32", help="float32 | bfloat16 (auto: the drafter's default)")
    parser.add_argument("--out", default="runs/bench_grammar.json", help="where the JSON is saved ('' = not saved)")
    args = parser.parse_args(argv)

    import torch

    from ddtree.default_checkpoint import default_checkpoint
    from ddtree.telemetry.logging import configure_logging
    from scripts.bench.grammar_runs import REQUESTS, DemoPair, json_grammar

    configure_logging("warning", "console")
    torch.manual_seed(0)
    checkpoint = default_checkpoint()
    requests = [(prompt, json_grammar(schema)) for prompt, schema in REQUESTS]
    pair = DemoPair(checkpoint, drafter_dtype=args.drafter_dtype)
    result = {"checkpoint": str(checkpoint.root), "requests": len(requests), "max_new": args.max_new, "settings": {}}
    same = True
    try:
        pair.run(requests[:1], 8, "table", max_new=4)  # warm-up: kernels, the grammar tokenizer's caches
        ar = pair.run(requests, 0, "ar", args.max_new)
        result["settings"]["ar"] = summary(ar)
        result["outputs"] = [pair.tok.decode(list(r.tokens)) for r in ar]
        print(f"{'ar':>12}: {json.dumps(result['settings']['ar'])}")
        for budget in [int(b) for b in args.budgets.split(",")]:
            for mode in ("prune", "table"):
                runs = pair.run(requests, budget, mode, args.max_new)
                name = f"{mode}_b{budget}"
                result["settings"][name] = summary(runs)
                differs = [i for i, (r, a) in enumerate(zip(runs, ar)) if r.tokens != a.tokens]
                result["settings"][name]["outputs_differ"] = differs
                same = same and not differs
                print(f"{name:>12}: {json.dumps(result['settings'][name])}")
    finally:
        pair.close()
    result["outputs_identical"] = same
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        import pathlib

        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(text + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

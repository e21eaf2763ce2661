"""`ddtree bench compare`: AR vs DDTree over a sweep of budgets vs a chain, and HF `generate`.

All in one run, on the same prompts and machine, so the ratios compare like with like (docs/design.md §8):
AR (the verifier with no_spec), DDTree at each tree budget, a chain (width 1: the drafter's top-1 token
at each depth, as DFlash verifies it) as deep as the drafter's block allows, and, when transformers is
installed and the checkpoint is on this machine, Hugging Face `DeepseekV3ForCausalLM.generate` on the
same checkpoint (greedy, fixed length, decode rate = (N - 1) / (t(N) - t(1)) so prefill cancels).
The private verifier it starts verifies whole trees (`--tree-cut fixed`), so each budget is the tree it
names; a running verifier (--verifier, --gateway) cuts them as it is configured to.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

from ddtree.config import DTYPE_NAMES
from ddtree.tools.bench.context import parse_ints, warm_up
from ddtree.tools.bench.output import format_table, save_report
from ddtree.tools.bench.prompts import make_prompts
from ddtree.tools.bench.runner import add_endpoint_args, checkpoint_dirs, load_tokenizer, open_endpoint
from ddtree.training.progress import Progress

HEADERS = ["mode", "nodes", "tok/s", "avg commit", "step ms", "vs AR"]


def _row(mode: str, runs, ar_tokens: list[list[int]] | None) -> dict:
    steps = sum(len(r.steps) for r in runs)
    row = {
        "mode": mode,
        "tok_s": statistics.median(r.decode_tok_s for r in runs),
        "tau": sum(sum(s["accept_length"] for s in r.steps) for r in runs) / steps if steps else 0.0,
        "step_ms": statistics.median(r.wall_step_ms for r in runs),
        "max_nodes": max((s["tree_nodes"] for r in runs for s in r.steps), default=0),
        "runs": [r.to_json() for r in runs],
    }
    if ar_tokens is not None:
        row["lossless"] = all(r.token_ids == a for r, a in zip(runs, ar_tokens))
        if not row["lossless"]:
            print(f"WARNING {mode}: output differs from AR (greedy)", file=sys.stderr, flush=True)
    return row


def hf_generate(
    model_dir: str, prompts: list[list[int]], tokens: int, device: str, dtype: str, ar_tokens: list[list[int]]
) -> dict:
    """Hugging Face generate on the same checkpoint: decode tok/s with prefill cancelled."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    from ddtree.models.dtypes import TORCH_DTYPES

    model = DeepseekV3ForCausalLM.from_pretrained(model_dir, dtype=TORCH_DTYPES[dtype]).to(device).eval()

    def timed(ids: list[int], n: int):
        x = torch.tensor([ids], device=device)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=0,
            )
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t0, out[0, len(ids) :].tolist()

    timed(prompts[0][:16], 4)  # warm-up
    rates, matches = [], []
    for ids, ar in zip(prompts, ar_tokens):
        t1, _ = timed(ids, 1)
        tn, out = timed(ids, tokens)
        rates.append((tokens - 1) / (tn - t1) if tn > t1 else 0.0)
        matches.append(next((i for i, (a, b) in enumerate(zip(out, ar)) if a != b), min(len(out), len(ar))))
    return {
        "mode": "HF generate",
        "tok_s": statistics.median(rates),
        "tau": 1.0,
        "step_ms": 1e3 / statistics.median(rates) if statistics.median(rates) > 0 else 0.0,
        "max_nodes": 0,
        "device": device,
        "dtype": dtype,
        "tokens_matching_ar": matches,
    }


def _want_hf(args) -> bool:
    if args.hf == "off":
        return False
    try:
        import transformers  # noqa: F401
    except ModuleNotFoundError:
        if args.hf == "on":
            raise SystemExit("--hf on needs transformers: pip install 'ddtree-serve[bench]'") from None
        return False
    # The checkpoint must be on this machine: a private endpoint, or --model named explicitly.
    return args.hf == "on" or bool(args.model) or not (args.verifier or args.gateway)


def run(args) -> int:
    budgets = parse_ints(args.budgets)
    chain_depth = args.chain_depth or max(budgets)
    tok = load_tokenizer(args)
    corpus = pathlib.Path(args.corpus) if args.corpus else None
    prompts = make_prompts(tok, args.kind, args.context, args.prompts, corpus)
    rows = []
    # The budgets compared are the trees verified: a private verifier does not cut them by cost.
    with open_endpoint(args, args.context + args.tokens + 8, tok, ("--tree-cut", "fixed")) as ep:
        warm_up(ep, tok, budgets[0])
        modes = [("AR", dict(no_spec=True))] + [(f"DDTree b={b}", dict(budget=b)) for b in budgets]
        if ep.supports_chain:
            modes.append(("chain", dict(budget=chain_depth, chain=True)))
        progress = Progress(len(modes) * len(prompts), "bench compare")
        ar_tokens = None
        for mode, kw in modes:
            runs = []
            for ids in prompts:
                runs.append(ep.generate(ids, args.tokens, **kw))
                progress.advance(mode)
            rows.append(_row(mode, runs, ar_tokens))
            if mode == "AR":
                ar_tokens = [r.token_ids for r in runs]
        where = f"{ep.kind} {ep.address}"
    if _want_hf(args):
        import torch

        device = args.hf_device or ("cuda" if torch.cuda.is_available() else "cpu")
        print(f"Hugging Face generate on {device} ({args.hf_dtype}) ...", flush=True)
        rows.append(hf_generate(checkpoint_dirs(args)[0], prompts, args.tokens, device, args.hf_dtype, ar_tokens))
    ar = rows[0]["tok_s"]
    for r in rows:
        r["vs_ar"] = r["tok_s"] / ar if ar > 0 else 0.0
    print(
        f"\n{args.kind} prompt(s) of {args.context} tokens, {args.tokens} tokens (ignore_eos, greedy), "
        f"{args.prompts} prompt(s), on {where}; nodes = most tree nodes in a step"
    )
    print(
        format_table(
            HEADERS,
            [
                [
                    r["mode"],
                    r["max_nodes"],
                    f"{r['tok_s']:.1f}",
                    f"{r['tau']:.2f}",
                    f"{r['step_ms']:.1f}",
                    f"{r['vs_ar']:.2f}x",
                ]
                for r in rows
            ],
        )
    )
    save_report(args, "bench compare", where, rows)
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "compare",
        help="AR vs DDTree budgets vs a chain (vs HF generate), one run",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--kind", default="prose")
    p.add_argument("--context", type=int, default=512, help="prompt length in tokens")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--prompts", type=int, default=1)
    p.add_argument("--budgets", default="4,8,16,32,64", help="tree node budgets to sweep")
    p.add_argument(
        "--chain-depth",
        type=int,
        default=0,
        help="chain nodes asked for (0 = the largest budget; the drafter caps it at its block depth)",
    )
    p.add_argument(
        "--hf",
        choices=("auto", "on", "off"),
        default="auto",
        help="HF generate row (auto: when transformers is installed and the checkpoint is local)",
    )
    p.add_argument("--hf-device", default="", help="default: cuda when available, else cpu")
    p.add_argument("--hf-dtype", default="float32", choices=DTYPE_NAMES)
    p.add_argument("--corpus", default="", help="dir with heldout_{kind}.txt (default: the standard library)")
    p.add_argument("--out", default="runs/bench_compare.json")
    add_endpoint_args(p)
    p.set_defaults(fn=run)
    return p

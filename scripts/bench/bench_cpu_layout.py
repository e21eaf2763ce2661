"""The target's verify / decode forward on the CPU with row-major against column-major weights.

    python -m scripts.bench.bench_cpu_layout [--contexts 128 1024 4096] [--rows 1 17] [--repeats 60] [--threads 1]
        [--out runs/bench_cpu_layout.json]

The verifier's `--cpu-linear-layout` (services/models/cpu_weight_layout.py) in isolation: two copies of the
demo target in fp32 (as the verifier serves it), one re-laid column-major, share one latent cache filled by
a prefill of `context` random tokens; then a forward of `rows` new tokens (1: an AR step; 17: a tree of a
budget-16 verify, causal mask) with the drafter's taps, as the step runs it. The two are called in turn,
`--repeats` times after a warm-up, and the median of each is printed with their ratio: no service, no
gRPC, no drafter, so the comparison is not drowned by a shared machine's noise the way a whole-service
A/B (scripts/bench/bench_ab.py) is at a few percent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ddtree.models.attention import AttentionMetadata, SeqAttention
from ddtree.models.cpu_weight_layout import use_column_major_weights
from ddtree.models.loader import load_target

DEMO_TARGET = Path(__file__).resolve().parents[2] / "checkpoints" / "demo" / "target"
TAPS = (1, 2, 4)  # the demo drafter's tap layers
PREFILL_CHUNK = 512


def _forward(model, kv, ids: list[int], start: int, slots: torch.Tensor, rows_out: torch.Tensor, taps=()):
    """One sequence: `ids` at positions start.., prefix slots[:start], new slots after it, causal."""
    n = len(ids)
    meta = AttentionMetadata((SeqAttention(0, n, slots[:start], slots[start : start + n], None),))
    positions = torch.arange(start, start + n)
    return model(torch.tensor(ids), positions, meta, kv, logits_rows=rows_out, tap_layer_ids=taps)


def measure(context: int, rows: int, repeats: int, models: dict, seed: int = 0) -> dict[str, float]:
    """Median ms of a forward of `rows` tokens after `context` committed ones, per model."""
    any_model = next(iter(models.values()))
    kv = any_model.new_kv_cache(context + rows + 1)
    slots = torch.arange(context + rows + 1)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, any_model.config.vocab_size, (context,), generator=g).tolist()
    last = torch.tensor([0])
    for c in range(0, context, PREFILL_CHUNK):  # the same cache for every model: the row-major one fills it
        _forward(any_model, kv, prompt[c : c + PREFILL_CHUNK], c, slots, last)
    new = torch.randint(0, any_model.config.vocab_size, (rows,), generator=g).tolist()
    every_row = torch.arange(rows)
    times: dict[str, list[float]] = {name: [] for name in models}
    for i in range(repeats + 5):  # in turn, so a slow spell of the machine hits both
        for name, model in models.items():
            t0 = time.perf_counter()
            _forward(model, kv, new, context, slots, every_row, TAPS)
            if i >= 5:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=str(DEMO_TARGET), help="target checkpoint dir")
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 17], help="new tokens per forward")
    p.add_argument("--repeats", type=int, default=60)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="runs/bench_cpu_layout.json")
    args = p.parse_args(argv)
    if min(args.contexts) < 1 or min(args.rows) < 1 or args.repeats < 1 or args.threads < 1:
        p.error("--contexts, --rows, --repeats and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    row = load_target(args.target, dtype=torch.float32).eval()
    column = load_target(args.target, dtype=torch.float32).eval()
    changed = use_column_major_weights(column)
    print(f"{args.target}: {changed} weights column-major; {args.threads} thread(s), median of {args.repeats}")
    results = []
    with torch.no_grad():
        for context in args.contexts:
            for rows in args.rows:
                ms = measure(context, rows, args.repeats, {"row": row, "column": column})
                results.append({"context": context, "rows": rows, **{f"{k}_ms": v for k, v in ms.items()}})
                print(f"context {context:>6}  rows {rows:>3}: row {ms['row']:7.2f} ms  column {ms['column']:7.2f} ms"
                      f"  row/column {ms['row'] / ms['column']:.2f}x", flush=True)  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "weights_changed": changed, "results": results}, indent=1))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

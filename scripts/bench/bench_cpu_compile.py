"""The target's verify / decode forward on the CPU: eager against the compiled static step (`--cpu-compile on`).

For each context and rows (1 = an AR decode, 17 = a root + 16-node tree), one sequence: the eager model
forward and the verifier's StaticStep with AOTInductor builds (buffers filled, compiled forward, the step's
cache rows written), in blocks of 20 calls in turn in one process, with a bucket of exactly that shape. Prints the medians,
the builds' seconds, and the largest logit difference; saves JSON.

    python -m scripts.bench.bench_cpu_compile --out runs/bench_cpu_compile.json
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
from ddtree.verifier.static_step import StaticStep, make_buckets

DEMO_TARGET = Path(__file__).resolve().parents[2] / "checkpoints" / "demo" / "target"
TAPS = (1, 2, 4)  # the demo drafter's tap layers
PREFILL_CHUNK = 512
BLOCK = 20  # calls of one path in a row


def _meta(start: int, n: int, slots: torch.Tensor) -> AttentionMetadata:
    """One sequence: n causal rows after `start` committed tokens on slots 0.."""
    return AttentionMetadata((SeqAttention(0, n, slots[:start], slots[start : start + n], None),))


def measure(model, context: int, rows: int, repeats: int, seed: int = 0) -> dict[str, float]:
    """Median ms of the eager forward and of the compiled step, one sequence of `rows` after `context`."""
    slots = torch.arange(context + rows)
    kv = model.new_kv_cache(context + rows + 1)  # the last slot: the static step's pad slot
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (context,), generator=g)
    for c in range(0, context, PREFILL_CHUNK):
        n = min(PREFILL_CHUNK, context - c)
        model(prompt[c : c + n], torch.arange(c, c + n), _meta(c, n, slots), kv, logits_rows=torch.tensor([n - 1]))
    step = StaticStep(model, kv, context + rows, make_buckets((1,), (rows,), (context + rows,)), TAPS, False, True)
    build_s = step.capture()
    ids = torch.randint(0, model.config.vocab_size, (rows,), generator=g)
    pos, meta, every_row = torch.arange(context, context + rows), _meta(context, rows, slots), torch.arange(rows)
    eager_ms, compiled_ms = [], []
    # Blocks of BLOCK calls in turn: a slow spell of the machine hits both, while each path runs warm (the
    # builds hold their own copy of the weights; call by call, each path would find the other's in cache).
    for i in range(repeats // BLOCK + 1):
        for _ in range(BLOCK):
            t0 = time.perf_counter()
            eager = model(ids, pos, meta, kv, logits_rows=every_row, tap_layer_ids=TAPS)
            (eager_ms if i else []).append((time.perf_counter() - t0) * 1e3)  # block 0: warm-up
        for _ in range(BLOCK):
            t0 = time.perf_counter()
            hidden, _ = step.run(ids, pos, meta, TAPS)
            compiled = model.compute_logits(hidden)
            (compiled_ms if i else []).append((time.perf_counter() - t0) * 1e3)
    if step.fallbacks:
        raise RuntimeError(f"the compiled step fell back to eager {step.fallbacks} times")
    diff = (compiled - eager.logits).abs().max().item()
    same = bool(torch.equal(compiled.argmax(-1), eager.logits.argmax(-1)))
    return {"eager_ms": statistics.median(eager_ms), "compiled_ms": statistics.median(compiled_ms),
            "build_s": build_s, "max_logit_diff": diff, "same_argmax": same}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=str(DEMO_TARGET), help="target checkpoint dir")
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 17], help="new tokens per forward")
    p.add_argument("--repeats", type=int, default=100, help="timed calls per path (rounded to blocks of 20)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="runs/bench_cpu_compile.json")
    args = p.parse_args(argv)
    if min(args.contexts) < 1 or min(args.rows) < 1 or args.repeats < 1 or args.threads < 1:
        p.error("--contexts, --rows, --repeats and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    model = load_target(args.target, dtype=torch.float32).eval()
    use_column_major_weights(model)  # as the verifier lays them out on the CPU (--cpu-linear-layout auto)
    print(f"{args.target}: {args.threads} thread(s), median of {args.repeats}")
    results = []
    with torch.inference_mode():
        for context in args.contexts:
            for rows in args.rows:
                r = measure(model, context, rows, args.repeats)
                results.append({"context": context, "rows": rows, **r})
                print(f"context {context:>6}  rows {rows:>3}: eager {r['eager_ms']:7.2f} ms  compiled "
                      f"{r['compiled_ms']:7.2f} ms  eager/compiled {r['eager_ms'] / r['compiled_ms']:.2f}x  "
                      f"build {r['build_s']:5.1f} s  max logit diff {r['max_logit_diff']:.1e}  "
                      f"same argmax {r['same_argmax']}", flush=True)  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

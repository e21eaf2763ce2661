"""Serving properties of the verifier, measured through the real services (issue 9's figures).

    python -m tools.bench_serving [--model DIR --drafter DIR] [--out runs/bench_serving.json]
        [--only fragmentation,prefix,batching]

- fragmentation: the late steps of one long generation (page size 1, scattered tree commits) against a
  fresh request whose prompt is that generation's own text up to the same point (prefilled into fresh
  KV, on a verifier without the prefix cache): same context, same tokens and trees, only the KV layout
  differs, so step time must not drift.
- prefix: the same 2k-token prompt twice: time to first token, output and acceptance of each.
- batching: 8 concurrent streams against 1: aggregate decode tokens per second, and every stream's
  output against its solo run.
Times come from the verifier's step records and usage (its own clock). Prints and saves JSON.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import pathlib
import statistics
import tempfile
import time

import grpc

from services.protocol.ddtree.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc


def generate(address, ids, max_new, budget=16, no_spec=False, request_id=""):
    req = verifier_pb2.GenerateRequest(request_id=request_id, input_ids=ids, max_new_tokens=max_new, ignore_eos=True,
                                       spec=common_pb2.SpecOptions(no_spec=no_spec, budget=budget))
    tokens, steps, usage, first, last, arrivals = [], [], None, None, None, []
    t0 = time.perf_counter()
    with grpc.insecure_channel(address) as ch:
        for msg in verifier_pb2_grpc.VerifierStub(ch).Generate(req, timeout=3600):
            if msg.token_ids:
                last = time.perf_counter()
                first = first or last
                arrivals.append((last, len(msg.token_ids)))
            tokens.extend(msg.token_ids)
            steps.extend(msg.steps)
            usage = msg.usage if msg.finish_reason else usage
    return {"tokens": tokens, "steps": steps, "usage": usage, "wall_s": time.perf_counter() - t0,
            "first_token_s": first, "last_token_s": last, "arrivals": arrivals}


VOCAB = {"size": 4096}   # set from the verifier's GetInfo before anything runs


def _prompt(seed: int, n: int) -> list[int]:
    """Deterministic pseudo-random ids: distinct prompts never share a prefix (no accidental cache hits)."""
    vocab = VOCAB["size"]
    return [(seed * 7919 + i * 104729 + i * i * 31) % (vocab - 100) + 50 for i in range(n)]


def fragmentation(address, out_len=1600, probe=100, budget=16, repeats=3):
    """Verify time at equal context and equal work: the last 2 x probe tokens of an out_len-token
    generation (page size 1: its KV is the scattered result of many tree commits) against a fresh request
    whose prompt is that generation's own text up to the same point (its KV is one fresh prefill). Greedy
    decoding then replays the same tokens with the same trees and accept lengths, so the only difference
    is where the KV sits. Long and fresh runs alternate `repeats` times (different texts), so that a drift
    of the machine's speed touches both sides; medians over all their steps."""
    late, early, same = [], [], True
    for r in range(repeats):
        prompt = _prompt(1 + 10 * r, 64)
        long = generate(address, prompt, out_len, budget)
        cut = out_len - 2 * probe  # generated tokens before the compared stretch
        start = len(prompt) + cut
        tail = [s for s in long["steps"] if s.context_tokens >= start]
        fresh = generate(address, prompt + long["tokens"][:cut], 2 * probe, budget)
        same &= fresh["tokens"][:len(long["tokens"]) - cut] == long["tokens"][cut:cut + len(fresh["tokens"])]
        late += tail
        early += fresh["steps"]
    m = lambda steps, k: statistics.median(getattr(s, k) for s in steps)  # noqa: E731
    mean = lambda steps, k: statistics.mean(getattr(s, k) for s in steps)  # noqa: E731
    row = {"context_late": m(late, "context_tokens"), "context_fresh": m(early, "context_tokens"),
           "repeats": repeats, "late_steps": len(late), "fresh_steps": len(early), "same_tokens": same,
           "accept_late": mean(late, "accept_length"), "accept_fresh": mean(early, "accept_length"),
           "late_verify_ms": m(late, "verify_ms"), "fresh_verify_ms": m(early, "verify_ms"),
           "late_total_ms": m(late, "total_ms"), "fresh_total_ms": m(early, "total_ms"),
           "late_nodes": m(late, "tree_nodes"), "fresh_nodes": m(early, "tree_nodes")}
    row["verify_ratio"] = row["late_verify_ms"] / row["fresh_verify_ms"]
    row["total_ratio"] = row["late_total_ms"] / row["fresh_total_ms"]
    print(f"fragmentation @ context {row['context_late']:.0f} (late) / {row['context_fresh']:.0f} (fresh), same "
          f"text (tokens identical: {same}; accept length {row['accept_late']:.2f} late, {row['accept_fresh']:.2f} "
          f"fresh): verify {row['late_verify_ms']:.2f} ms late in a {out_len}-token generation vs "
          f"{row['fresh_verify_ms']:.2f} ms fresh (ratio {row['verify_ratio']:.3f}; whole step ratio "
          f"{row['total_ratio']:.3f}; {repeats} pairs)")
    return row


def prefix(address, n=2048, out=64, budget=16):
    ids = _prompt(3, n)
    runs = [generate(address, ids, out, budget, request_id="bench-prefix") for _ in range(2)]
    row = {"prompt": n, "ttft_ms": [r["usage"].ttft_ms for r in runs],
           "same_output": runs[0]["tokens"] == runs[1]["tokens"],
           "accept": [[s.accept_length for s in r["steps"]] for r in runs]}
    row["same_acceptance"] = row["accept"][0] == row["accept"][1]
    row["ttft_ratio"] = row["ttft_ms"][1] / row["ttft_ms"][0]
    print(f"prefix cache, {n}-token prompt: TTFT {row['ttft_ms'][0]:.1f} ms then {row['ttft_ms'][1]:.1f} ms "
          f"(ratio {row['ttft_ratio']:.3f}); same output {row['same_output']}, same acceptance {row['same_acceptance']}")
    return row


def batching(address, streams=8, out=256, budget=16):
    """Decode tokens per second, client clock: a stream's tokens after its first over first -> last token;
    for the concurrent streams (1) all tokens after each stream's first over the earliest first token to
    the latest last token (ramp-up and tail included: streams still in prefill, or already finished, count
    against the aggregate), and (2) the steady state: tokens arriving while all streams decode (after the
    last first token, before the first last token) over that window."""
    prompts = [_prompt(10 + i, 200) for i in range(streams)]
    solo = [generate(address, p, out, budget) for p in prompts]
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(streams) as pool:
        together = list(pool.map(lambda p: generate(address, p, out, budget), prompts))
    wall = time.perf_counter() - t0
    single_tps = statistics.median((len(r["tokens"]) - 1) / (r["last_token_s"] - r["first_token_s"]) for r in solo)
    span = max(r["last_token_s"] for r in together) - min(r["first_token_s"] for r in together)
    aggregate_tps = sum(len(r["tokens"]) - 1 for r in together) / span
    lo, hi = max(r["first_token_s"] for r in together), min(r["last_token_s"] for r in together)
    steady_tokens = sum(n for r in together for t, n in r["arrivals"] if lo < t <= hi)
    steady_tps = steady_tokens / (hi - lo) if hi > lo else 0.0
    # The same ratio over whole requests (prefill and first token included), for comparison.
    solo_wall_tps = statistics.median(len(r["tokens"]) / r["wall_s"] for r in solo)
    steps = lambda rs: sum(len(r["steps"]) for r in rs)  # noqa: E731
    tau = lambda rs: sum(s.accept_length for r in rs for s in r["steps"]) / max(steps(rs), 1)  # noqa: E731
    step_ms = lambda rs: statistics.median(s.total_ms for r in rs for s in r["steps"])  # noqa: E731
    row = {"streams": streams, "tokens": out, "single_stream_tok_s": single_tps, "aggregate_tok_s": aggregate_tps,
           "ratio": aggregate_tps / single_tps, "steady_tok_s": steady_tps, "steady_ratio": steady_tps / single_tps,
           "steady_window_s": max(hi - lo, 0.0),
           "whole_request_ratio": (sum(len(r["tokens"]) for r in together) / wall) / solo_wall_tps,
           "tau_solo": tau(solo), "tau_together": tau(together),
           "step_ms_solo": step_ms(solo), "step_ms_together": step_ms(together),
           "identical_to_solo": all(a["tokens"] == b["tokens"] for a, b in zip(solo, together))}
    print(f"batching: {streams} streams {aggregate_tps:.1f} decode tok/s aggregate vs {single_tps:.1f} single "
          f"(x{row['ratio']:.2f}; all {streams} decoding: {steady_tps:.1f} tok/s over {row['steady_window_s']:.2f} s, "
          f"x{row['steady_ratio']:.2f}; whole requests x{row['whole_request_ratio']:.2f}); tau {row['tau_solo']:.2f} solo, "
          f"{row['tau_together']:.2f} together; median step {row['step_ms_solo']:.1f} ms solo, "
          f"{row['step_ms_together']:.1f} ms together; identical to solo runs: {row['identical_to_solo']}")
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="")
    p.add_argument("--drafter", default="")
    p.add_argument("--verifier", default="", help="a running verifier (default: start one with a drafter)")
    p.add_argument("--only", default="fragmentation,prefix,batching")
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--verifier-args", default="", help="extra verifier flags, one string (e.g. '--page-size 16')")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/bench_serving.json"))
    args = p.parse_args(argv)
    todo = args.only.split(",")
    results = {}

    def run(address, names):
        with grpc.insecure_channel(address) as ch:
            VOCAB["size"] = verifier_pb2_grpc.VerifierStub(ch).GetInfo(verifier_pb2.VerifierInfoRequest(),
                                                                      timeout=60).vocab_size
        for name in names:
            results[name] = {"fragmentation": fragmentation, "prefix": prefix, "batching": batching}[name](
                address, budget=args.budget)

    if args.verifier:
        run(args.verifier, todo)
    else:
        from services.launcher import start_stack
        from services.models.default_checkpoint import default_checkpoint
        d = default_checkpoint()
        # fragmentation gets its own verifier without the prefix cache: its fresh request re-reads the long
        # generation's text, which must be prefilled into fresh KV, not found in the cache.
        groups = [(["fragmentation"], ("--prefix-cache", "false"))] if "fragmentation" in todo else []
        groups += [([n for n in todo if n != "fragmentation"], ())]
        for names, extra in groups:
            if not names:
                continue
            stack = start_stack(args.model or str(d.target), args.drafter or str(d.drafter),
                                pathlib.Path(tempfile.mkdtemp(prefix="ddtree-bench-serving-")),
                                verifier_args=("--max-context", "4096", "--kv-tokens", "65536", *extra,
                                               *args.verifier_args.split()))
            try:
                run(stack.verifier, names)
            finally:
                stack.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

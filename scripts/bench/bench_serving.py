"""Serving properties of the verifier, measured through the real services (issue 9's figures).

    python -m scripts.bench.bench_serving [--model DIR --drafter DIR] [--out runs/bench_serving.json]
        [--only fragmentation,prefix,batching]

- fragmentation: the late steps of one long generation (page size 1, scattered tree commits) against a
  fresh request whose prompt is that generation's own text up to the same point (prefilled into fresh
  KV, on a verifier without the prefix cache): same context, same tokens and trees, only the KV layout
  differs, so step time must not drift.
- prefix: the same 2k-token prompt twice: time to first token, output and acceptance of each.
- batching: 8 concurrent streams against 1: aggregate decode tokens per second (sustained: 8 clients
  sending requests back to back; and one burst of 8), and every stream's output against its solo run.
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

from ddtree.protocol.ddtree.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc


def generate(address, ids, max_new, budget=16, no_spec=False, request_id=""):
    req = verifier_pb2.GenerateRequest(
        request_id=request_id,
        input_ids=ids,
        max_new_tokens=max_new,
        ignore_eos=True,
        spec=common_pb2.SpecOptions(no_spec=no_spec, budget=budget),
    )
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
    return {
        "tokens": tokens,
        "steps": steps,
        "usage": usage,
        "wall_s": time.perf_counter() - t0,
        "first_token_s": first,
        "last_token_s": last,
        "arrivals": arrivals,
    }


VOCAB = {"size": 4096}  # set from the verifier's GetInfo before anything runs


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
        same &= fresh["tokens"][: len(long["tokens"]) - cut] == long["tokens"][cut : cut + len(fresh["tokens"])]
        late += tail
        early += fresh["steps"]
    m = lambda steps, k: statistics.median(getattr(s, k) for s in steps)  # noqa: E731
    mean = lambda steps, k: statistics.mean(getattr(s, k) for s in steps)  # noqa: E731
    row = {
        "context_late": m(late, "context_tokens"),
        "context_fresh": m(early, "context_tokens"),
        "repeats": repeats,
        "late_steps": len(late),
        "fresh_steps": len(early),
        "same_tokens": same,
        "accept_late": mean(late, "accept_length"),
        "accept_fresh": mean(early, "accept_length"),
        "late_verify_ms": m(late, "verify_ms"),
        "fresh_verify_ms": m(early, "verify_ms"),
        "late_total_ms": m(late, "total_ms"),
        "fresh_total_ms": m(early, "total_ms"),
        "late_nodes": m(late, "tree_nodes"),
        "fresh_nodes": m(early, "tree_nodes"),
    }
    row["verify_ratio"] = row["late_verify_ms"] / row["fresh_verify_ms"]
    row["total_ratio"] = row["late_total_ms"] / row["fresh_total_ms"]
    print(
        f"fragmentation @ context {row['context_late']:.0f} (late) / {row['context_fresh']:.0f} (fresh), same "
        f"text (tokens identical: {same}; accept length {row['accept_late']:.2f} late, {row['accept_fresh']:.2f} "
        f"fresh): verify {row['late_verify_ms']:.2f} ms late in a {out_len}-token generation vs "
        f"{row['fresh_verify_ms']:.2f} ms fresh (ratio {row['verify_ratio']:.3f}; whole step ratio "
        f"{row['total_ratio']:.3f}; {repeats} pairs)"
    )
    return row


def prefix(address, n=2048, out=64, budget=16):
    ids = _prompt(3, n)
    runs = [generate(address, ids, out, budget, request_id="bench-prefix") for _ in range(2)]
    row = {
        "prompt": n,
        "ttft_ms": [r["usage"].ttft_ms for r in runs],
        "same_output": runs[0]["tokens"] == runs[1]["tokens"],
        "accept": [[s.accept_length for s in r["steps"]] for r in runs],
    }
    row["same_acceptance"] = row["accept"][0] == row["accept"][1]
    row["ttft_ratio"] = row["ttft_ms"][1] / row["ttft_ms"][0]
    print(
        f"prefix cache, {n}-token prompt: TTFT {row['ttft_ms'][0]:.1f} ms then {row['ttft_ms'][1]:.1f} ms "
        f"(ratio {row['ttft_ratio']:.3f}); same output {row['same_output']}, same acceptance {row['same_acceptance']}"
    )
    return row


def _decode_tps(r) -> float:
    """One request's decode speed: its tokens after the first over first -> last token (client clock)."""
    return (len(r["tokens"]) - 1) / (r["last_token_s"] - r["first_token_s"])


def _window_tokens(runs, lo: float, hi: float) -> int:
    """Decode tokens (each request's first token excluded: it comes from the prefill) arriving in (lo, hi]."""
    return sum(n - (i == 0) for r in runs for i, (t, n) in enumerate(r["arrivals"]) if lo < t <= hi)


def _summary(rs) -> dict:
    steps = [s for r in rs for s in r["steps"]]
    return {
        "tau": sum(s.accept_length for s in steps) / max(len(steps), 1),
        "step_ms": statistics.median(s.total_ms for s in steps),
        "tree_nodes": statistics.mean(s.tree_nodes for s in steps),
    }


def batching(address, streams=8, out=256, budget=16, rounds=3):
    """Decode tokens per second of `streams` concurrent streams against one stream, client clock, every
    output checked against the same prompt run alone. Single stream: the median over the prompts run alone
    of a request's decode speed (_decode_tps). Two loads:

    - sustained (the figure): `streams` clients, each sending `rounds` requests back to back (a new one as
      soon as its previous ends), so `streams` requests are always in flight, new prompts prefilled between
      decode steps as in serving. Aggregate = decode tokens arriving while every client is busy (from the
      moment all have their first token to the moment the first client is done) over that window; the same
      over the whole run (the last round's tail of streams finishing one by one included) is shown beside.
    - burst: one request per client at once (the first round's prompts): over the whole span (ramp-up of
      the prefills and the tail included) and while all `streams` decode."""
    prompts = [[_prompt(10 + w * rounds + r, 200) for r in range(rounds)] for w in range(streams)]
    solo = [[generate(address, p, out, budget) for p in ps] for ps in prompts]
    single_tps = statistics.median(_decode_tps(r) for rs in solo for r in rs)

    with cf.ThreadPoolExecutor(streams) as pool:  # burst: the first round at once
        burst = list(pool.map(lambda ps: generate(address, ps[0], out, budget), prompts))
    span = max(r["last_token_s"] for r in burst) - min(r["first_token_s"] for r in burst)
    burst_tps = sum(len(r["tokens"]) - 1 for r in burst) / span
    lo, hi = max(r["first_token_s"] for r in burst), min(r["last_token_s"] for r in burst)
    burst_steady_tps = _window_tokens(burst, lo, hi) / (hi - lo) if hi > lo else 0.0

    with cf.ThreadPoolExecutor(streams) as pool:  # sustained: each client's requests back to back
        clients = list(pool.map(lambda ps: [generate(address, p, out, budget) for p in ps], prompts))
    flat = [r for rs in clients for r in rs]
    lo = max(rs[0]["first_token_s"] for rs in clients)  # every client has started decoding
    hi = min(rs[-1]["last_token_s"] for rs in clients)  # the first client is done
    sustained_tps = _window_tokens(flat, lo, hi) / (hi - lo) if hi > lo else 0.0  # 0: no moment all were busy
    whole_lo, whole_hi = min(r["first_token_s"] for r in flat), max(r["last_token_s"] for r in flat)
    sustained_whole_tps = sum(len(r["tokens"]) - 1 for r in flat) / (whole_hi - whole_lo)

    identical = all(a["tokens"] == b[0]["tokens"] for a, b in zip(burst, solo)) and all(
        a["tokens"] == b["tokens"] for ca, cb in zip(clients, solo) for a, b in zip(ca, cb)
    )
    solo_flat = [r for rs in solo for r in rs]
    row = {
        "streams": streams,
        "rounds": rounds,
        "tokens": out,
        "single_stream_tok_s": single_tps,
        "sustained_tok_s": sustained_tps,
        "ratio": sustained_tps / single_tps,
        "sustained_window_s": max(hi - lo, 0.0),
        "sustained_whole_tok_s": sustained_whole_tps,
        "whole_ratio": sustained_whole_tps / single_tps,
        "burst_tok_s": burst_tps,
        "burst_ratio": burst_tps / single_tps,
        "burst_steady_tok_s": burst_steady_tps,
        "burst_steady_ratio": burst_steady_tps / single_tps,
        "solo": _summary(solo_flat),
        "sustained": _summary(flat),
        "identical_to_solo": identical,
    }
    print(
        f"batching: {streams} streams sustained {sustained_tps:.1f} decode tok/s vs {single_tps:.1f} single "
        f"(x{row['ratio']:.2f} over {row['sustained_window_s']:.2f} s with all {streams} busy; x{row['whole_ratio']:.2f} "
        f"over the whole run of {rounds} rounds); one burst x{row['burst_ratio']:.2f} over its span, "
        f"x{row['burst_steady_ratio']:.2f} while all decode; tau {row['solo']['tau']:.2f} solo, "
        f"{row['sustained']['tau']:.2f} sustained; median step {row['solo']['step_ms']:.1f} ms solo, "
        f"{row['sustained']['step_ms']:.1f} ms sustained (mean tree {row['sustained']['tree_nodes']:.1f} nodes); "
        f"identical to solo runs: {identical}"
    )
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="")
    p.add_argument("--drafter", default="")
    p.add_argument("--verifier", default="", help="a running verifier (default: start one with a drafter)")
    p.add_argument("--only", default="fragmentation,prefix,batching")
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--streams", type=int, default=8, help="batching: concurrent streams")
    p.add_argument("--tokens", type=int, default=256, help="batching: tokens per request")
    p.add_argument("--rounds", type=int, default=3, help="batching: requests per client in the sustained load")
    p.add_argument("--verifier-args", default="", help="extra verifier flags, one string (e.g. '--page-size 16')")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/bench_serving.json"))
    args = p.parse_args(argv)
    todo = args.only.split(",")
    unknown = set(todo) - {"fragmentation", "prefix", "batching"}
    if unknown:
        p.error(f"--only takes fragmentation,prefix,batching; unknown: {', '.join(sorted(unknown))}")
    if min(args.streams, args.rounds) < 1 or args.tokens < 2:
        p.error("--streams and --rounds must be >= 1 and --tokens >= 2 (a decode speed needs two tokens)")
    results = {}

    def run(address, names):
        with grpc.insecure_channel(address) as ch:
            VOCAB["size"] = (
                verifier_pb2_grpc.VerifierStub(ch).GetInfo(verifier_pb2.VerifierInfoRequest(), timeout=60).vocab_size
            )
        sizes = {"batching": dict(streams=args.streams, out=args.tokens, rounds=args.rounds)}
        for name in names:
            results[name] = {"fragmentation": fragmentation, "prefix": prefix, "batching": batching}[name](
                address, budget=args.budget, **sizes.get(name, {})
            )

    if args.verifier:
        run(args.verifier, todo)
    else:
        from ddtree.default_checkpoint import default_checkpoint
        from ddtree.launcher import start_stack

        d = default_checkpoint()
        # fragmentation gets its own verifier without the prefix cache: its fresh request re-reads the long
        # generation's text, which must be prefilled into fresh KV, not found in the cache.
        groups = [(["fragmentation"], ("--prefix-cache", "false"))] if "fragmentation" in todo else []
        groups += [([n for n in todo if n != "fragmentation"], ())]
        for names, extra in groups:
            if not names:
                continue
            stack = start_stack(
                args.model or str(d.target),
                args.drafter or str(d.drafter),
                pathlib.Path(tempfile.mkdtemp(prefix="ddtree-bench-serving-")),
                verifier_args=("--max-context", "4096", "--kv-tokens", "65536", *extra, *args.verifier_args.split()),
            )
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

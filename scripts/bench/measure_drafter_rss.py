"""Resident memory of a drafter process over many mixed request lifetimes (issue 20 point 6).

    python -m scripts.bench.measure_drafter_rss [--requests 2000] [--checkpoints 200,1000,2000] [--dtype auto]
        [--seed 0] [--out /tmp/drafter_rss.json] [--drafter-args '--window 512'] [--env LRU_CACHE_CAPACITY=1]

Starts `python -m ddtree.cli drafter --port 0` (the default checkpoint unless --model/--target), reads its
shape from GetInfo, then drives request lifetimes against it over gRPC, as a verifier would:
- a request is one sequence lifetime: a first Draft with reset=True and a prompt-length commit, then a few
  Draft calls that each commit 1..block_size tokens (accepted + bonus) at the context's end, then Release;
- requests run in lockstep groups of 1..8 sequences per Draft call, with varied prompt lengths (1..
  --max-prompt), budgets and an occasional chain request. Features are random (the drafter only needs their
  shape); the generator is seeded, so two runs send the same calls.

VmRSS of the drafter (from /proc/PID/status) is read after warm-up (0 requests) and whenever the number of
released requests reaches a checkpoint; the drafter holds no sequence then (GetInfo active_sequences = 0), so
any growth is memory the process keeps per request or per shape. Prints a table and writes a JSON result.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import tempfile
import time

import grpc
import torch

from ddtree.launcher import start_service
from ddtree.protocol.ddtree.v1 import drafter_pb2, drafter_pb2_grpc
from ddtree.protocol.server import GRPC_OPTIONS
from ddtree.protocol.tensors import tensor_to_proto

BUDGETS = (4, 8, 16, 32, 64, 128)


def read_status_mb(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM (peak RSS) of a process, MB."""
    out = {}
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024  # kB
    return out


class Driver:
    """Sends seeded, mixed request lifetimes to one drafter."""

    def __init__(self, stub, info, seed: int, max_prompt: int, max_group: int):
        self.stub, self.info = stub, info
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.feature_size = len(info.target_layer_ids) * info.hidden_size
        self.max_prompt = max_prompt if info.window == 0 else min(max_prompt, info.window)
        self.max_group = max_group
        self.draft_calls = 0
        self.commit_rows: set[int] = set()  # distinct rows of features per Draft call (the drafter's K/V shapes)
        self._next_id = 0

    def _seq(self, seq_id: str, start: int, n: int, reset: bool, budget: int, chain: bool) -> drafter_pb2.SeqDraft:
        msg = drafter_pb2.SeqDraft(
            seq_id=seq_id,
            commit_token_ids=[self.rng.randrange(self.info.vocab_size) for _ in range(n)],
            commit_start=start,
            root_token_id=self.rng.randrange(self.info.vocab_size),
            budget=budget,
            reset=reset,
            chain=chain,
        )
        msg.commit_features.CopyFrom(tensor_to_proto(torch.randn(n, self.feature_size, generator=self.gen)))
        return msg

    def run_group(self, size: int) -> None:
        """One lockstep group of `size` request lifetimes: prompt commit, 1..5 decode commits, Release."""
        ids = [f"r{self._next_id + i}" for i in range(size)]
        self._next_id += size
        ends = [self.rng.randint(1, self.max_prompt) for _ in ids]  # the prompt commit
        budgets = [self.rng.choice(BUDGETS) for _ in ids]
        chains = [self.rng.random() < 0.1 for _ in ids]
        steps = self.rng.randint(2, 6)
        for step in range(steps):
            msgs = []
            for i, seq_id in enumerate(ids):
                n = ends[i] if step == 0 else self.rng.randint(1, self.info.block_size)
                start = 0 if step == 0 else ends[i]
                msgs.append(self._seq(seq_id, start, n, step == 0, budgets[i], chains[i]))
                ends[i] = start + n
            self.commit_rows.add(sum(len(m.commit_token_ids) for m in msgs))
            self.stub.Draft(drafter_pb2.DraftRequest(seqs=msgs), timeout=120)
            self.draft_calls += 1
        released = self.stub.Release(drafter_pb2.ReleaseRequest(seq_ids=ids), timeout=60).released
        if released != size:
            raise RuntimeError(f"Release freed {released} of {size} sequences")


def measure(args) -> dict:
    checkpoints = sorted({int(c) for c in args.checkpoints.split(",") if c})
    if not checkpoints or checkpoints[-1] > args.requests or checkpoints[0] < 1:
        raise SystemExit(f"--checkpoints must lie in [1, --requests={args.requests}], got {args.checkpoints}")
    flags = ["drafter", "--port", "0", "--dtype", args.dtype, *args.drafter_args.split()]
    if args.model:
        flags += ["--model", args.model]
    if args.target:
        flags += ["--target", args.target]
    env = dict(kv.split("=", 1) for kv in args.env)
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="drafter-rss-"))
    proc = start_service("drafter", flags, log_dir, env=env)
    rows = []
    try:
        with grpc.insecure_channel(proc.address, options=GRPC_OPTIONS) as channel:
            stub = drafter_pb2_grpc.DrafterStub(channel)
            info = stub.GetInfo(drafter_pb2.DrafterInfoRequest(), timeout=60, wait_for_ready=True)
            driver = Driver(stub, info, args.seed, args.max_prompt, args.max_group)
            t0 = time.perf_counter()

            def record(done: int) -> None:
                active = stub.GetInfo(drafter_pb2.DrafterInfoRequest(), timeout=60).active_sequences
                status = read_status_mb(proc.popen.pid)
                rows.append(
                    dict(
                        requests=done,
                        rss_mb=round(status["VmRSS"], 1),
                        hwm_mb=round(status["VmHWM"], 1),
                        active_sequences=active,
                        draft_calls=driver.draft_calls,
                        distinct_commit_rows=len(driver.commit_rows),
                        seconds=round(time.perf_counter() - t0, 1),
                    )
                )

            record(0)
            done = 0
            for target in sorted({*checkpoints, args.requests}):
                while done < target:  # groups never straddle a checkpoint, so it is read at exactly `target`
                    size = min(driver.rng.randint(1, args.max_group), target - done)
                    driver.run_group(size)
                    done += size
                record(done)
    finally:
        code = proc.stop()
    first = next(r for r in rows if r["requests"] == checkpoints[0])
    last = rows[-1]
    growth = (last["rss_mb"] - first["rss_mb"]) / first["rss_mb"]
    return dict(
        dtype=args.dtype,
        requests=args.requests,
        seed=args.seed,
        max_prompt=args.max_prompt,
        drafter_args=args.drafter_args,
        env=env,
        drafter_log=str(proc.log_path),
        drafter_exit_code=code,
        rows=rows,
        growth_first_to_last=round(growth, 4),
        within_10pct=abs(growth) <= 0.10,
    )


def print_table(result: dict) -> None:
    print(f"drafter RSS, dtype={result['dtype']}, seed={result['seed']}, env={result['env'] or '-'}")
    print(
        f"{'requests':>9} {'VmRSS MB':>9} {'VmHWM MB':>9} {'active':>7} {'Draft calls':>11} {'row counts':>10} {'s':>6}"
    )
    for r in result["rows"]:
        print(
            f"{r['requests']:>9} {r['rss_mb']:>9.1f} {r['hwm_mb']:>9.1f} {r['active_sequences']:>7} "
            f"{r['draft_calls']:>11} {r['distinct_commit_rows']:>10} {r['seconds']:>6.1f}"
        )
    verdict = "within" if result["within_10pct"] else "NOT within"
    print(f"RSS growth first checkpoint -> last: {100 * result['growth_first_to_last']:+.1f}% ({verdict} 10%)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="request lifetimes to run")
    p.add_argument("--checkpoints", default="200,1000,2000", help="request counts at which RSS is read")
    p.add_argument("--dtype", default="auto", help="drafter --dtype: auto | float32 | bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-prompt", type=int, default=1024, help="longest prompt commit, tokens (capped by window)")
    p.add_argument("--max-group", type=int, default=8, help="most sequences per Draft call")
    p.add_argument("--model", default="", help="drafter checkpoint dir ('' = the default checkpoint)")
    p.add_argument("--target", default="", help="target checkpoint dir ('' = the default checkpoint)")
    p.add_argument("--drafter-args", default="", help="extra drafter flags, one string")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the drafter process (repeatable)")
    p.add_argument("--out", default=str(pathlib.Path(tempfile.gettempdir()) / "drafter_rss.json"))
    args = p.parse_args(argv)
    result = measure(args)
    print_table(result)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

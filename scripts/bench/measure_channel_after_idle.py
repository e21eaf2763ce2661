"""The drafter's transport per Draft call, back to back and after an idle gap (issue 38).

    python -m scripts.bench.measure_channel_after_idle [--gaps-ms 0,10] [--calls 400] [--commit 4] [--out F]

Inside the services a Draft call follows the verifier's forward (about 10 ms on the demo VM), while the
drafter's thread has been asleep since its last call. This times the same call both ways, so what the
transport costs for its own work is told apart from what the machine costs to wake it:
- a drafter process whose engine drafts a one-node tree (tools/selftest/drafter_check.NullEngine), so a
  call's time is its transport and the server's own work;
- a DrafterClient over the co-located channel (features through the shared-memory ring) and over gRPC;
- commits of --commit tokens at the demo's width (5 taps x 256, fp32);
- before each call the client sleeps --gaps-ms (0: back to back).
Per path and gap: the median transport (the client's RPC wall time minus the drafter's compute, as the
verifier reports it) and the client thread's CPU time per call.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time

import torch

from ddtree.contract.sampling_params import SamplingConfig
from ddtree.tools.selftest.drafter_check import _serve_null_drafter
from ddtree.verifier.drafting.drafter_client import DrafterClient
from ddtree.verifier.sequence import GenerateParams, PendingCommit, Sequence

SHAPE = dict(taps=5, hidden=256, vocab=4096)  # the demo pair's feature width
WARMUP_CALLS = 50


def time_calls(client: DrafterClient, calls: int, commit: int, gap_s: float) -> tuple[float, float]:
    """(median transport ms, median client CPU ms) over `calls` Draft calls, each after `gap_s` asleep."""
    width = SHAPE["taps"] * SHAPE["hidden"]
    transport, cpu = [], []
    for i in range(calls):
        seq = Sequence(GenerateParams(f"idle-{i}", (1,), SamplingConfig(), 8, frozenset(), True, 1))
        seq.root = 1
        seq.pending_commit = PendingCommit([1] * commit, 0, torch.zeros(commit, width))
        time.sleep(gap_s)
        cpu0 = time.thread_time()
        result = client.draft([(seq, 1)], vocab_size=SHAPE["vocab"])
        cpu.append((time.thread_time() - cpu0) * 1e3)
        transport.append(result.rpc_ms - result.draft_ms)
    return statistics.median(transport), statistics.median(cpu)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gaps-ms", default="0,10", help="comma-separated idle gaps before each call")
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--commit", type=int, default=4, help="tokens per commit")
    p.add_argument("--out", default="")
    args = p.parse_args()
    gaps = [float(g) for g in args.gaps_ms.split(",")]
    ctx = multiprocessing.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    drafter = ctx.Process(target=_serve_null_drafter, args=(SHAPE, ports, stop), daemon=True)
    drafter.start()
    address = f"127.0.0.1:{ports.get(timeout=120)}"
    rows = []
    try:
        for path, ring_bytes in (("local", 64 << 20), ("grpc", 0)):
            client = DrafterClient(address, 60, local_ring_bytes=ring_bytes)
            if (client.local is not None) != (path == "local"):
                raise SystemExit(f"the {path} path is not the one the client took")
            time_calls(client, WARMUP_CALLS, args.commit, 0.0)
            for gap in gaps:
                transport, cpu = time_calls(client, args.calls, args.commit, gap / 1e3)
                rows.append(dict(path=path, gap_ms=gap, transport_ms=transport, client_cpu_ms=cpu))
                print(
                    f"{path:>5}  gap {gap:>5.1f} ms  transport {transport:.3f} ms  client CPU {cpu:.3f} ms", flush=True
                )
            client.close()
    finally:
        stop.set()
        drafter.join(timeout=30)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(commit=args.commit, calls=args.calls, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()

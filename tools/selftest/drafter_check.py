"""The drafter's device path (issue 38) in numbers: part (e) of `ddtree selftest gpu`.

1. Transport per Draft call at Kimi K2.6's feature width (6 taps x 7168, bf16) for commits of 1, 8 and 2048
   tokens, the features where the verifier's forward leaves them (the GPU; the CPU in the dry run):
   - "device": the co-located channel with the ring's data on the GPU (CUDA IPC, device to device;
     protocol/device_plane.py), only where there is a GPU;
   - "shared": the co-located channel with the ring in shared memory (the features go to the host);
   - "grpc": gRPC bytes.
   Each back to back, and the 1-token commit once more after 10 ms asleep before each call (`gap_ms`), as
   a Draft call follows a verify in serving: what the machine's wake-up adds to the same call.
   The drafter runs in its own process (CUDA IPC maps memory of another process only) with an engine that
   drafts a one-node tree, keeps nothing and waits for its device, so a call's time is its transport and
   the server's own work. A commit over the chunk size goes ahead in chunks (`chunks_ahead`): one frame
   each through the ring on the co-located paths, one Append stream over gRPC.
2. The tree build of one Draft call (8 sequences, 15 depths, Kimi's vocabulary of 163,840): top-K and the
   tensor build on the device (tree/device_build.py) against top-K, the copy to the host and the heap of
   tree/best_first.py; the trees must be equal (a mismatch otherwise).
The dry run shrinks the width to 2 x 64 and the vocabulary to 4,096.

`run_drafter_check(dry_run, device, log)` returns {transport: rows, tree: rows, mismatches, errors}.
"""

from __future__ import annotations

import statistics
import time
import traceback

import torch

from ddtree.contract.token_tree import TokenTree

KIMI = dict(taps=6, hidden=7168, vocab=163840)
DRY = dict(taps=2, hidden=64, vocab=4096)
COMMITS = (1, 8, 2048)
# (commit tokens, idle ms before each call): back to back, and a 1-token commit after the drafter slept
# as long as a verify step, as in serving.
CASES = tuple((n, 0) for n in COMMITS) + ((1, 10),)
CALLS = 30
TREE_SEQS, TREE_DEPTH, TREE_BUDGETS = 8, 15, (16, 64)


class NullEngine:
    """Drafts a one-node tree per sequence and keeps no context: the call is all transport."""

    def __init__(self, taps: int, hidden: int, vocab: int):
        self.taps, self.hidden, self.vocab = taps, hidden, vocab
        self.tree_on_device = torch.cuda.is_available()  # serve_engine maps a ring's GPU buffer for such an engine

    def info(self) -> dict:
        return dict(model_id="null", block_size=16, mask_token_id=0, target_layer_ids=list(range(self.taps)),
                    window=0, default_budget=16, max_budget=64, hidden_size=self.hidden, vocab_size=self.vocab,
                    active_sequences=0)  # fmt: skip

    def knows(self, seq_id: str) -> bool:
        return False

    def draft(self, seqs):
        for seq in seqs:  # the features have arrived when their copy has run (a real draft's forward waits so)
            if seq.commit_features.is_cuda:
                torch.cuda.synchronize(seq.commit_features.device)
        return [TokenTree((1,), (0,), (1,)) for _ in seqs]

    def append(self, seqs) -> None:
        pass

    def release(self, ids) -> int:
        return 0


def _serve_null_drafter(shape: dict, ports, stop) -> None:
    """The drafter process: serve a NullEngine until `stop` is set; its port goes to `ports`."""
    from ddtree.config import DrafterConfig
    from ddtree.drafter.server import serve_engine

    server = serve_engine(NullEngine(**shape), DrafterConfig(port=0, grace_s=0.0))
    ports.put(server.port)
    stop.wait()
    server.stop(0)


def run_drafter_check(dry_run: bool, device: torch.device, log, deadline: float = float("inf"),
                      on_row=lambda out: None) -> dict:  # fmt: skip
    """{transport, tree, mismatches, skipped, errors}: a case not started past `deadline` (perf_counter) is
    counted in skipped; on_row(out) after every row (the JSON saved)."""
    shape = DRY if dry_run else KIMI
    out = dict(transport=[], tree=[], mismatches=0, skipped=0, errors=[])
    try:
        _transport(shape, device, log, out, deadline, on_row)
    except Exception:
        out["errors"].append(dict(part="drafter transport", error=traceback.format_exc()[-3000:]))
    try:
        _trees(shape["vocab"], device, log, out, deadline, on_row)
    except Exception:
        out["errors"].append(dict(part="drafter tree", error=traceback.format_exc()[-3000:]))
    return out


def _transport(shape: dict, device: torch.device, log, out: dict, deadline: float, on_row) -> None:
    import multiprocessing

    from ddtree.contract.sampling_params import SamplingConfig
    from ddtree.verifier.drafting.drafter_client import DrafterClient
    from ddtree.verifier.sequence import GenerateParams, PendingCommit, Sequence
    from ddtree.verifier.sequence_lifecycle import stage_commit

    width = shape["taps"] * shape["hidden"]
    ctx = multiprocessing.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    drafter = ctx.Process(target=_serve_null_drafter, args=(shape, ports, stop), daemon=True)
    drafter.start()
    address = f"127.0.0.1:{ports.get(timeout=120)}"
    asked = (["device"] if device.type == "cuda" else []) + ["shared", "grpc"]
    rows = out["transport"]
    log(f"{'commit':>7} {'gap ms':>6} {'path':>6} {'transport ms':>12} {'feature MB':>10}")
    try:
        for ask in asked:
            ring = dict(device=(256 << 20, device), shared=(256 << 20, None), grpc=(0, None))[ask]
            client = DrafterClient(address, 60, local_ring_bytes=ring[0], ring_device=ring[1])
            on_device = client.local is not None and client.local.ring.device is not None
            for n, gap_ms in CASES:
                if time.perf_counter() > deadline:
                    out["skipped"] += 1
                    continue
                times = []
                for i in range(CALLS if n < 1000 else 3):
                    seq = Sequence(GenerateParams(f"t{n}-{i}", (1,), SamplingConfig(), 8, frozenset(), True, 1))
                    feats = torch.zeros(n, width, dtype=torch.bfloat16, device=device)
                    stage_commit(seq, 1, PendingCommit([1] * n, 0, feats))
                    _sync(device)
                    time.sleep(gap_ms / 1e3)
                    t0 = time.perf_counter()
                    client.draft([(seq, 1)], vocab_size=shape["vocab"])
                    times.append((time.perf_counter() - t0) * 1e3)
                chunks = -(-n * width * 2 // client.chunk_bytes) - 1  # pieces ahead of the Draft
                path = "grpc" if client.local is None else ("device" if on_device else "shared")
                row = dict(commit=n, gap_ms=gap_ms, path=path, asked=ask, transport_ms=statistics.median(times),
                           feature_bytes=n * width * 2, chunks_ahead=chunks)  # fmt: skip
                rows.append(row)
                on_row(out)
                log(f"{n:>7} {gap_ms:>6} {path:>6} {row['transport_ms']:>12.3f} {row['feature_bytes'] / 1e6:>10.2f}")
            client.close()
    finally:
        stop.set()
        drafter.join(timeout=30)


def _trees(vocab: int, device: torch.device, log, out: dict, deadline: float, on_row) -> None:
    from ddtree.tree.best_first import build_tree, topk_logprobs
    from ddtree.tree.device_build import build_trees

    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(TREE_SEQS * TREE_DEPTH, vocab, generator=g, device=device) * 4
    rows = out["tree"]
    log(f"{'budget':>6} {'device ms':>9} {'host ms':>8} {'equal':>5}")
    for budget in TREE_BUDGETS:
        if time.perf_counter() > deadline:
            out["skipped"] += 1
            continue
        timed = {}
        for where in ("device", "host"):
            for _ in range(3):  # the last of three: caches warm
                _sync(device)
                t0 = time.perf_counter()
                lp, ids = topk_logprobs(logits, budget)
                lp, ids = lp.view(TREE_SEQS, TREE_DEPTH, -1), ids.view(TREE_SEQS, TREE_DEPTH, -1)
                if where == "device":
                    trees = build_trees(lp, ids, [budget] * TREE_SEQS)
                else:
                    lp, ids = lp.cpu(), ids.cpu()
                    trees = [build_tree(lp[s], ids[s], budget) for s in range(TREE_SEQS)]
                _sync(device)
                timed[where] = ((time.perf_counter() - t0) * 1e3, trees)
        equal = timed["device"][1] == timed["host"][1]
        out["mismatches"] += not equal
        rows.append(dict(budget=budget, device_ms=timed["device"][0], host_ms=timed["host"][0], equal=equal))
        on_row(out)
        log(f"{budget:>6} {timed['device'][0]:>9.3f} {timed['host'][0]:>8.3f} {str(equal):>5}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

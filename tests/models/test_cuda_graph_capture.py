"""GraphRunner.capture's memory order (models/runtime/cuda_graphs.py), which verifier/kv/graph_pool.py's
WARMUP_COPIES = 1 rests on: every warm-up ends and its cached blocks go back before the shared pool takes
its first block, so start-up never holds a warm-up's intermediates beside the pool's.

The CPU has no CUDA graphs: `torch.cuda` is replaced by a ledger of the caching allocator as the runner
drives it. A forward outside a capture leaves its intermediates cached until `empty_cache`; inside a
capture they land in the graphs' private pool, which keeps its blocks and reuses them across captures
(so it peaks at the largest bucket's). The ledger's peak is the most start-up held at once."""

from __future__ import annotations

import contextlib
import types

import torch

from ddtree.models.runtime import cuda_graphs

PEAK = {1: 10, 4: 40, 8: 70, 16: 100}  # bucket -> bytes of its forward's intermediates


class AllocatorLedger:
    def __init__(self):
        self.cached = 0  # general caching allocator: blocks kept after the warm-ups free them
        self.pool = 0  # the graphs' private pool
        self.peak = 0
        self.capturing = False
        self.events: list[tuple[str, int | None]] = []

    def forward_allocates(self, nbytes: int) -> None:
        if self.capturing:
            self.pool = max(self.pool, nbytes)
        else:
            self.cached = max(self.cached, nbytes)
        self.peak = max(self.peak, self.pool + self.cached)

    def fake_cuda(self) -> types.SimpleNamespace:
        ledger = self

        class Graph:
            def replay(self):
                ledger.events.append(("replay", None))

        @contextlib.contextmanager
        def graph(_graph, pool=None, capture_error_mode="global"):
            assert pool == "pool-handle"
            ledger.capturing = True
            yield
            ledger.capturing = False

        def empty_cache():
            ledger.cached = 0
            ledger.events.append(("empty_cache", None))

        stream = types.SimpleNamespace(wait_stream=lambda other: None)
        return types.SimpleNamespace(
            synchronize=lambda: None,
            memory_reserved=lambda: ledger.pool + ledger.cached,
            graph_pool_handle=lambda: "pool-handle",
            Stream=lambda: stream,
            current_stream=lambda: stream,
            stream=lambda s: contextlib.nullcontext(),
            empty_cache=empty_cache,
            CUDAGraph=Graph,
            graph=graph,
        )


def _runner(monkeypatch) -> tuple[cuda_graphs.GraphRunner, AllocatorLedger]:
    ledger = AllocatorLedger()
    monkeypatch.setattr(
        cuda_graphs, "torch", types.SimpleNamespace(cuda=ledger.fake_cuda(), inference_mode=torch.inference_mode)
    )

    def forward(bucket: int) -> str:
        ledger.events.append(("capture" if ledger.capturing else "warm-up", bucket))
        ledger.forward_allocates(PEAK[bucket])
        return f"out-{bucket}"

    return cuda_graphs.GraphRunner("test", forward), ledger


def test_start_up_holds_one_largest_forward_at_a_time(monkeypatch):
    runner, ledger = _runner(monkeypatch)
    runner.capture([4, 16, 1, 8])
    assert runner.captured == 4
    assert ledger.peak == max(PEAK.values()), (
        f"start-up held {ledger.peak}, the largest forward is {max(PEAK.values())}"
    )
    assert runner.pool_bytes == max(PEAK.values())


def test_every_warm_up_precedes_the_first_capture_and_captures_go_largest_first(monkeypatch):
    runner, ledger = _runner(monkeypatch)
    runner.capture([4, 16, 1, 8])
    kinds = [kind for kind, _ in ledger.events]
    first_capture = kinds.index("capture")
    assert set(kinds[:first_capture]) == {"warm-up", "empty_cache"} and kinds[first_capture - 1] == "empty_cache"
    assert set(kinds[first_capture:]) == {"capture"}
    assert sorted(b for kind, b in ledger.events if kind == "warm-up") == sorted([1, 4, 8, 16] * 2)
    assert [b for kind, b in ledger.events if kind == "capture"] == [16, 8, 4, 1]


def test_run_replays_a_captured_bucket_and_runs_any_other_eagerly(monkeypatch):
    runner, ledger = _runner(monkeypatch)
    runner.capture([8])
    ledger.events.clear()
    assert runner.run(8) == "out-8" and ledger.events == [("replay", None)]
    assert runner.run(4) == "out-4" and ledger.events[-1] == ("warm-up", 4)  # no graph: the forward itself

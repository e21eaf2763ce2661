"""CUDA graphs of a static-shape forward, one per bucket: the one capture / replay code of the verifier's
static step (verifier/step/static_step.py) and the drafter's static draft (drafter/static_draft.py).

`GraphRunner(name, forward)`, where `forward(bucket)` runs the forward over that bucket's fixed buffers
and returns its outputs:
- `capture(buckets)`: first every bucket's warm-up, two runs each on a side stream (the allocator, cuBLAS
  and Triton's compile and autotune caches fill here, outside any graph), the warm-ups' cached blocks
  handed back once all are done; then every bucket's capture, largest first, into one memory pool shared
  by all of them (a forward's intermediates are freed at the end of its capture, so the pool peaks at the
  largest bucket's). No warm-up runs while the pool holds anything, so start-up needs one largest forward's
  intermediates at a time, not two (verifier/kv/graph_pool.py: WARMUP_COPIES). Logs the seconds and the
  bytes the pool took (`{name}_cuda_graphs_captured`).
- `run(bucket)`: replays the bucket's graph and returns the captured outputs, which the next replay
  overwrites (copy or index what must outlive it); a bucket without a graph (nothing captured: the CPU,
  or `--cuda-graphs on` there) runs `forward(bucket)` directly, over the same buffers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

import torch

from ddtree.telemetry.logging import get_logger

log = get_logger("ddtree.models.runtime.cuda_graphs")
BucketT = TypeVar("BucketT")
OutputT = TypeVar("OutputT")


class GraphRunner(Generic[BucketT, OutputT]):
    def __init__(self, name: str, forward: Callable[[BucketT], OutputT]):
        self.name, self.forward = name, forward
        self._graphs: dict[BucketT, tuple[torch.cuda.CUDAGraph, OutputT]] = {}
        self.pool_bytes = 0

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def capture(self, buckets: Iterable[BucketT]) -> float:
        """Capture a graph per bucket (see the module docstring); returns the seconds it took."""
        buckets = sorted(buckets, reverse=True)
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for b in buckets:
                for _ in range(2):
                    self.forward(b)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the warm-ups' blocks, before the pool takes its first
        for b in buckets:
            graph = torch.cuda.CUDAGraph()
            # thread_local: the process's other threads (the drafter pool's resolver opening a replica, its
            # feature ring's device buffer and events) may call CUDA meanwhile without spoiling this capture.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"), torch.inference_mode():
                out = self.forward(b)
            self._graphs[b] = (graph, out)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        self.pool_bytes = max(0, torch.cuda.memory_reserved() - reserved)
        log.info(f"{self.name}_cuda_graphs_captured", buckets=len(buckets), seconds=round(seconds, 2),
                 pool_bytes=self.pool_bytes)  # fmt: skip
        return seconds

    def run(self, bucket: BucketT) -> OutputT:
        got = self._graphs.get(bucket)
        if got is None:
            return self.forward(bucket)
        graph, out = got
        graph.replay()
        return out

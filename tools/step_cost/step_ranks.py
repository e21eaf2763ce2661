"""Real tensor-parallel ranks for `ddtree bench step --tp N`: this process is rank 0, N - 1 spawned processes
are the others, each building its own shard of the same model (its heads, expert columns or experts, its
vocabulary slice; random weights drawn on its device) and running the verifier's worker loop
(verifier/tp_worker.py) until rank 0 stops it. Rank 0 measures: its step, its launches and syncs, the
collectives it takes part in, now with their wire time (gloo on the CPU, NCCL over the GPUs present).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile

import torch
import torch.multiprocessing as mp

from ddtree.models.parallel.process_group import destroy_tp, init_tp, rank_device

TIMEOUT_S = 600.0


@contextlib.contextmanager
def rank_group(spec, timeout_s: float = TIMEOUT_S):
    """Rank 0's TPGroup of spec.tp ranks, the others spawned here; on exit (after rank 0's handle sent
    STOP) the workers are joined and the group torn down."""
    if spec.device.startswith("cuda") and torch.cuda.device_count() < spec.tp:
        raise ValueError(f"--tp {spec.tp} needs {spec.tp} GPUs, this machine has {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory(prefix="bench-step-tp-") as work:
        init = f"file://{os.path.join(work, 'store')}"
        ctx = mp.get_context("spawn")
        workers = [ctx.Process(target=_worker, args=(r, spec, init, timeout_s), daemon=True) for r in range(1, spec.tp)]
        for w in workers:
            w.start()
        tp = init_tp(spec.tp, 0, rank_device(spec.device, 0), timeout_s, init_method=init)
        try:
            yield tp
        finally:
            for w in workers:
                w.join(timeout=60)
                if w.is_alive():
                    w.kill()
            destroy_tp()


def _worker(rank: int, spec, init: str, timeout_s: float) -> None:
    from ddtree.tools.step_cost.step_model import build_model
    from ddtree.verifier.tp_worker import worker_loop

    torch.set_num_threads(1)
    tp = init_tp(spec.tp, rank, rank_device(spec.device, rank), timeout_s, init_method=init)
    model = build_model(dataclasses.replace(spec, rank=rank, device=str(rank_device(spec.device, rank))), tp)
    worker_loop(model, tp)
    destroy_tp()
    os._exit(0)  # gloo's threads at interpreter teardown sometimes abort (std::terminate)

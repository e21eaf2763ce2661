"""The tensor-parallel collectives of a measured step: counted per kind, and the one-rank group that an
emulated rank (`--emulate-tp N`) runs them in.

Counts are calls of the group's methods (services/models/parallel/process_group.py `TPGroup`):
`all_reduce` (after attention, after the MLP, in the vocab-parallel embedding), `all_gather` (the
sharded argmax, sampled logits), `broadcast_cpu` (rank 0's step message, host) and `broadcast_device`
(a device broadcast; the step's control path has none). In a one-rank group each
call still runs (gloo on the CPU, NCCL on CUDA), so the step pays its launch, not the wire.
"""

from __future__ import annotations

import collections
import contextlib

import torch
import torch.distributed as dist

from ddtree.models.parallel.process_group import TPGroup, destroy_tp, init_tp, rank_device

COUNTED = ("all_reduce", "all_gather", "broadcast_cpu", "broadcast_device")


@contextlib.contextmanager
def count_collectives(counts: collections.Counter):
    """While active, every TPGroup.all_reduce / all_gather / broadcast_cpu / broadcast_device call adds 1 to
    counts[name]."""
    originals = {name: getattr(TPGroup, name) for name in COUNTED}

    def wrap(name, original):
        def counted(self, *args, **kwargs):
            counts[name] += 1
            return original(self, *args, **kwargs)

        return counted

    for name, original in originals.items():
        setattr(TPGroup, name, wrap(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(TPGroup, name, original)


@contextlib.contextmanager
def one_rank_group(device: torch.device, timeout_s: float = 600.0):
    """A torch.distributed group of world size 1 on this process (gloo, or NCCL + gloo on CUDA), torn
    down on exit. Its rendezvous is an in-process store: no TCP store and no server thread."""
    tp = init_tp(1, 0, rank_device(str(device), 0), timeout_s, store=dist.HashStore())  # cuda -> cuda:0
    try:
        yield tp
    finally:
        destroy_tp()

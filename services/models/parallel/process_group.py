"""The tensor-parallel group: N ranks under torch.distributed (docs/design.md §7.5).

Activations (the all-reduces after attention and MLP, the vocab-parallel embedding, the argmax
combine) go over `device_group`: NCCL on CUDA, gloo on CPU. The per-step broadcast of forward inputs
from rank 0 is small host data and goes over `cpu_group` (gloo; the same group on CPU).

Ranks on several nodes are launched with the standard torch.distributed variables MASTER_ADDR,
MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK (`launch_env`); these describe the launch, not the service
configuration, so they are read here and nowhere else. A verifier started without them spawns its other
local ranks itself (services/verifier/tp_worker.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    master_addr: str
    master_port: int
    world_size: int
    rank: int
    local_rank: int


def launch_env() -> LaunchEnv | None:
    """The launcher's rank description, or None when RANK / WORLD_SIZE are not set."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return LaunchEnv(
        master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(os.environ.get("MASTER_PORT", "29500")),
        world_size=int(os.environ["WORLD_SIZE"]),
        rank=int(os.environ["RANK"]),
        local_rank=int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_device(device: str, local_rank: int) -> torch.device:
    """cuda -> cuda:LOCAL_RANK (one GPU per local rank); anything else unchanged."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", local_rank)
    return d


@dataclasses.dataclass(frozen=True, eq=False)
class TPGroup:
    rank: int
    world_size: int
    device_group: object  # torch.distributed ProcessGroup for activations
    cpu_group: object  # gloo ProcessGroup for the per-step broadcast
    # [int64 buffer]: the per-step message buffer (step_message.py), the same capacity on every rank
    step_buffer: list = dataclasses.field(default_factory=lambda: [None], repr=False)

    # Row invariance (docs/design.md): the sum over ranks in rank order, element by element, from an exact
    # all-gather. NCCL's all_reduce picks ring or tree and its protocol by message size, and a ring assigns
    # each element the rank its sum starts from by the element's chunk, i.e. by the row count: a row's sum
    # would depend on how many rows share the step. False: dist.all_reduce (fewer bytes; not row invariant).
    ordered_reduce: bool = True

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns x. ordered_reduce: ((x_0 + x_1) + x_2) + ... in fp32 for every
        element, whatever its row and the message size, then x's dtype; the same result on every rank."""
        if not self.ordered_reduce or self.world_size == 1:
            dist.all_reduce(x, group=self.device_group)
            return x
        flat = torch.empty(self.world_size * x.numel(), dtype=x.dtype, device=x.device)  # gloo wants it flat
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the newer name first
        gather(flat, x.contiguous().view(-1), group=self.device_group)
        parts = flat.view(self.world_size, *x.shape)
        acc = parts[0].float()
        for i in range(1, self.world_size):
            acc += parts[i]
        x.copy_(acc)
        return x

    def reduce_ops(self, world_size: int) -> int:
        """Torch ops one all_reduce runs on a rank of a `world_size` group besides its collective: ordered, the
        fp32 copy of part 0, world_size - 1 adds and the copy back; else none (what `ddtree bench step`
        counts: an emulated rank runs a one-rank group's plain all_reduce)."""
        return world_size + 1 if self.ordered_reduce and world_size > 1 else 0

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[*s] on every rank -> [N, *s], rank order."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.stack(parts)

    def broadcast_device(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's device tensor x into every rank's x of the same shape (NCCL on CUDA, gloo on the CPU)."""
        dist.broadcast(x, src=0, group=self.device_group)
        return x

    def broadcast_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's CPU tensor x to every rank (x is filled in place on the others)."""
        dist.broadcast(x, src=0, group=self.cpu_group)
        return x


def rendezvous_store(host: str, world_size: int, timeout_s: float, port: int | None = None) -> dist.TCPStore:
    """port None: rank 0's store, on a port the OS picks (bound before the spawned ranks are told it, so no
    port race); else a client of the store at host:port."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if port is None:
        return dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)


def init_tp(
    world_size: int,
    rank: int,
    device: torch.device,
    timeout_s: float,
    *,
    init_method: str | None = None,
    store: dist.Store | None = None,
    ordered_reduce: bool = True,  # TPGroup.ordered_reduce (the verifier's --row-invariant)
) -> TPGroup:
    """Join the group through `init_method` (tcp://host:port, file://...) or rank 0's `store`; blocks
    until all ranks have joined, at most timeout_s.

    Every collective then fails after timeout_s instead of waiting forever for a dead or stuck peer;
    rank 0 keeps idle peers alive with pings (tp_model.TensorParallelModel).
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=init_method, store=store, world_size=world_size, rank=rank, timeout=timeout
    )
    world = dist.group.WORLD
    cpu = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return TPGroup(rank=rank, world_size=world_size, device_group=world, cpu_group=cpu, ordered_reduce=ordered_reduce)


def destroy_tp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

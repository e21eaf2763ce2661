"""The drafter's config: its checkpoints, context window, budgets and device, and the groups it shares by
inheritance (static draft blocks, CPU runtime, service)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from .cpu_runtime import CpuRuntimeFields
from .device import AutoDtype, on_cpu
from .flags import option
from .service import ServiceConfig
from .static_step import DraftStaticFields

# --window auto (-1), by device. On the CPU the window's attention lies on every draft's path, so a shorter
# window pays there; on CUDA it costs little, and drafters use their context.
CUDA_WINDOW = 2048
CPU_WINDOW = 512
LocalChannel = Literal["auto", "off"]


@dataclasses.dataclass(frozen=True)
class DrafterConfig(DraftStaticFields, CpuRuntimeFields, ServiceConfig):
    flag_group = "drafter"

    model: str = option("", "drafter checkpoint dir ('' = the default checkpoint)")
    target: str = option("", "target checkpoint dir, for its embedding and lm_head ('' = the default checkpoint)")
    window: int = option(
        -1,
        f"draft context window in tokens (0 = unlimited; -1 = auto: {CUDA_WINDOW} on CUDA, {CPU_WINDOW} on the "
        "CPU, where the window's attention lies on every draft's path)",
        at_least=-1,
    )
    default_budget: int = option(16, "tree node budget of a request that sets none (at most --max-budget)")
    max_budget: int = option(1024, "largest tree budget accepted")
    max_sequences: int = option(
        4096,
        "draft contexts held at once; a Draft that would start more answers RESOURCE_EXHAUSTED, and a verifier "
        "sends a replica at its cap no new sequences (they decode autoregressively)",
        at_least=1,
    )
    context_lease_s: float = option(
        120.0,
        "seconds a draft context is kept with no call touching it (a crashed verifier's sequences); a verifier "
        "that restarts under the same --instance-name has its former contexts released at once",
        above=0,
    )
    local_channel: LocalChannel = option(
        "auto",
        "auto = also serve Draft calls on a Unix socket, for a verifier on this host, features through its "
        "ring (its GPU buffer, mapped over CUDA IPC, when both run on GPUs; else shared memory; not with a "
        "service token or TLS: those calls go through gRPC); off = gRPC only",
    )
    device: str = option("cpu", "torch device (cpu, cuda, cuda:N)")
    tp: int = option(
        1,
        "tensor-parallel ranks of the drafter (torch.distributed, spawned locally; rank 0 serves): heads, MLP "
        "columns and the target's vocabulary split, placed beside a verifier of the same --tp, drafter rank r "
        "on cuda:r (ddtree inspect --drafter plans it); above 1 the block forwards run eagerly",
        at_least=1,
    )
    dtype: AutoDtype = option(
        "auto",
        "compute dtype (auto = bfloat16 where matmuls have it natively: CUDA, AVX512-BF16 / AMX CPUs; else float32)",
    )
    warmup_sequences: int = option(
        16,
        "before serving, run the matmul shapes of Draft calls of up to this many sequences once (0 = none): "
        "bf16 kernels on the CPU are built per shape, within the first steps otherwise",
        at_least=0,
    )

    def validate(self) -> None:
        super().validate()
        if self.cuda_graphs == "on" and self.tp > 1:
            raise ValueError("--cuda-graphs on: draft graphs are captured at --tp 1 only (above, forwards are eager)")
        if self.cuda_graphs == "on" and self.window == 0:
            raise ValueError("--cuda-graphs on needs a bounded --window (contexts are padded to it); got 0")
        if not 1 <= self.default_budget <= self.max_budget:
            raise ValueError(f"default_budget must be in [1, max_budget={self.max_budget}], got {self.default_budget}")

    def resolved_window(self) -> int:
        """--window with auto (-1) resolved by device: CPU_WINDOW on the CPU, CUDA_WINDOW elsewhere."""
        if self.window != -1:
            return self.window
        return CPU_WINDOW if on_cpu(self.device) else CUDA_WINDOW

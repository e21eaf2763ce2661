"""The verifier's config: its own fields (target, batch and queue limits, device), tensor parallelism, and
the groups it shares by inheritance (KV cache, speculation, static steps, CPU runtime, service)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from .cpu_runtime import CpuRuntimeFields
from .device import Dtype
from .flags import ConfigBase, option
from .kv import KvFields
from .service import ServiceConfig
from .speculation import SpeculationFields
from .static_step import StaticStepFields


@dataclasses.dataclass(frozen=True)
class TensorParallelFields(ConfigBase):
    flag_group = "tensor parallelism"

    tp: int = option(
        1, "tensor-parallel ranks (torch.distributed; spawned locally unless RANK / WORLD_SIZE are set)", at_least=1
    )
    expert_parallel: bool = option(
        False, "with --tp above 1: each rank holds 1/tp of the routed experts whole, instead of a slice of each"
    )
    tp_timeout_s: float = option(
        60.0,
        "with --tp above 1: a collective waiting longer than this for a peer fails and the verifier exits",
        above=0,
    )


@dataclasses.dataclass(frozen=True)
class VerifierConfig(
    KvFields, SpeculationFields, StaticStepFields, CpuRuntimeFields, TensorParallelFields, ServiceConfig
):
    flag_group = "verifier"

    model: str = option("", "target checkpoint dir ('' = the default checkpoint)")
    max_context: int = option(8192, "prompt + output tokens of one request", at_least=1)
    max_new_tokens_limit: int = option(4096, "largest max_new_tokens a request may ask for", at_least=1)
    max_batch: int = option(16, "sequences stepped together", at_least=1)
    max_queue: int = option(
        256,
        "requests admitted beyond max_batch: with more than max_batch + max_queue running or waiting, a new "
        "one gets RESOURCE_EXHAUSTED",
        at_least=0,
    )
    prefill_chunk: int = option(512, "prefill chunk in tokens", at_least=1)
    step_log: str = option("", "step records: '' = the service log (level info), off = none, PATH = a JSON-lines file")
    attention_backend: Literal["auto", "torch", "triton"] = option(
        "auto", "the attention kernels (auto = triton on CUDA where it is installed, else torch)"
    )
    row_invariant: Literal["on", "off"] = option(
        "on",
        "on: a row's logits do not depend on the rows beside it (the Triton attention splits each row by its "
        "own context; at --tp above 1 the all-reduce sums in rank order from an all-gather), so greedy DDTree "
        "equals AR bit for bit; off: the attention's throughput plan for eager steps (splits from the step's "
        "work over the SMs) and NCCL's all-reduce (fewer bytes), and DDTree may leave AR on near-ties. The "
        "static step's attention plan is row invariant either way",
    )
    device: str = option("cpu", "torch device (cpu, cuda, cuda:N)")
    dtype: Dtype = option("float32", "dtype of the target's weights and activations, and so of the output")

    def validate(self) -> None:
        super().validate()
        if self.draft_deadline_floor_s > self.draft_timeout_s:
            raise ValueError(
                f"--draft-deadline-floor-s ({self.draft_deadline_floor_s}) exceeds --draft-timeout-s "
                f"({self.draft_timeout_s})"
            )
        if self.tp > 1 and self.page_size > 1:
            raise ValueError(
                "page_size > 1 is not supported with tp > 1: the KV copies at commit would reach rank 0's cache only"
            )

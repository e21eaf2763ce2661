"""Static shapes: the verifier's steps and the drafter's blocks at bucketed shapes, as CUDA graphs on CUDA.

Both engines choose with --cuda-graphs (auto | on | off); the rules that involve other groups' fields
(the verifier's --tp, the drafter's --window) are in their service configs."""

from __future__ import annotations

import dataclasses

from .flags import AutoOnOff, ConfigBase, option


@dataclasses.dataclass(frozen=True)
class StaticStepFields(ConfigBase):
    """The verifier's verify / decode steps at static shapes."""

    flag_group = "static steps"

    cuda_graphs: AutoOnOff = option(
        "auto",
        "verify / decode steps at static shapes (batch x rows x keys buckets), captured as CUDA graphs at "
        "start-up on CUDA, through the same forward and kernels as an eager step; a step outside every bucket "
        "runs eagerly; at --tp N every rank captures and replays the same buckets. auto = on for CUDA, off "
        "elsewhere (the log says why); on = also on the CPU, where the static buffers run without graphs",
    )
    cuda_graph_reserve_gb: float = option(
        0.0,
        "GiB kept free for the CUDA graphs' memory pool when --kv-memory-fraction sizes the KV cache (0 = "
        "estimated from the model and the buckets; the start-up log's kv_pool line gives graph_reserve_bytes)",
        at_least=0,
    )


@dataclasses.dataclass(frozen=True)
class DraftStaticFields(ConfigBase):
    """The drafter's block forwards at static shapes."""

    flag_group = "static draft blocks"

    cuda_graphs: AutoOnOff = option(
        "auto",
        "draft block forwards at static shapes (sequences x context-rows buckets up to the window), captured "
        "as CUDA graphs at start-up on CUDA; a call outside every bucket runs eagerly. auto = on for CUDA "
        "with a bounded --window, else eager (the log says why); on = required: needs a bounded --window, or "
        "the drafter refuses to start (on the CPU the static buffers run without graphs)",
    )

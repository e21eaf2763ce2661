"""A memory plan per GPU: what each process puts on it, whether it fits, and the largest KV pool that would.

Pure arithmetic over byte counts that the engines' own sizing code supplies (verifier/kv/memory_check.py,
drafter/memory_check.py; `ddtree inspect --device-memory-gb` puts the two together, the drafter on GPU 0):

    verifier rank  weights (models/checkpoint/weight_bytes.py: the dtypes the loader keeps) + latent KV pool +
                   activations of its largest eager forward + CUDA graph pools + runtime reserve (+ NCCL)
    drafter        weights + its copy of the target's embedding and LM head + draft contexts +
                   activations + CUDA graph buffers and pool + runtime reserve
    drafter rank   at --tp N (co-located: drafter rank r on verifier rank r's GPU, drafter_rank_shape):
                   1/N of its heads, KV heads and MLP columns, fc split by input rows, norms whole; a
                   vocabulary shard of the target's embedding and LM head; 1/N of its contexts; its own
                   NCCL reserve (a second communicator); no draft graphs (eager at TP > 1)

The reserves are planning margins, not measurements: RUNTIME_RESERVE_BYTES per process on a GPU (the CUDA
context and loaded kernels, cuBLAS and Triton workspaces, the caching allocator's slack) and
NCCL_RESERVE_BYTES per rank above TP 1 (NCCL's channel buffers to its peers). `ddtree selftest gpu`
compares what the plan admits with what the device reports (docs/measurements/).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ddtree.models.dflash.model import DFlashDraftModel

GIB = 1 << 30
RUNTIME_RESERVE_BYTES = 2 * GIB
NCCL_RESERVE_BYTES = 1 * GIB


class MemoryPlanError(ValueError):
    """A plan that does not fit: the message is the plan, GPU by GPU, and what to change."""


@dataclasses.dataclass(frozen=True)
class PlanItem:
    owner: str  # "verifier rank 0", "drafter"
    what: str  # "weights", "KV pool", ...
    bytes: int


@dataclasses.dataclass(frozen=True)
class GpuPlan:
    index: int
    device_bytes: int  # what the plan may use on this GPU (total memory, or free memory at start)
    items: tuple[PlanItem, ...]

    @property
    def used(self) -> int:
        return sum(i.bytes for i in self.items)

    @property
    def headroom(self) -> int:
        return self.device_bytes - self.used

    @property
    def kv_bytes(self) -> int:
        return sum(i.bytes for i in self.items if i.what == KV_ITEM)


KV_ITEM = "KV pool"


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    gpus: tuple[GpuPlan, ...]
    kv_bytes_per_token: int  # of one rank's pool (the latent cache is replicated on every rank)
    kv_tokens: int
    page_size: int = 1
    device_label: str = "device"  # how device_bytes was obtained: "device" (given) or "free at start"

    @property
    def fits(self) -> bool:
        return all(g.headroom >= 0 for g in self.gpus)

    @property
    def tightest(self) -> GpuPlan:
        return min(self.gpus, key=lambda g: (g.headroom, g.index))

    @property
    def largest_kv_tokens(self) -> int:
        """The largest pool (same on every rank) that leaves every GPU holding a rank within its memory."""
        ranks = [g for g in self.gpus if any(i.what == KV_ITEM for i in g.items)]
        if not ranks or self.kv_bytes_per_token <= 0:
            return 0
        room = min(g.headroom + g.kv_bytes for g in ranks)
        tokens = max(0, room // self.kv_bytes_per_token)
        return tokens - tokens % self.page_size


def gpu_plan(index: int, device_bytes: int, *groups: tuple[PlanItem, ...]) -> GpuPlan:
    return GpuPlan(index, int(device_bytes), tuple(i for g in groups for i in g if i.bytes))


def verifier_rank_items(
    rank: int,
    tp: int,
    weights: int,
    kv: int,
    activations: int,
    graphs: int,
    runtime: int = RUNTIME_RESERVE_BYTES,
    feature_ring: int = 0,
) -> tuple[PlanItem, ...]:
    """feature_ring: the co-located drafter channel's ring on this rank's GPU (protocol/feature_ring.py; rank 0's)."""
    owner = f"verifier rank {rank}" if tp > 1 else "verifier"
    items = [
        PlanItem(owner, "weights", weights),
        PlanItem(owner, KV_ITEM, kv),
        PlanItem(owner, "activations", activations),
        PlanItem(owner, "CUDA graph pools", graphs),
        PlanItem(owner, "runtime reserve", runtime),
    ]
    if feature_ring:
        items.append(PlanItem(owner, "drafter feature ring", feature_ring))
    if tp > 1:
        items.append(PlanItem(owner, "NCCL reserve", NCCL_RESERVE_BYTES))
    return tuple(items)


@dataclasses.dataclass(frozen=True)
class DrafterShape:
    """What the drafter's memory depends on: its parameters and attention widths, the target's head."""

    params: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    block_size: int
    vocab: int
    target_hidden: int
    tp: int = 1  # ranks the drafter is split over; the widths above are then one rank's (rank 0's, the largest)


# DFlash weights split under tensor parallelism, by name suffix -> the dimension split (torch [out, in]):
# heads and MLP columns by output rows, o_proj / down_proj by input columns, fc by input rows (its partial
# products summed once per commit); norms (q_norm / k_norm per head, the layer norms) are whole on every rank.
DRAFTER_SPLIT_DIMS = {
    "q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0, "gate_proj.weight": 0, "up_proj.weight": 0,
    "o_proj.weight": 1, "down_proj.weight": 1, "fc.weight": 1,
}  # fmt: skip


def split_dim(name: str) -> int | None:
    """The dimension of drafter weight `name` split across TP ranks (None: held whole)."""
    return next((d for suffix, d in DRAFTER_SPLIT_DIMS.items() if name.endswith(suffix)), None)


def drafter_shape(cfg, tp: int = 1) -> DrafterShape:
    """From a DFlashConfig (models/dflash/config.py): parameters counted on a meta model; at tp > 1 rank 0's
    share (ceil of each split dimension / tp; KV heads at least one per rank, replicated below tp)."""
    if tp < 1:
        raise ValueError(f"drafter tp must be >= 1, got {tp}")
    with torch.device("meta"):
        state = DFlashDraftModel(cfg).state_dict()
    params = 0
    for name, t in state.items():
        dim = split_dim(name) if tp > 1 else None
        params += t.numel() if dim is None else t.numel() // t.shape[dim] * math.ceil(t.shape[dim] / tp)
    share = lambda n: math.ceil(n / tp)  # noqa: E731
    return DrafterShape(
        params, cfg.num_hidden_layers, share(cfg.num_attention_heads), share(cfg.num_key_value_heads),
        cfg.head_dim, cfg.hidden_size, share(cfg.intermediate_size), cfg.block_size, share(cfg.vocab_size),
        cfg.target_hidden_size, tp,
    )  # fmt: skip


def drafter_items(
    d: DrafterShape,
    dtype_bytes: int,
    window: int,
    sequences: int,
    graph_sequences: int,
    graphs: bool,
    runtime: int = RUNTIME_RESERVE_BYTES,
    rank: int = 0,
) -> tuple[PlanItem, ...]:
    """The drafter's bytes on its GPU (a DrafterShape of tp > 1: drafter rank `rank`'s, widths and vocabulary
    its shard; logits are over its vocabulary shard, the top-k merged across ranks). Contexts: per sequence
    and layer one K and one V buffer of 2 x window rows (drafter/context.py doubles a window's capacity);
    graph buffers: the largest bucket's context copy
    (graph_sequences x window rows, drafter/static_draft.py) and its block inputs."""
    s, kv_row = dtype_bytes, d.kv_heads * d.head_dim
    contexts = sequences * d.layers * 2 * (2 * window) * kv_row * s
    S, C, B = graph_sequences, window, d.block_size
    T = S * B
    # one draft forward at the largest bucket: K/V of context + block (cat), fp32 scores and their softmax,
    # one layer's q / o / MLP intermediates, fp32 logits over the vocabulary and their top-k copy
    activations = (
        2 * S * (C + B) * kv_row * s * 2
        + 2 * S * d.heads * B * (C + B) * 4
        + T * (2 * d.heads * d.head_dim + 3 * d.intermediate + 4 * d.hidden) * s
        + T * d.vocab * (s + 4)
    )
    buffers = d.layers * 2 * S * C * kv_row * s + T * d.hidden * s if graphs else 0
    owner = f"drafter rank {rank}" if d.tp > 1 else "drafter"
    head = f"target embedding + LM head (1/{d.tp} vocab)" if d.tp > 1 else "target embedding + LM head copy"
    items = (
        PlanItem(owner, "weights", d.params * s),
        PlanItem(owner, head, 2 * d.vocab * d.target_hidden * s),
        PlanItem(owner, f"draft contexts ({sequences} x window {window})", contexts),
        PlanItem(owner, "activations", activations),
        PlanItem(owner, "CUDA graph buffers + pool", buffers + (math.ceil(1.25 * activations) if graphs else 0)),
        PlanItem(owner, "runtime reserve", runtime),
    )
    return items + ((PlanItem(owner, "NCCL reserve", NCCL_RESERVE_BYTES),) if d.tp > 1 else ())


def _gb(n: int) -> str:
    return f"{n / 1e9:7.2f}"


def format_plan(plan: MemoryPlan) -> str:
    """GPU by GPU: every item in GB (1e9 B), the total, the headroom; then the tightest GPU and the KV."""
    lines = [f"{'GPU':<5}{'owner':<18}{'item':<40}{'GB':>8}"]
    for g in plan.gpus:
        for n, i in enumerate(g.items):
            lines.append(f"{g.index if n == 0 else '':<5}{i.owner:<18}{i.what:<40}{_gb(i.bytes):>8}")
        state = "fits" if g.headroom >= 0 else "DOES NOT FIT"
        lines.append(
            f"{'':<5}{'':<18}{'total / ' + plan.device_label:<40}{_gb(g.used):>8} / {_gb(g.device_bytes).strip()}"
            f"   headroom {_gb(g.headroom).strip()}  {state}"
        )
    t = plan.tightest
    kv_max = plan.largest_kv_tokens
    lines.append(f"tightest GPU {t.index}: headroom {t.headroom / 1e9:.2f} GB")
    if not plan.kv_bytes_per_token:
        return "\n".join(lines)
    lines.append(
        f"KV pool {plan.kv_tokens:,} tokens ({plan.kv_tokens * plan.kv_bytes_per_token / GIB:.2f} GiB per rank); "
        f"largest that fits {kv_max:,} tokens ({kv_max * plan.kv_bytes_per_token / GIB:.2f} GiB per rank, "
        f"--kv-memory-gb {math.floor(kv_max * plan.kv_bytes_per_token / GIB * 100) / 100:g})"
    )
    return "\n".join(lines)


def check_plan(plan: MemoryPlan, service: str) -> None:
    """MemoryPlanError with the whole plan in its message when any GPU is over."""
    if plan.fits:
        return
    over = [g for g in plan.gpus if g.headroom < 0]
    raise MemoryPlanError(
        f"{service}: the memory plan does not fit on GPU {', '.join(str(g.index) for g in over)} "
        f"(short by {max(-g.headroom for g in over) / 1e9:.2f} GB); refusing to start before reading any "
        "weight. Lower the KV pool (--kv-memory-gb / --kv-tokens), --max-batch or the window, or use more GPUs.\n"
        + format_plan(plan)
    )

"""The verify / decode forward at static shapes: buckets, their buffers, CUDA graphs.

A bucket is (batch B, rows per sequence Q, keys per sequence K). A step fits the smallest bucket with
B >= its sequences, Q >= its longest item (tree root + nodes, an AR row, a prefill chunk) and
K >= its longest prefix + that item. Its inputs are copied into the bucket's `StaticBatch`
(models/runtime/static_batch.py: one packed transfer), and the model's own forward runs over those buffers:
the same code as the eager step (the same attention backend, MoE and kernels), with no host
synchronisation and no data-dependent shape inside, so on CUDA each bucket is a captured graph
(models/runtime/cuda_graphs.py: one memory pool for all buckets, captured at start-up) and a step is
copy-in + replay. Any model runs this way (packed or bf16 experts, any number of them). A step that
fits no bucket runs the eager forward (the same tokens). On the CPU the same buffers and forward run
directly (`--cuda-graphs on`), which is what the tests check against the eager forward.

`run` returns the final-normed hidden rows and the taps of the real rows in the eager forward's row
order, so the LM head and the accept walk (target.py, greedy_head.py) do not know which ran.
"""

from __future__ import annotations

import bisect
import dataclasses

import torch

from ddtree.models.deepseek_v3.model import DeepseekV3ForCausalLM
from ddtree.models.layers.attention import AttentionMetadata
from ddtree.models.runtime.cuda_graphs import GraphRunner
from ddtree.models.runtime.static_batch import Bucket, StaticBatch, make_buckets
from ddtree.models.runtime.static_shapes import doubling_sizes, powers_of_two_up_to
from ddtree.telemetry.logging import get_logger

log = get_logger("ddtree.verifier.step.static_step")
CPU_KEY_BLOCK = 128  # on the CPU, keys per sequence are padded to a multiple of this

__all__ = ["Bucket", "StaticPlan", "StaticStep", "default_buckets", "make_buckets", "make_static_step",
           "plan_static_step"]  # fmt: skip


def default_buckets(max_batch: int, max_rows: int, max_keys: int, key_block: int = 512) -> tuple[Bucket, ...]:
    """Batch 1, 2, 4, ... max_batch; rows 1 (AR) and max_rows (a full tree); keys key_block, 2·key_block,
    4·key_block, ... up to max_keys (geometric: about log2(max_keys / key_block) graphs per (B, Q))."""
    return make_buckets(powers_of_two_up_to(max_batch), sorted({1, max_rows}), doubling_sizes(key_block, max_keys))


class StaticStep:
    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        kv_cache: torch.Tensor,
        pad_slot: int,
        buckets: tuple[Bucket, ...],
        tap_layer_ids: tuple[int, ...],
        graphs: bool,
    ):
        """graphs: capture a CUDA graph per bucket (`capture`); else the batches run the forward directly."""
        self.model, self.kv_cache, self.taps = model, kv_cache, tuple(tap_layer_ids)
        self.buckets = tuple(sorted(buckets))
        self._bucket_set = frozenset(self.buckets)
        self._sizes = [sorted({getattr(b, f) for b in self.buckets}) for f in ("batch", "rows", "keys")]
        self.graphs = graphs
        self.pad_slot = pad_slot
        self._batches: dict[Bucket, StaticBatch] = {}  # made on first use (all of them by capture)
        self._runner = GraphRunner("verifier", self._forward)
        self.replays = 0
        self.fallbacks = 0

    def batch(self, b: Bucket) -> StaticBatch:
        """The bucket's buffers (made now if they were not)."""
        if b not in self._batches:
            heads = self.model.model.layers[0].self_attn.num_heads if len(self.model.model.layers) else 1
            self._batches[b] = StaticBatch(
                b, self.pad_slot, self.model.attn_backend, heads, self.kv_cache.shape[1], self.kv_cache.device
            )
        return self._batches[b]

    def _forward(self, b: Bucket) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.batch(b).forward(self.model, self.kv_cache, self.taps)

    def bucket_for(self, meta: AttentionMetadata) -> Bucket | None:
        seqs = meta.seqs
        if not seqs:
            return None
        q = max(s.q_len for s in seqs)
        k = max(s.prefix_slots.numel() + s.q_len for s in seqs)
        # The smallest batch, then rows, then keys that fit (each dimension by bisection).
        sizes = [self._sizes[i][bisect.bisect_left(self._sizes[i], need)] if need <= self._sizes[i][-1] else None
                 for i, need in enumerate((len(seqs), q, k))]  # fmt: skip
        b = None if None in sizes else Bucket(*sizes)
        return b if b in self._bucket_set else None

    def capture(self) -> float:
        """Capture every bucket's graph (CUDA), over buffers holding padding only (capture writes nothing
        but the pad slot); returns the seconds it took, 0 without graphs."""
        if not self.graphs:
            return 0.0
        for b in self.buckets:
            self.batch(b)
        return self._runner.capture(self.buckets)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, tap_layer_ids: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(final-normed hidden [T, d], taps [T, F] or None) in the eager row order, or None when the step
        fits no bucket or taps other layers than the captured ones (the caller runs it eagerly)."""
        b = self.plan(meta, tap_layer_ids)
        if b is None:
            return None
        where = self.batch(b).fill(input_ids, positions, meta).to(self.kv_cache.device, non_blocking=True)
        hidden, taps = self.replay(b)
        return hidden.index_select(0, where), None if taps is None else taps.index_select(0, where)

    def plan(self, meta: AttentionMetadata, tap_layer_ids: tuple[int, ...]) -> Bucket | None:
        """The bucket this step runs in, or None (counted as a fallback: the caller runs it eagerly)."""
        b = self.bucket_for(meta)
        if b is None or tuple(tap_layer_ids) != self.taps:
            self.fallbacks += 1
            return None
        return b

    def replay(self, b: Bucket) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward over bucket b's buffers as they are (filled by `batch(b).fill`, or received from rank 0):
        every row of the bucket, final-normed, and its taps; a graph's outputs, overwritten by its next replay."""
        self.replays += 1
        return self._runner.run(b)


@dataclasses.dataclass(frozen=True)
class StaticPlan:
    """What `--cuda-graphs` decided at start-up, before the KV pool is sized (the graphs' pool is reserved
    out of the memory the pool may take: graph_pool.graph_pool_reserve)."""

    buckets: tuple[Bucket, ...]
    graphs: bool  # captured as CUDA graphs (a CUDA device); else the buffers run directly (the CPU)


def plan_static_step(config, model: DeepseekV3ForCausalLM) -> StaticPlan | None:
    """The static step `--cuda-graphs` (a VerifierConfig) asks for, or None for eager steps, with one log line
    saying why. Every model runs at static shapes, at any TP degree (each rank plans the same buckets)."""
    cuda = torch.device(config.device).type == "cuda"
    reason = None
    if config.cuda_graphs == "off":
        reason = "--cuda-graphs off"
    elif config.cuda_graphs == "auto" and not cuda:
        reason = f"--cuda-graphs auto on device {config.device}: CUDA graphs are for CUDA devices"
    if reason is not None:
        log.info("static_step_off", reason=reason)
        return None
    rows = config.default_budget + 1
    if cuda:  # a graph per bucket: few, geometric in keys
        buckets = default_buckets(config.max_batch, rows, config.max_context + rows)
    else:  # no capture: buffers are made on first use, and keys padded by at most CPU_KEY_BLOCK
        keys = range(CPU_KEY_BLOCK, config.max_context + rows + CPU_KEY_BLOCK, CPU_KEY_BLOCK)
        buckets = make_buckets(range(1, config.max_batch + 1), (1, rows), keys)
    return StaticPlan(buckets, graphs=cuda)


def make_static_step(
    plan: StaticPlan,
    model: DeepseekV3ForCausalLM,
    kv_cache: torch.Tensor,
    pad_slot: int,
    tap_layer_ids: tuple[int, ...],
) -> StaticStep:
    """The StaticStep of a plan over a latent cache (the KV pool's, or a TP rank's replica), its graphs
    captured now (on CUDA)."""
    step = StaticStep(model, kv_cache, pad_slot, plan.buckets, tap_layer_ids, graphs=plan.graphs)
    step.capture()
    log.info("static_step", buckets=len(plan.buckets), graphs=plan.graphs)
    return step

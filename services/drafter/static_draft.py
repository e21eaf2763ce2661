"""The draft block forward at static shapes: buckets, preallocated inputs, CUDA graphs (`--cuda-graphs`).

A bucket is (sequences S, context rows C). A Draft call fits the smallest bucket with S >= its sequences
and C >= its longest context (the window bounds every context, so the largest bucket is the window).
Its inputs are copied into views of one set of buffers sized for the largest bucket
(models/dflash/static.py has the layout): the blocks' embeddings and positions, each sequence's context
K/V per layer in rows [0, n_s) and the mask of the padding after them. The forward reads only those
views, so on CUDA each bucket is a captured graph (models/runtime/cuda_graphs.py, the verifier's capture
code too: one memory pool for all, captured at start-up) and a Draft's forward is copy-in + replay.
A call that fits no bucket (more sequences than the largest bucket, or an unlimited window's longer
context) runs forward_blocks (the same trees up to fp32 rounding). On the CPU the same buffers and
forward run directly (`--cuda-graphs on`), which is what the tests compare with forward_blocks; `auto`
leaves the CPU eager (the copy-in of the contexts costs more there than the per-block loop it saves).

Copy-in per call: every sequence's whole context per layer (C x kvh x hd x 2), a few MB for a
Kimi-sized drafter at the window; on a GPU that is microseconds, and it keeps DraftContext as it is.
"""

from __future__ import annotations

import bisect
import dataclasses

import torch
from torch import Tensor

from ddtree.models.dflash.model import DFlashDraftModel
from ddtree.models.dflash.static import static_forward_blocks
from ddtree.models.runtime.cuda_graphs import GraphRunner
from ddtree.models.runtime.static_shapes import doubling_sizes, powers_of_two_up_to
from ddtree.telemetry.logging import get_logger

log = get_logger("ddtree.drafter.static_draft")
MAX_GRAPH_SEQUENCES = 16  # sequences per Draft call captured (the verifier's default --max-batch)
CONTEXT_BLOCK = 256  # the smallest context bucket; the others double up to the window


@dataclasses.dataclass(frozen=True, order=True)
class DraftBucket:
    seqs: int  # S blocks (one per sequence)
    context: int  # C context rows per sequence


def draft_buckets(max_seqs: int, window: int, context_block: int = CONTEXT_BLOCK) -> tuple[DraftBucket, ...]:
    """Sequences 1, 2, 4, ... max_seqs x context rows context_block, 2·context_block, ... up to the window
    (the window itself last): about 5 x log2(window / context_block) graphs."""
    seqs, contexts = powers_of_two_up_to(max_seqs), doubling_sizes(context_block, window)
    return tuple(sorted(DraftBucket(s, c) for s in seqs for c in contexts))


class DraftBuffers:
    """The largest bucket's inputs; a bucket reads the leading views [:S] and [:S, :C]."""

    def __init__(self, model: DFlashDraftModel, largest: DraftBucket, block_size: int, context_dtype: torch.dtype):
        cfg, dev = model.config, model.device
        S, C = largest.seqs, largest.context
        kv_shape = (S, C, cfg.num_key_value_heads, cfg.head_dim)
        self.embeds = torch.zeros(S, block_size, cfg.hidden_size, dtype=model.dtype, device=dev)
        self.positions = torch.zeros(S, block_size, dtype=torch.int64, device=dev)
        # Zeros, and only ever overwritten by real (finite) K/V: a hidden row's weight is 0, and 0 x finite = 0.
        self.ctx_k = [torch.zeros(kv_shape, dtype=context_dtype, device=dev) for _ in model.layers]
        self.ctx_v = [torch.zeros(kv_shape, dtype=context_dtype, device=dev) for _ in model.layers]
        self.ctx_hidden = torch.ones(S, C, dtype=torch.bool, device=dev)
        self.inv_freq = model.inv_freq_on(dev)

    def views(self, b: DraftBucket) -> tuple:
        """static_forward_blocks' inputs for bucket b (after the model)."""
        S, C = b.seqs, b.context
        return (
            self.embeds[:S],
            self.positions[:S],
            [k[:S, :C] for k in self.ctx_k],
            [v[:S, :C] for v in self.ctx_v],
            self.ctx_hidden[:S, :C],
            self.inv_freq,
        )

    def fill(self, b: DraftBucket, embeds: Tensor, positions: Tensor, contexts: list[list[tuple[Tensor, Tensor]]]):
        """Copy one call (n <= b.seqs blocks, each context <= b.context rows) into bucket b's views."""
        n = embeds.shape[0]
        self.embeds[:n].copy_(embeds)
        self.embeds[n : b.seqs].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n : b.seqs].zero_()
        hidden = torch.ones(b.seqs, b.context, dtype=torch.bool)
        for s, context in enumerate(contexts):
            rows = context[0][0].shape[0] if context else 0
            hidden[s, :rows] = False
            for i, (k, v) in enumerate(context):
                self.ctx_k[i][s, :rows].copy_(k)
                self.ctx_v[i][s, :rows].copy_(v)
        self.ctx_hidden[: b.seqs, : b.context].copy_(hidden, non_blocking=True)


class StaticDraft:
    def __init__(
        self,
        model: DFlashDraftModel,
        buckets: tuple[DraftBucket, ...],
        block_size: int,
        context_dtype: torch.dtype,
        graphs: bool,
    ):
        """graphs: a CUDA graph per bucket; else the buffers run the forward directly."""
        if not buckets:
            raise ValueError("StaticDraft needs at least one bucket")
        self.model = model
        self.buckets = tuple(sorted(buckets))
        self._bucket_set = frozenset(self.buckets)
        self._sizes = [sorted({getattr(b, f) for b in self.buckets}) for f in ("seqs", "context")]
        self.block_size = block_size
        largest = DraftBucket(self._sizes[0][-1], self._sizes[1][-1])
        self.buffers = DraftBuffers(model, largest, block_size, context_dtype)
        self.graphs = graphs
        self._runner = GraphRunner("draft", self._forward)
        self.replays = 0
        self.fallbacks = 0

    def bucket_for(self, seqs: int, longest_context: int) -> DraftBucket | None:
        """The smallest sequences, then context, bucket that holds the call; None when none does."""
        sizes = []
        for options, need in zip(self._sizes, (seqs, longest_context)):
            i = bisect.bisect_left(options, need)
            if i == len(options):
                return None
            sizes.append(options[i])
        b = DraftBucket(*sizes)
        return b if b in self._bucket_set else None

    def _forward(self, b: DraftBucket) -> Tensor:
        return static_forward_blocks(self.model, *self.buffers.views(b))

    def capture(self) -> float:
        """Capture every bucket's graph (CUDA); returns the seconds taken, 0 without graphs."""
        return self._runner.capture(self.buckets) if self.graphs else 0.0

    def run(self, embeds: Tensor, positions: Tensor, contexts: list[list[tuple[Tensor, Tensor]]]) -> Tensor | None:
        """hidden [S, B, H] as forward_blocks(embeds [S, B, H], positions [S, B], contexts), or None when
        the call fits no bucket (the caller runs forward_blocks)."""
        longest = max((ctx[0][0].shape[0] for ctx in contexts if ctx), default=0)
        b = self.bucket_for(embeds.shape[0], longest)
        if b is None or embeds.shape[1] != self.block_size:
            self.fallbacks += 1
            return None
        self.buffers.fill(b, embeds, positions, contexts)
        self.replays += 1
        n = embeds.shape[0]
        out = self._runner.run(b)
        return out[:n].clone() if self._runner.captured else out[:n]  # a graph's output: the next replay's too


def plan_static_draft(cuda_graphs: str, device: str, window: int) -> tuple[DraftBucket, ...] | None:
    """The buckets `--cuda-graphs` asks for, or None for eager drafts (with one log line saying why). `on`
    with an unlimited window never gets here: DrafterConfig.validate refuses it."""
    cuda = torch.device(device).type == "cuda"
    reason = None
    if cuda_graphs == "off":
        reason = "--cuda-graphs off"
    elif window == 0:
        reason = f"--cuda-graphs {cuda_graphs} with --window 0: an unlimited context has no largest bucket"
    elif cuda_graphs == "auto" and not cuda:
        reason = f"--cuda-graphs auto on device {device}: CUDA graphs are for CUDA devices"
    if reason is not None:
        log.info("static_draft_off", reason=reason)
        return None
    return draft_buckets(MAX_GRAPH_SEQUENCES, window)

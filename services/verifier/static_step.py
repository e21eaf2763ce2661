"""The verify / decode forward at static shapes: buckets, preallocated inputs, CUDA graphs (issue 17).

A bucket is (batch B, rows per sequence Q, keys per sequence K). A step fits the smallest bucket with
B >= its sequences, Q >= its longest item (tree root + nodes, an AR row, a prefill chunk) and
K >= its longest prefix + that item. Its inputs are copied into the bucket's buffers
(models/static_forward.py has the layout), padding rows write to the pool's pad slot and see one key,
and the forward reads only the buffers: no host synchronisation and no data-dependent shape inside,
so on CUDA each bucket is a captured graph (`torch.cuda.CUDAGraph`, one memory pool shared by all
buckets, captured at start-up, largest first) and a step is copy-in + replay. A step that fits no
bucket runs the eager forward (the same tokens). On the CPU the same buffers and forward run
directly (`--cuda-graphs on`), which is what the tests check against the eager forward.

`run` returns the final-normed hidden rows and the taps of the real rows in the eager forward's row
order, so the LM head and the accept walk (target.py, greedy_head.py) do not know which ran.
"""

from __future__ import annotations

import bisect
import dataclasses
import time

import torch

from ddtree.models.attention import AttentionMetadata
from ddtree.models.deepseek_v3 import DeepseekV3ForCausalLM
from ddtree.models.moe import DeepseekV3MoE
from ddtree.models.static_forward import static_forward
from ddtree.models.static_shapes import doubling_sizes, powers_of_two_up_to
from ddtree.telemetry.logging import get_logger

log = get_logger("ddtree.verifier.static_step")
CPU_KEY_BLOCK = 128  # on the CPU, keys per sequence are padded to a multiple of this
DENSE_EXPERTS = 16  # more routed experts per rank than this: eager only (a fused MoE would be the static route)


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
    batch: int  # B sequences
    rows: int  # Q rows per sequence
    keys: int  # K keys per sequence (prefix + rows)


def make_buckets(batch_sizes, row_sizes, key_sizes) -> tuple[Bucket, ...]:
    return tuple(sorted(Bucket(b, q, k) for b in batch_sizes for q in row_sizes for k in key_sizes if k >= q))


def default_buckets(max_batch: int, max_rows: int, max_keys: int, key_block: int = 512) -> tuple[Bucket, ...]:
    """Batch 1, 2, 4, ... max_batch; rows 1 (AR) and max_rows (a full tree); keys key_block, 2·key_block,
    4·key_block, ... up to max_keys (geometric: about log2(max_keys / key_block) graphs per (B, Q))."""
    return make_buckets(powers_of_two_up_to(max_batch), sorted({1, max_rows}), doubling_sizes(key_block, max_keys))


class StepBuffers:
    """One bucket's inputs (models/static_forward.py's layout) and, once captured, its outputs."""

    def __init__(self, b: Bucket, pad_slot: int, device: torch.device):
        T = b.batch * b.rows
        self.bucket, self.pad_slot = b, pad_slot
        self.input_ids = torch.zeros(T, dtype=torch.int64, device=device)
        self.positions = torch.zeros(T, dtype=torch.int64, device=device)
        self.write_slots = torch.full((T,), pad_slot, dtype=torch.int64, device=device)
        self.key_slots = torch.full((b.batch, b.keys), pad_slot, dtype=torch.int64, device=device)
        # bf16 holds 0 and -inf exactly at half fp32's bytes (the host fills it every step); the scores add it in fp32
        self.key_bias = torch.full((b.batch, b.rows, b.keys), float("-inf"), dtype=torch.bfloat16, device=device)
        # Every row sees key 0, also in the warm-up and capture runs: no all -inf row, so the pad slot only
        # ever holds finite latents (a real row's weight 0 times a NaN there would still be NaN).
        self.key_bias[:, :, 0] = 0.0
        self.rows = torch.arange(T, dtype=torch.int64, device=device)
        self.out: tuple[torch.Tensor, torch.Tensor | None] | None = None  # graph outputs
        self.graph = None

    def fill(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Copy one step into the buffers; returns int64 [T_real]: each real row's padded row."""
        b = self.bucket
        Q, K = b.rows, b.keys
        host_ids = torch.zeros(b.batch * Q, dtype=torch.int64)
        host_pos = torch.zeros(b.batch * Q, dtype=torch.int64)
        write = torch.full((b.batch * Q,), self.pad_slot, dtype=torch.int64)
        keys = torch.full((b.batch, K), self.pad_slot, dtype=torch.int64)
        bias = torch.full((b.batch, Q, K), float("-inf"), dtype=torch.bfloat16)
        bias[:, :, 0] = 0.0  # every row sees one key (padding rows: never read)
        where = []
        ids, pos = ids.cpu(), pos.cpu()
        for i, s in enumerate(meta.seqs):
            P, n = s.prefix_slots.numel(), s.q_len
            r0 = i * Q
            host_ids[r0 : r0 + n] = ids[s.q_start : s.q_start + n]
            host_pos[r0 : r0 + n] = pos[s.q_start : s.q_start + n]
            write[r0 : r0 + n] = s.new_slots.cpu()
            keys[i, :P] = s.prefix_slots.cpu()
            keys[i, P : P + n] = s.new_slots.cpu()
            bias[i, :n, :P] = 0.0
            bias[i, :n, P : P + n] = torch.where(s.visible_new().cpu(), 0.0, float("-inf"))
            where.append(torch.arange(r0, r0 + n))
        for buf, host in (
            (self.input_ids, host_ids),
            (self.positions, host_pos),
            (self.write_slots, write),
            (self.key_slots, keys),
            (self.key_bias, bias),
        ):
            buf.copy_(host, non_blocking=True)
        return torch.cat(where) if where else torch.empty(0, dtype=torch.int64)

    def forward(self, model, kv_cache: torch.Tensor, taps: tuple[int, ...]):
        """static_forward in place: (hidden rows, taps), the cache written."""
        return static_forward(model, *self.step_inputs(kv_cache), taps)

    def step_inputs(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """static_forward's tensors, in its order: these buffers and the cache."""
        return self.input_ids, self.positions, self.write_slots, self.key_slots, self.key_bias, kv_cache, self.rows


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
        """graphs: capture a CUDA graph per bucket; else the buffers run the forward directly."""
        if (reason := unsupported_reason(model)) is not None:
            raise ValueError(reason)
        self.model, self.kv_cache, self.taps = model, kv_cache, tuple(tap_layer_ids)
        self.buckets = tuple(sorted(buckets))
        self._bucket_set = frozenset(self.buckets)
        self._sizes = [sorted({getattr(b, f) for b in self.buckets}) for f in ("batch", "rows", "keys")]
        self.graphs = graphs
        self.pad_slot = pad_slot
        self._buffers: dict[Bucket, StepBuffers] = {}  # made on first use (all of them by capture)
        self.replays = 0
        self.fallbacks = 0

    def _buffer(self, b: Bucket) -> StepBuffers:
        if b not in self._buffers:
            self._buffers[b] = StepBuffers(b, self.pad_slot, self.kv_cache.device)
        return self._buffers[b]

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
        """Capture every bucket's graph (CUDA), largest first so that the shared pool is sized once; returns
        the seconds it took."""
        if not self.graphs:
            return 0.0
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for b in sorted(self.buckets, reverse=True):
            buf = self._buffer(b)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.inference_mode():
                for _ in range(2):  # warm-up: allocator and kernel caches, outside the capture
                    buf.forward(self.model, self.kv_cache, self.taps)
            torch.cuda.current_stream().wait_stream(stream)
            # The warm-up's blocks are cached by the default allocator, outside the graphs' pool: handed back
            # here, so that start-up holds the pool plus one warm-up at a time (kv_sizing.graph_pool_reserve).
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), torch.inference_mode():
                buf.out = buf.forward(self.model, self.kv_cache, self.taps)
            buf.graph = graph
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        log.info("cuda_graphs_captured", buckets=len(self.buckets), seconds=round(seconds, 2))
        return seconds

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, tap_layer_ids: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(final-normed hidden [T, d], taps [T, F] or None) in the eager row order, or None when the step
        fits no bucket or taps other layers than the captured ones (the caller runs it eagerly)."""
        b = self.bucket_for(meta)
        if b is None or tuple(tap_layer_ids) != self.taps:
            self.fallbacks += 1
            return None
        buf = self._buffer(b)
        where = buf.fill(input_ids, positions, meta).to(self.kv_cache.device)
        if buf.graph is not None:
            buf.graph.replay()
            hidden, taps = buf.out
        else:
            hidden, taps = buf.forward(self.model, self.kv_cache, self.taps)
        self.replays += 1
        return hidden.index_select(0, where), None if taps is None else taps.index_select(0, where)


@dataclasses.dataclass(frozen=True)
class StaticPlan:
    """What `--cuda-graphs` decided at start-up, before the KV pool is sized (the graphs' pool is reserved
    out of the memory the pool may take: kv_sizing.graph_pool_reserve)."""

    buckets: tuple[Bucket, ...]
    graphs: bool  # captured as CUDA graphs (a CUDA device); else the buffers run directly (the CPU)


def unsupported_reason(model: DeepseekV3ForCausalLM) -> str | None:
    """Why the static forward cannot run this model (it runs routed experts densely), or None."""
    for layer in model.model.layers:
        if isinstance(layer.mlp, DeepseekV3MoE):
            experts = layer.mlp.experts
            if experts.gate_proj.kind != "bf16":
                return f"the model's routed experts are {experts.gate_proj.kind} (static steps need unquantized ones)"
            if experts.num_local > DENSE_EXPERTS:
                return (
                    f"the model has {experts.num_local} routed experts per rank (static steps run at most "
                    f"{DENSE_EXPERTS}, densely)"
                )
    return None


def plan_static_step(config, model: DeepseekV3ForCausalLM) -> StaticPlan | None:
    """The static step `--cuda-graphs` (a VerifierConfig) asks for, or None for eager steps, with one log line
    saying why. `on` is strict: ValueError (the CLI's one-line start-up error) when this model cannot run at
    static shapes; at tp > 1 VerifierConfig.validate has refused it already."""
    cuda = torch.device(config.device).type == "cuda"
    reason = None
    if config.cuda_graphs == "off":
        reason = "--cuda-graphs off"
    elif config.tp > 1:  # only auto gets here (validate refuses on): the sharded target runs eagerly
        reason = f"--cuda-graphs auto with --tp {config.tp}: the sharded target has no static step yet"
    elif config.cuda_graphs == "auto" and not cuda:
        reason = f"--cuda-graphs auto on device {config.device}: CUDA graphs are for CUDA devices"
    elif (unsupported := unsupported_reason(model)) is not None:
        if config.cuda_graphs == "on":
            raise ValueError(f"--cuda-graphs on: {unsupported} (use auto or off)")
        reason = f"--cuda-graphs auto: {unsupported}"
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
    plan: StaticPlan, model: DeepseekV3ForCausalLM, pool, tap_layer_ids: tuple[int, ...]
) -> StaticStep:
    """The verifier's StaticStep for a plan, its graphs captured now (on CUDA)."""
    step = StaticStep(model, pool.cache, pool.pad_slot, plan.buckets, tap_layer_ids, graphs=plan.graphs)
    step.capture()
    log.info("static_step", buckets=len(plan.buckets), graphs=plan.graphs)
    return step

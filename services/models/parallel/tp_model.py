"""The tensor-parallel target: one rank's shard, its forward, and rank 0's broadcasting handle.

Every rank builds DeepseekV3ForCausalLM from a *local* config (H/N heads; I/N dense and, without expert
parallelism, moe_intermediate_size/N expert widths), so q_b_proj / kv_b_proj hold H/N heads, o_proj and
every down_proj H/N or I/N input columns, and parameter names stay the checkpoint's. Then:
- embed_tokens and lm_head are replaced by their V/N-row shards (VocabParallelEmbedding all-reduces);
- every decoder layer gets `tp`, so it all-reduces once after attention and once after the MLP;
- under expert parallelism each MoE keeps its E/N whole experts (stacked; `expert_map` sends the others'
  ids to -1) and a TP-split shared expert; the router is replicated, so every rank routes every token the same way.
The latent KV cache has one head: every rank holds a full replica, written by the same forward.

Per forward (`run_shard`, on every rank): the model forward, one all-gather of [R, 2] (max, global id)
for the argmax, and only when a row is sampled at temperature > 0 an all-gather of the full logits. A
step that fits the static step's buckets (`static_bucket`, the same decision on every rank from the same
message) runs `run_static_shard`: every rank fills its own batch of that bucket from the message's host
inputs and replays it, so the step's control path is rank 0's one host broadcast and no device collective.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import torch
from torch import nn

from ddtree.models.checkpoint.loader import load_target
from ddtree.models.deepseek_v3.config import DeepseekV3Config
from ddtree.models.deepseek_v3.model import DeepseekV3ForCausalLM, ForwardOutput
from ddtree.models.deepseek_v3.moe import DeepseekV3MLP, DeepseekV3MoE
from ddtree.models.layers.attention import MLAAttentionBackend, prepare_attention
from ddtree.models.parallel.layers import VocabParallelEmbedding, combine_shard_argmax, shard_argmax
from ddtree.models.parallel.process_group import TPGroup
from ddtree.models.parallel.shard_plan import ShardPlan
from ddtree.models.parallel.step_message import (
    CACHE,
    FORWARD,
    GATHER_AT,
    PING,
    STATIC,
    STOP,
    StepInputs,
    encode,
    send_step,
)

MESSAGE = "step_message"  # meta.prepared's key of the packed step message (TensorParallelModel.prepare)


def local_config(plan: ShardPlan) -> DeepseekV3Config:
    c, n = plan.config, plan.world_size
    return dataclasses.replace(
        c,
        num_attention_heads=c.num_attention_heads // n,
        intermediate_size=c.intermediate_size // n,
        moe_intermediate_size=c.moe_intermediate_size if plan.expert_parallel else c.moe_intermediate_size // n,
    )


def build_tp_model(
    plan: ShardPlan, tp: TPGroup | None, attention_backend: str | MLAAttentionBackend = "torch"
) -> DeepseekV3ForCausalLM:
    """The rank's shard with local shapes, uninitialised (build under torch.device("meta"), then load)."""
    c = plan.config
    model = DeepseekV3ForCausalLM(local_config(plan), attention_backend=attention_backend)
    model.config = c  # the logical model (vocab, layers, cache width); modules were built with local sizes
    lo, hi = plan.vocab_range
    model.model.embed_tokens = VocabParallelEmbedding(hi - lo, c.hidden_size, lo, tp)
    model.lm_head = nn.Linear(c.hidden_size, hi - lo, bias=False)
    e_lo, e_hi = plan.expert_range
    for layer in model.model.layers:
        layer.tp = tp
        if plan.expert_parallel and isinstance(layer.mlp, DeepseekV3MoE):
            layer.mlp.keep_experts(e_lo, e_hi)  # stacked [E/N, ...]; expert_map sends the others to -1
            if layer.mlp.shared_experts is not None:
                width = c.moe_intermediate_size * c.n_shared_experts // plan.world_size
                layer.mlp.shared_experts = DeepseekV3MLP(c.hidden_size, width)
    model.tp = tp
    model.vocab_start = lo
    return model


def load_tp_model(
    path,
    tp: TPGroup,
    expert_parallel: bool = False,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    attention_backend: str | MLAAttentionBackend = "torch",  # a name, or a backend made with its plan
) -> DeepseekV3ForCausalLM:
    """Load this rank's shard: only its slices (and, under expert parallelism, its experts) are read."""
    plans: list[ShardPlan] = []  # the loader parses config.json and hands it to build(); the plan needs it

    def build(config: DeepseekV3Config) -> nn.Module:
        plans.append(ShardPlan(config, tp.rank, tp.world_size, expert_parallel))
        return build_tp_model(plans[0], tp, attention_backend)

    model = load_target(
        path,
        dtype,
        device,
        attention_backend,
        build_model=build,
        slice_of=lambda name: plans[0].slice_of(name),
        skip=lambda name: plans[0].skip(name),
    )
    if tp.rank > 0:
        with torch.no_grad():
            for layer in model.model.layers:
                if layer.self_attn.o_proj.bias is not None:
                    layer.self_attn.o_proj.bias.zero_()  # row-parallel: rank 0 alone adds the bias
    return model


def run_shard(model: DeepseekV3ForCausalLM, tp: TPGroup, s: StepInputs, kv_cache: torch.Tensor) -> ForwardOutput:
    """One eager forward on this rank's shard; every rank calls it with the same inputs (collectives inside).

    Returns the full-vocab argmax per row (all ranks), the taps (replicated) and, when s.gather_logits,
    the full logits fp32 [R, V]."""
    dev = kv_cache.device
    ids, pos, rows = s.input_ids, s.positions, s.logits_rows
    if ids.device != dev:  # the other ranks' inputs come from the step message: one host -> device copy
        T = ids.shape[0]
        packed = torch.cat([ids, pos, *([] if rows is None else [rows])]).to(dev)
        ids, pos, rows = packed[:T], packed[T : 2 * T], None if rows is None else packed[2 * T :]
    prepare_attention(model, s.meta, kv_cache)  # a no-op where the caller prepared it (rank 0: batch.py)
    out = model.forward(
        ids, pos.to(dev), s.meta, kv_cache, logits_rows=None if rows is None else rows.to(dev),
        tap_layer_ids=s.tap_layer_ids,
    )  # fmt: skip
    return _head(model, tp, out.logits, out.taps, s.gather_logits)


def static_bucket(static, s: StepInputs):
    """The bucket of `static` (a StaticStep or None) this step runs in, or None (eager): a function of the
    message alone, so every rank decides the same."""
    return None if static is None else static.plan(s.meta, s.tap_layer_ids)


def run_static_shard(model: DeepseekV3ForCausalLM, tp: TPGroup, static, bucket, s: StepInputs) -> ForwardOutput:
    """One static step on this rank's shard, every rank in lockstep: the bucket's buffers filled from the
    step's host inputs (`s`: the message every rank holds; one host -> device copy, as rank 0's), the replay,
    then the rows asked for and the head as run_shard's."""
    where = static.batch(bucket).fill(s.input_ids, s.positions, s.meta)  # int64 [T_real], host
    hidden, taps = static.replay(bucket)
    dev = hidden.device
    where = where.to(dev, non_blocking=True)
    rows = s.logits_rows
    rows = where if rows is None else where.index_select(0, rows.to(dev, non_blocking=True))
    taps = None if taps is None else taps.index_select(0, where)
    return _head(model, tp, model.compute_logits(hidden.index_select(0, rows)), taps, s.gather_logits)


def _head(model: DeepseekV3ForCausalLM, tp: TPGroup, local: torch.Tensor, taps, gather_logits: bool) -> ForwardOutput:
    """The full-vocab argmax of this rank's logits slice fp32 [R, V/N] (and the full logits when asked)."""
    dev = local.device
    R = local.shape[0]
    if R == 0:  # every rank knows R: all skip the collectives together
        return ForwardOutput(
            logits=local.new_empty(0, model.config.vocab_size) if gather_logits else None,
            taps=taps,
            argmax=torch.empty(0, dtype=torch.int64, device=dev),
        )
    argmax = combine_shard_argmax(tp.all_gather(shard_argmax(local, model.vocab_start)))  # [R]
    logits = tp.all_gather(local).permute(1, 0, 2).reshape(R, -1) if gather_logits else None  # [R, V]
    return ForwardOutput(logits=logits, taps=taps, argmax=argmax)


class TensorParallelModel:
    """Rank 0's handle, called like DeepseekV3ForCausalLM.forward (plus `gather_logits`).

    Each forward first broadcasts its inputs to the other ranks (step_message.py: one host broadcast, packed
    from the host copies of the inputs when the caller passes them), then runs rank 0's shard.
    Collectives are serialised by a lock; while idle, a ping every `ping_interval_s` keeps the other
    ranks inside their collective timeout. Any failure after a broadcast leaves the ranks out of
    step, so it is final: `on_failure(message)` is called (the server then exits) and later forwards
    raise at once.
    """

    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        tp: TPGroup,
        ping_interval_s: float,
        on_failure: Callable[[str], None] | None = None,
    ):
        self.model = model
        self.tp = tp
        self.config = model.config
        self.ping_interval_s = ping_interval_s
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self._last_sent = time.monotonic()
        self._broken: str | None = None
        self._closed = threading.Event()
        self._pinger = threading.Thread(target=self._ping_loop, name="tp-ping", daemon=True)
        self._pinger.start()
        self.static = None  # rank 0's static step, once start_static made it

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    @torch.no_grad()
    def forward(
        self,
        input_ids,
        positions,
        meta,
        kv_cache,
        logits_rows=None,
        tap_layer_ids=(),
        gather_logits: bool = False,
        host_inputs: tuple | None = None,  # (input_ids, positions, logits_rows) on the host, for the message
    ) -> ForwardOutput:
        inputs = StepInputs(input_ids, positions, meta, logits_rows, tuple(tap_layer_ids), gather_logits)
        encoded = meta.prepared.pop(MESSAGE, None)
        if encoded is None:
            message = inputs
            if host_inputs is not None:
                ids, pos, rows = host_inputs
                message = dataclasses.replace(inputs, input_ids=ids, positions=pos, logits_rows=rows)
            encoded = encode(message)
        encoded[0][GATHER_AT] = int(gather_logits)
        with self._lock:
            self._check()
            try:
                bucket = static_bucket(self.static, inputs)
                send_step(self.tp, FORWARD, encoded=encoded)  # before rank 0's fill: the others fill meanwhile
                if bucket is not None:
                    if host_inputs is not None:
                        ids, pos, rows = host_inputs
                        inputs = dataclasses.replace(inputs, input_ids=ids, positions=pos, logits_rows=rows)
                    return run_static_shard(self.model, self.tp, self.static, bucket, inputs)
                return run_shard(self.model, self.tp, inputs, kv_cache)
            except Exception as err:
                self._fail(f"tensor-parallel forward failed: {err}")
                raise
            finally:
                self._last_sent = time.monotonic()

    __call__ = forward

    def prepare(self, input_ids, positions, meta, kv_cache, logits_rows=None, tap_layer_ids=()) -> None:
        """Before the forward (host tensors): rank 0's attention buffers for an eager step (a static one has
        its bucket's), and the step message packed (meta.prepared[MESSAGE]; the forward sets its gather flag
        and broadcasts it)."""
        static = self.static
        if static is None or static.bucket_for(meta) is None or tuple(tap_layer_ids) != static.taps:
            prepare_attention(self.model, meta, kv_cache)
        message = StepInputs(input_ids, positions, meta, logits_rows, tuple(tap_layer_ids), False)
        meta.prepared[MESSAGE] = encode(message)

    def start_static(self, pad_slot: int, tap_layer_ids: tuple[int, ...], make: Callable[[], object]) -> None:
        """Have every other rank build its static step over its replica (STATIC), then build rank 0's with
        `make()`; each captures its graphs now, in lockstep (the warm-up and captured forwards hold
        collectives)."""
        with self._lock:
            self._check()
            try:
                send_step(self.tp, STATIC, ints=torch.tensor([pad_slot, *tap_layer_ids], dtype=torch.int64))
                self.static = make()
            except Exception as err:
                self._fail(f"tensor-parallel static step failed: {err}")
                raise
            finally:
                self._last_sent = time.monotonic()

    def replicate_kv(self, kv_cache: torch.Tensor) -> None:
        """Have every other rank allocate its replica of rank 0's latent cache [L, S, W] (once, at start)."""
        with self._lock:
            self._check()
            send_step(self.tp, CACHE, num_slots=kv_cache.shape[1])
            self._last_sent = time.monotonic()

    def close(self) -> None:
        """Tell the other ranks to stop (their worker loops return)."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            if self._broken is None:
                try:
                    send_step(self.tp, STOP)
                except Exception:  # a peer already gone: nothing to stop
                    pass

    def _check(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"tensor-parallel group is broken: {self._broken}")
        if self._closed.is_set():
            raise RuntimeError("tensor-parallel model is closed")

    def _fail(self, message: str) -> None:
        if self._broken is None:
            self._broken = message
            if self._on_failure is not None:
                self._on_failure(message)

    def _ping_loop(self) -> None:
        while not self._closed.wait(self.ping_interval_s / 2):
            with self._lock:
                if self._closed.is_set() or self._broken is not None:
                    return
                if time.monotonic() - self._last_sent < self.ping_interval_s:
                    continue
                try:
                    send_step(self.tp, PING)
                except Exception as err:
                    self._fail(f"tensor-parallel ping failed: {err}")
                    return
                self._last_sent = time.monotonic()

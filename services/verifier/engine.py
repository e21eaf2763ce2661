"""The verifier's one assembly: config + checkpoint (or a loaded model) -> a ready scheduler.

Order, each piece built once and handed to the next (nothing patched afterwards):
  model (TP 1 loaded here, TP N started by tp_worker) -> static-step plan -> drafter pool ->
  KV sizing (the graph pools reserved first) -> KV pool -> static step (needs the pool and the taps; at
  TP N every rank builds its own, in lockstep) -> target (TP 1: LocalTarget with its static step; TP N:
  ShardedTarget) -> scheduler.
The server builds one engine and serves it; tests build theirs with `build_engine(cfg, model=...)`.
"""

from __future__ import annotations

import dataclasses
import socket
import time
import uuid

import torch

from ddtree.config import VerifierConfig
from ddtree.contract.sampling_params import SamplingConfig
from ddtree.models.checkpoint.loader import load_target
from ddtree.models.dtypes import TORCH_DTYPES
from ddtree.models.layers.attention import make_attention_backend, resolve_attention_backend
from ddtree.models.runtime.cpu import use_column_major_weights
from ddtree.protocol.ddtree.v1 import drafter_pb2
from ddtree.protocol.security import ServiceSecurity
from ddtree.telemetry.logging import get_logger
from ddtree.verifier.drafting.draft_deadline import DraftDeadline
from ddtree.verifier.drafting.drafter_pool import DrafterPool
from ddtree.verifier.kv.graph_pool import graph_reserve_for
from ddtree.verifier.kv.kv_pool import LatentKVPool
from ddtree.verifier.kv.kv_sizing import kv_size_for
from ddtree.verifier.kv.memory_check import refuse_unless_fits
from ddtree.verifier.sequence import GenerateParams, Sequence
from ddtree.verifier.sequence_lifecycle import drop_scratch
from ddtree.verifier.step.batch import run_batch
from ddtree.verifier.step.scheduler import Scheduler
from ddtree.verifier.step.static_step import make_static_step, plan_static_step
from ddtree.verifier.step.target import LocalTarget, ShardedTarget, Target
from ddtree.verifier.step.work_items import PrefillItem
from ddtree.verifier.tp_worker import start_tensor_parallel

log = get_logger("ddtree.verifier.engine")


@dataclasses.dataclass
class VerifierEngine:
    """What one verifier runs: its target, KV pool, drafter (None: AR only) and the scheduler over them."""

    config: VerifierConfig
    target: Target
    pool: LatentKVPool
    drafter: object | None  # a DrafterPool, or one DrafterClient / test double with the same calls
    scheduler: Scheduler
    tensor_parallel: object | None = None  # tp_worker.TensorParallel at TP N (its ranks > 0 are its workers)

    def start(self) -> None:
        self.scheduler.start()

    def warm_up(self) -> float:
        """Run the forward once at each row count serving starts with (an AR row, a tree of the default
        budget, a prompt chunk), before the server reports SERVING, so that the first requests do not pay
        kernel compilation; the KV it wrote is freed and no sequence state is kept. Returns its seconds."""
        t0 = time.perf_counter()
        rows = sorted({1, self.config.default_budget + 1, min(self.config.prefill_chunk, 64)})
        vocab = self.target.config.vocab_size
        for n in rows:
            ids = tuple(i % vocab for i in range(n))
            params = GenerateParams("warm-up", ids, SamplingConfig(), 1, frozenset(), False, 0)
            seq = Sequence(params, page_size=self.pool.page_size)
            try:
                run_batch(self.target, self.pool, [PrefillItem(seq, 0, n)], self.scheduler.tap_layer_ids)
            finally:
                drop_scratch(seq, self.pool)
        return time.perf_counter() - t0

    def stop(self) -> None:
        """Stop the scheduler (every sequence aborted), then the TP workers and the drafter channels."""
        self.scheduler.stop()
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()
        if self.drafter is not None and hasattr(self.drafter, "close"):
            self.drafter.close()


def build_engine(
    config: VerifierConfig,
    model_dir: str | None = None,
    *,
    model: torch.nn.Module | None = None,
    drafter: object | None = None,
) -> VerifierEngine:
    """The verifier for `config`: from `model_dir` (loaded here; at `config.tp` > 1 on ranks > 0 this call
    does not return, see tp_worker.py) or from an already loaded TP-1 `model`. `drafter` overrides the
    one `config.drafter` names (None and no address: AR only)."""
    if (model is None) == (model_dir is None):
        raise ValueError("build_engine needs exactly one of model_dir and model")
    tp = None
    if model is None:
        model, tp = _load(config, model_dir)
    static_plan = plan_static_step(config, model)  # None: eager steps; ValueError: an `on` it cannot honour
    if drafter is None and config.drafter:
        drafter = DrafterPool(
            config.drafter,
            config.draft_timeout_s,
            security=ServiceSecurity.from_config(config),
            chunk_bytes=config.feature_chunk_bytes,
            caller=drafter_caller(config),
            deadline=lambda: DraftDeadline(
                config.draft_timeout_s, config.draft_deadline_multiple, config.draft_deadline_floor_s
            ),
            local_ring_bytes=config.feature_ring_bytes if config.drafter_local == "auto" else 0,
            ring_device=model.device,
        )
    tap_layer_ids = tuple(drafter.tap_layer_ids) if drafter is not None else ()
    backend = (tp.model.model if tp is not None else model).attn_backend.name
    pool = _kv_pool(config, model.config, static_plan, len(tap_layer_ids), backend)
    if tp is not None:
        tp.model.replicate_kv(pool.cache)  # every rank holds a full copy of the latent cache
        if static_plan is not None:  # every rank builds its own over its replica, in lockstep
            shard = tp.model.model
            tp.model.start_static(
                pool.pad_slot,
                tap_layer_ids,
                lambda: make_static_step(static_plan, shard, pool.cache, pool.pad_slot, tap_layer_ids),
            )
        target: Target = ShardedTarget(tp.model)
    else:
        static = None
        if static_plan is not None:
            static = make_static_step(static_plan, model, pool.cache, pool.pad_slot, tap_layer_ids)
        target = LocalTarget(model, static=static)
    scheduler = Scheduler(target, pool, config, drafter)
    return VerifierEngine(config, target, pool, drafter, scheduler, tp)


def drafter_caller(config: VerifierConfig) -> drafter_pb2.Caller:
    """This verifier as its Draft calls name it: --instance-name (or hostname:port when it has a fixed port;
    anonymous otherwise) and an id new at every start (a restart under the same name orphans the contexts
    of its former self, which the drafter then releases)."""
    name = config.instance_name or (f"{socket.gethostname()}:{config.port}" if config.port else "")
    return drafter_pb2.Caller(name=name, incarnation=uuid.uuid4().hex)


def _load(config: VerifierConfig, model_dir: str):
    """(model, tensor-parallel group or None) for the config's device, dtype and TP degree."""
    refuse_unless_fits(config, model_dir)  # on CUDA: the memory plan, before any weight is read
    backend = resolve_attention_backend(config.attention_backend, config.device)
    if config.tp > 1:  # N ranks (tp_worker.py); on ranks > 0 this call does not return
        tp = start_tensor_parallel(config, model_dir, backend)
        return tp.model, tp
    attention = make_attention_backend(backend, config.row_invariant == "on")
    model = load_target(model_dir, dtype=TORCH_DTYPES[config.dtype], device=config.device, attention_backend=attention)
    model.eval()
    if model.device.type == "cpu":  # the layout the CPU's BLAS runs fastest at a step's few rows
        log.info("cpu_weight_layout", column_major_weights=use_column_major_weights(model))
    return model, None


def _kv_pool(config: VerifierConfig, model_config, static_plan, n_taps: int, backend: str) -> LatentKVPool:
    """The latent KV pool, sized by kv_sizing after the static step's graph pools are reserved."""
    reserve, reserve_source = graph_reserve_for(config, model_config, static_plan, n_taps, backend)
    kv = kv_size_for(config, model_config, reserve_bytes=reserve)
    log.info(
        "kv_pool",
        tokens=kv.tokens,
        bytes=kv.bytes,
        bytes_per_token=kv.bytes_per_token,
        source=kv.source,
        page_size=config.page_size,
        graph_reserve_bytes=reserve,
        graph_reserve_source=reserve_source,
        graph_reserve_applied=kv.reserve_bytes > 0,  # only kv_memory_fraction sizes from free memory
    )
    return LatentKVPool(
        model_config.num_hidden_layers,
        kv.tokens,
        model_config.kv_cache_width,
        TORCH_DTYPES[config.dtype],
        config.device,
        page_size=config.page_size,
    )

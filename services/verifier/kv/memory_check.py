"""The verifier's memory plan per GPU (models/checkpoint/memory_plan.py), from its config and the checkpoint's config.json
and safetensors headers alone: engine._load checks it before reading any weight, `ddtree inspect` prints it.

Per rank (rank 0's share, the largest; the latent KV pool is the same on every rank):
  weights      models/checkpoint/weight_bytes.py, the dtypes the loader keeps (the router fp32)
  KV pool      kv_sizing.size_kv_pool for the config's setting (a fraction: of the memory left after the
               weights and the graph pools)
  activations  graph_pool.forward_peak_bytes at the rank's share of heads and widths, for the largest
               eager forward: a prefill chunk or a full tree step (max_batch x (default_budget + 1) rows);
               keys = those rows, as the Triton MLA backend reads the pool in place
  CUDA graphs  graph_pool.graph_pool_reserve over static_step.default_buckets at the rank's widths, where
               graphs may be captured (CUDA, --cuda-graphs not off), for the attention backend it resolves
  feature ring rank 0, on CUDA with a drafter and --drafter-local auto: --feature-ring-bytes of GPU memory
               a co-located drafter reads the features from (protocol/feature_ring.py)
"""

from __future__ import annotations

import torch

from ddtree.models.checkpoint.memory_plan import MemoryPlan, check_plan, gpu_plan, verifier_rank_items
from ddtree.models.checkpoint.weight_bytes import read_checkpoint_weights
from ddtree.models.layers.attention import resolve_attention_backend
from ddtree.models.parallel.process_group import rank_device
from ddtree.telemetry.logging import get_logger
from ddtree.verifier.kv.graph_pool import forward_peak_bytes, graph_pool_reserve, rank_config
from ddtree.verifier.kv.kv_sizing import dtype_bytes_of, kv_bytes_per_token, size_kv_pool
from ddtree.verifier.step.static_step import default_buckets

log = get_logger("ddtree.verifier.kv.memory_check")


def graphs_possible(config) -> bool:
    return torch.device(config.device).type == "cuda" and config.cuda_graphs != "off"


def feature_ring_bytes(config, with_drafter: bool) -> int:
    """The co-located drafter channel's ring, on rank 0's GPU when the verifier may use one."""
    on_gpu = torch.device(config.device).type == "cuda"
    return config.feature_ring_bytes if on_gpu and with_drafter and config.drafter_local == "auto" else 0


def verifier_plan(
    config,
    model_dir: str,
    device_bytes: list[int],
    n_taps: int = 0,
    label: str = "device",
    extra=None,
    with_drafter: bool | None = None,
) -> MemoryPlan:
    """The plan of `config` (a VerifierConfig) over its tp GPUs of `device_bytes` each; `extra` maps a GPU
    index to more PlanItems on it (the drafter's, for `ddtree inspect`); with_drafter: the verifier calls a
    drafter (None: when its config names one)."""
    ring_bytes = feature_ring_bytes(config, bool(config.drafter) if with_drafter is None else with_drafter)
    s = dtype_bytes_of(config.dtype)
    weights = read_checkpoint_weights(model_dir, config.tp, config.expert_parallel, s)
    mc = weights.config
    per_token = kv_bytes_per_token(mc.num_hidden_layers, mc.kv_lora_rank, mc.qk_rope_head_dim, s)
    rows = config.default_budget + 1
    rank_mc = rank_config(mc, config.tp, config.expert_parallel)
    backend = resolve_attention_backend(config.attention_backend, config.device)
    graphs = 0
    if graphs_possible(config):
        if config.cuda_graph_reserve_gb > 0:
            graphs = int(config.cuda_graph_reserve_gb * (1 << 30))
        else:
            buckets = default_buckets(config.max_batch, rows, config.max_context + rows)
            graphs = graph_pool_reserve(rank_mc, buckets, n_taps, s, backend)
    T = max(config.prefill_chunk, config.max_batch * rows)
    activations = forward_peak_bytes(rank_mc, 1, T, T, n_taps, s, backend)
    gpus = []
    for rank in range(config.tp):
        index = rank_device(config.device, rank).index or 0
        ring = ring_bytes if rank == 0 else 0
        taken = weights.bytes_per_rank + graphs + ring
        free_after_weights = max(device_bytes[rank] - taken, per_token * config.page_size)
        kv = size_kv_pool(
            bytes_per_token=per_token, page_size=config.page_size, kv_tokens=config.kv_tokens,
            kv_memory_gb=config.kv_memory_gb, kv_memory_fraction=config.kv_memory_fraction,
            free_bytes=free_after_weights,
        )  # fmt: skip
        items = verifier_rank_items(
            rank, config.tp, weights.bytes_per_rank, kv.bytes, activations, graphs, feature_ring=ring
        )
        gpus.append(gpu_plan(index, device_bytes[rank], items, (extra or {}).get(index, ())))
    return MemoryPlan(tuple(gpus), per_token, kv.tokens, config.page_size, label)


def refuse_unless_fits(config, model_dir: str) -> MemoryPlan | None:
    """On CUDA: the plan against the memory free now on rank 0's GPU (a drafter already there counts) and
    the total memory of the others' (free memory would need a CUDA context on each of them in this process);
    MemoryPlanError, the plan in its message, when it does not fit. None elsewhere (CPU)."""
    if torch.device(config.device).type != "cuda":
        return None
    devices = [rank_device(config.device, r) for r in range(config.tp)]
    free = [torch.cuda.mem_get_info(devices[0])[0]]
    free += [torch.cuda.get_device_properties(d).total_memory for d in devices[1:]]
    plan = verifier_plan(config, model_dir, free, label="free (GPU 0) / total")
    check_plan(plan, "verifier")
    t = plan.tightest
    log.info("memory_plan", tightest_gpu=t.index, headroom_bytes=t.headroom, largest_kv_tokens=plan.largest_kv_tokens)
    return plan

"""`ddtree drafter --tp N`: the DFlash drafter as N ranks under torch.distributed (gloo on the CPU, NCCL on
CUDA), one process each, rank r on `rank_device(--device, r)` (beside verifier rank r: docs/deployment_placement.md).

Rank 0 serves gRPC and holds the engine every call reaches; ranks 1..N-1 are spawned by it and run the same
engine calls in lockstep on their shards (models/parallel/dflash_tp.py): rank 0 broadcasts each state-changing
call (draft, append, release: its whole input, features included) over the host group, then every rank runs
it, and the sharded forward's all-reduces keep the ranks' hidden states, and so their trees and contexts,
identical (TPGroup.all_reduce sums in rank order, the same on every rank). Read-only calls (knows, info,
context_end) are answered by rank 0 alone. One lock orders the broadcasts; an idle rank 0 pings the others
within the group's timeout. `warm_up` is not run at TP > 1, nor static draft blocks (eager forwards).

Each rank holds its drafter shard and rows [r·V/N, (r+1)·V/N) of the target's embedding and LM head
(VocabShardedDraftEngine): a block's embedding is summed from the rank holding each id (the others add
zeros), its log-probs are each shard's logits less the whole vocabulary's logsumexp (from every shard's max
and sum of exponentials), and its top-K is merged from every shard's top-K (dflash_tp.merge_topk).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch import Tensor

from ddtree.drafter.engine import DraftEngine
from ddtree.models.checkpoint.loader import load_tensors
from ddtree.models.dflash.checkpoint import load_drafter
from ddtree.models.parallel.dflash_tp import merge_topk, shard_dflash, shard_topk
from ddtree.models.parallel.process_group import TPGroup, destroy_tp, init_tp, rank_device, rendezvous_store
from ddtree.models.parallel.shard_plan import shard_range
from ddtree.telemetry.logging import configure_logging, get_logger

log = get_logger("ddtree.drafter.tp")
TP_TIMEOUT_S = 120.0  # a collective waiting longer for a peer fails; rank 0 pings at a quarter of it
LOCKSTEP_OPS = ("draft", "append", "release")


class VocabShardedDraftEngine(DraftEngine):
    """A DraftEngine of a sharded drafter whose embedding and LM head are rows [vocab_start, vocab_start +
    V/N) of the target's; its trees are the same on every rank (every collective's result is)."""

    def __init__(self, model, embed_shard: Tensor, lm_head_shard: Tensor, tp: TPGroup, **kwargs):
        self._tp = tp
        self._vocab_start = shard_range(model.config.vocab_size, tp.rank, tp.world_size, "vocab_size")[0]
        super().__init__(model, embed_shard, lm_head_shard, **kwargs)

    def _check_head(self, cfg, embed_weight: Tensor, lm_head_weight: Tensor) -> None:
        rows = cfg.vocab_size // self._tp.world_size
        if tuple(embed_weight.shape) != (rows, cfg.hidden_size) or lm_head_weight.shape != embed_weight.shape:
            raise ValueError(
                f"the vocabulary shards must be [{rows}, {cfg.hidden_size}], got {tuple(embed_weight.shape)} "
                f"and {tuple(lm_head_weight.shape)}"
            )

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def _embed(self, block_ids: Tensor) -> Tensor:
        local = block_ids - self._vocab_start
        mine = (local >= 0) & (local < self.embed_weight.shape[0])  # [S, B]
        x = self.embed_weight[local.masked_fill(~mine, 0)].masked_fill(~mine[..., None], 0)
        return self._tp.all_reduce(x)  # one rank holds each id, the others add exact zeros

    def _topk_logprobs(self, rows: Tensor, k: int) -> tuple[Tensor, Tensor]:
        logits = self.model.compute_logits(rows, self.lm_head_weight)  # fp32 [R, V/N]
        m = logits.max(dim=-1).values  # [R]
        stats = self._tp.all_gather(torch.stack([m, (logits - m[:, None]).exp().sum(dim=-1)], dim=-1))  # [N, R, 2]
        top = stats[..., 0].max(dim=0).values  # [R]
        lse = top + (stats[..., 1] * (stats[..., 0] - top).exp()).sum(dim=0).log()  # logsumexp of the whole row
        values, ids = shard_topk(logits - lse[:, None], k, self._vocab_start)
        return merge_topk(self._tp.all_gather(values), self._tp.all_gather(ids), k)


def build_rank_engine(cfg, model_dir: str, target_dir: str, tp: TPGroup, dtype: torch.dtype) -> DraftEngine:
    """This rank's engine: the whole drafter read on the CPU, sliced (shard_dflash), the shard and this
    rank's vocabulary rows of the target's embedding and LM head moved to the rank's device."""
    device = rank_device(cfg.device, tp.rank)
    whole = load_drafter(model_dir).to(dtype=dtype).eval()
    local = shard_dflash(whole, tp).to(device)
    del whole
    head = load_tensors(target_dir, ["model.embed_tokens.weight", "lm_head.weight"])
    lo, hi = shard_range(local.config.vocab_size, tp.rank, tp.world_size, "vocab_size")
    embed, lm_head = (head[n][lo:hi].to(device, dtype).clone() for n in ("model.embed_tokens.weight", "lm_head.weight"))
    del head
    return VocabShardedDraftEngine(
        local, embed, lm_head, tp, window=cfg.resolved_window(), default_budget=cfg.default_budget,
        max_budget=cfg.max_budget,
    )  # fmt: skip


def _recv(tp: TPGroup):
    box = [None]
    dist.broadcast_object_list(box, src=0, group=tp.cpu_group)
    return box[0]


def worker_loop(engine, tp: TPGroup) -> None:
    """Ranks > 0: run rank 0's calls in its order until it says stop. A call that fails on its input fails
    the same way on rank 0 (the same checks, before any collective): logged, and the loop goes on."""
    with torch.no_grad():
        while True:
            op, arg = _recv(tp)
            if op == "stop":
                return
            if op == "ping":
                continue
            try:
                getattr(engine, op)(arg)
            except (ValueError, KeyError) as err:
                log.info("tp_call_refused", rank=tp.rank, op=op, error=str(err))


def _spawned_rank(rank: int, cfg, model_dir: str, target_dir: str, port: int, dtype: torch.dtype) -> None:
    # rank 0 owns the ranks it spawned: it sends stop; a lost rank 0 ends them by their collectives' timeout
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(cfg.log_level, cfg.log_format)
    torch.set_num_threads(max(cfg.threads, 1))
    try:
        store = rendezvous_store("127.0.0.1", cfg.tp, TP_TIMEOUT_S, port=port)
        tp = init_tp(cfg.tp, rank, rank_device(cfg.device, rank), TP_TIMEOUT_S, store=store)
        worker_loop(build_rank_engine(cfg, model_dir, target_dir, tp, dtype), tp)
        destroy_tp()
    except BaseException as err:
        log.error("tp_drafter_rank_failed", rank=rank, error=f"{type(err).__name__}: {err}")
        sys.stderr.flush()
        os._exit(1)
    sys.stderr.flush()
    os._exit(0)


def _on_host(seqs) -> list:
    """The inputs with their features in host memory, as they are broadcast over the host group (features
    from verifier rank 0's ring arrive on GPU 0; a rank unpickling them there would touch GPU 0)."""
    return [dataclasses.replace(s, commit_features=s.commit_features.cpu()) for s in seqs]


class TensorParallelDraftEngine:
    """Rank 0's engine handle: draft / append / release broadcast to every rank first; the rest is rank 0's
    engine as is."""

    def __init__(self, engine, tp: TPGroup, children: list):
        self._engine, self._tp, self._children = engine, tp, children
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._closed = False
        threading.Thread(target=self._ping, name="tp-drafter-ping", daemon=True).start()

    def _call(self, op: str, arg):
        with self._lock, torch.no_grad():
            box = [(op, arg)]
            dist.broadcast_object_list(box, src=0, group=self._tp.cpu_group)
            self._last = time.monotonic()
            return None if op in ("stop", "ping") else getattr(self._engine, op)(arg)

    def draft(self, seqs):
        return self._call("draft", _on_host(seqs))

    def append(self, seqs):
        return self._call("append", _on_host(seqs))

    def release(self, seq_ids):
        return self._call("release", list(seq_ids))

    def __getattr__(self, name: str):
        if name == "warm_up":  # its forwards would run on rank 0 alone: not at TP > 1
            raise AttributeError(name)
        return getattr(self._engine, name)

    def _ping(self) -> None:
        while not self._closed:
            time.sleep(TP_TIMEOUT_S / 8)
            if not self._closed and time.monotonic() - self._last > TP_TIMEOUT_S / 4:
                self._call("ping", None)

    def close(self) -> None:
        if self._closed:
            return
        self._call("stop", None)
        self._closed = True
        for p in self._children:
            p.join(timeout=10)
        destroy_tp()


def start_tensor_parallel_drafter(cfg, model_dir: str, target_dir: str, dtype: torch.dtype):
    """Rank 0: spawn ranks 1..N-1 on this host, join the group, build rank 0's shard; a
    TensorParallelDraftEngine."""
    store = rendezvous_store("127.0.0.1", cfg.tp, TP_TIMEOUT_S)
    ctx = mp.get_context("spawn")
    children = []
    for rank in range(1, cfg.tp):
        p = ctx.Process(target=_spawned_rank, name=f"tp-drafter-rank-{rank}", daemon=True,
                        args=(rank, cfg, model_dir, target_dir, store.port, dtype))  # fmt: skip
        p.start()
        children.append(p)
        log.info("tp_rank_spawned", rank=rank, pid=p.pid)
    tp = init_tp(cfg.tp, 0, rank_device(cfg.device, 0), TP_TIMEOUT_S, store=store)
    engine = build_rank_engine(cfg, model_dir, target_dir, tp, dtype)
    log.info("tp_drafter_ready", ranks=cfg.tp)
    return TensorParallelDraftEngine(engine, tp, children)

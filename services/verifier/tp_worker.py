"""Tensor-parallel verifier processes (docs/design.md §7.5; docs/structure.md "Tensor parallelism").

`ddtree verifier --tp N` runs N ranks. Rank 0 serves gRPC, schedules, owns the KV pool's slot
allocation and broadcasts every forward's inputs; ranks 1..N-1 run `worker_loop`, replaying each
forward on their shard into their own replica of the latent KV cache.

Launch: with RANK / WORLD_SIZE (and MASTER_ADDR / MASTER_PORT / LOCAL_RANK) set, each process is one
rank, possibly on several nodes. Without them the process is rank 0 and spawns ranks 1..N-1 locally; a
watchdog then turns any rank's exit into `rank k exited with code c` and a non-zero exit of the server.
Every collective has a timeout (`--tp-timeout-s`), so a peer that dies or hangs mid-collective ends the
server with an error instead of a hang.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import threading
import time

import torch

from ddtree.config import VerifierConfig
from ddtree.models.dtypes import TORCH_DTYPES
from ddtree.models.layers.attention import make_attention_backend
from ddtree.models.parallel.process_group import (
    LaunchEnv,
    TPGroup,
    destroy_tp,
    init_tp,
    launch_env,
    rank_device,
    rendezvous_store,
)
from ddtree.models.parallel.step_message import CACHE, FORWARD, STATIC, STOP, recv_step
from ddtree.models.parallel.tp_model import (
    TensorParallelModel,
    load_tp_model,
    run_shard,
    run_static_shard,
    static_bucket,
)
from ddtree.telemetry.logging import configure_logging, get_logger
from ddtree.verifier.step.static_step import make_static_step, plan_static_step

log = get_logger("ddtree.verifier.tp")


def worker_loop(model, tp: TPGroup, kv_cache: torch.Tensor | None = None, static_plan=None) -> None:
    """Ranks > 0: replay rank 0's forwards until it sends STOP (a broken peer raises out of here).
    The KV replica is allocated when rank 0 says how large its pool is (CACHE); the static step over it
    (`static_plan`, the plan every rank derives from the same config) when rank 0 says which layers it taps
    (STATIC)."""
    static = None
    with torch.inference_mode():
        while True:
            kind, payload = recv_step(tp)
            if kind == STOP:
                return
            if kind == CACHE:
                kv_cache = model.new_kv_cache(payload)
                log.info("tp_kv_replica", rank=tp.rank, slots=payload)
            elif kind == STATIC:
                if kv_cache is None or static_plan is None:
                    raise RuntimeError("STATIC before CACHE, or on a rank without a static-step plan")
                pad_slot, *taps = payload.tolist()
                static = make_static_step(static_plan, model, kv_cache, pad_slot, tuple(taps))
            elif kind == FORWARD:
                if kv_cache is None:
                    raise RuntimeError("FORWARD before CACHE: rank 0 never sized the KV cache")
                bucket = static_bucket(static, payload)  # rank 0's decision, from the same message
                if bucket is not None:
                    run_static_shard(model, tp, static, bucket, payload)
                else:
                    run_shard(model, tp, payload, kv_cache)


def _load(config: VerifierConfig, model_dir: str, tp: TPGroup, device: torch.device, backend: str):
    attention = make_attention_backend(backend, config.row_invariant == "on")
    return load_tp_model(model_dir, tp, config.expert_parallel, TORCH_DTYPES[config.dtype], device, attention)


def run_worker(config: VerifierConfig, model_dir: str, env: LaunchEnv, backend: str, store=None) -> None:
    """One rank > 0, from joining the group (through rank 0's `store` if given) to rank 0's STOP."""
    device = rank_device(config.device, env.local_rank)
    tp = init_tp(
        env.world_size,
        env.rank,
        device,
        config.tp_timeout_s,
        store=store,
        init_method=None if store else f"tcp://{env.master_addr}:{env.master_port}",
        ordered_reduce=config.row_invariant == "on",
    )
    model = _load(config, model_dir, tp, device, backend)
    log.info("tp_worker_ready", rank=env.rank, world_size=env.world_size, device=str(device))
    worker_loop(model, tp, static_plan=plan_static_step(config, model))
    log.info("tp_worker_stopped", rank=env.rank)
    destroy_tp()
    # Nothing of a worker rank outlives its loop. Exit at once: letting the interpreter tear down torch's
    # gloo threads sometimes ends in std::terminate (SIGABRT), which would read as a crashed rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawned_rank(rank: int, config: VerifierConfig, model_dir: str, addr: str, port: int, backend: str) -> None:
    # Rank 0 owns the lifetime of the ranks it spawned: a Ctrl-C or SIGTERM to the process group stops
    # rank 0 gracefully, which sends STOP. (A lost rank 0 still ends them: their collectives fail.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(config.log_level, config.log_format)
    if config.threads > 0:
        torch.set_num_threads(config.threads)
    try:
        store = rendezvous_store(addr, config.tp, config.tp_timeout_s, port=port)
        run_worker(config, model_dir, LaunchEnv(addr, port, config.tp, rank, rank), backend, store)
    except BaseException as err:
        log.error("tp_worker_failed", rank=rank, error=f"{type(err).__name__}: {err}")
        sys.stderr.flush()
        os._exit(1)


@dataclasses.dataclass
class TensorParallelVerifier:
    """Rank 0's side: the broadcasting model handle, the spawned ranks and their watchdog."""

    model: TensorParallelModel
    device: torch.device
    children: dict[int, mp.Process]
    _server: object = None
    _stopping: bool = False
    _fatal_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def attach(self, running) -> None:
        """The gRPC server to take down when a rank fails."""
        self._server = running

    def close(self) -> None:
        """Graceful stop: STOP to the other ranks, wait for them, leave the group."""
        self._stopping = True
        self.model.close()
        for rank, p in self.children.items():
            p.join(timeout=10)
            if p.is_alive():
                log.warning("tp_rank_kill", rank=rank)
                p.kill()
        destroy_tp()

    def fatal(self, message: str) -> None:
        """A rank is gone or a collective failed: answer nothing more and exit non-zero."""
        if self._stopping or not self._fatal_lock.acquire(blocking=False):
            return
        self._stopping = True
        # A failed collective usually means a dead rank: name it first.
        dead = [f"rank {r} exited with code {c}" for r, c in self._exited_ranks(wait_s=2.0).items()]
        if self.children and not dead:
            dead = ["no rank exited (one is hung or unreachable)"]
        message = "; ".join(dict.fromkeys(dead + [message]))
        log.error("tp_fatal", error=message)
        print(f"verifier: {message}; stopping", file=sys.stderr, flush=True)
        server = self._server
        if server is not None:
            server.health.enter_graceful_shutdown()
            server.server.stop(0.5).wait(3.0)  # in-flight streams end with an error
        for p in self.children.values():
            if p.is_alive():
                p.kill()
        sys.stderr.flush()
        os._exit(1)

    def _exited_ranks(self, wait_s: float) -> dict[int, int]:
        """rank -> exit code of the spawned ranks that have exited, waiting up to wait_s for the first."""
        deadline = time.monotonic() + wait_s
        while True:
            gone = {r: p.exitcode for r, p in self.children.items() if p.exitcode is not None}
            if gone or not self.children or time.monotonic() > deadline:
                return gone
            time.sleep(0.05)

    def _watch(self) -> None:
        pending = dict(self.children)
        while pending:
            ready = mp.connection.wait([p.sentinel for p in pending.values()], timeout=1.0)
            for rank, p in list(pending.items()):
                if p.sentinel in ready:
                    p.join()
                    del pending[rank]
                    if not self._stopping:
                        threading.Thread(
                            target=self.fatal, args=(f"rank {rank} exited with code {p.exitcode}",), daemon=True
                        ).start()


def start_tensor_parallel(config: VerifierConfig, model_dir: str, backend: str) -> TensorParallelVerifier:
    """Join (or create) the N ranks and load rank 0's shard. On ranks > 0 this runs the worker loop and
    exits the process when rank 0 stops: only rank 0 returns."""
    if getattr(config, "page_size", 1) > 1:
        raise ValueError("--tp > 1 needs --page-size 1: KV copies at commit are not replayed on the other ranks")
    env = launch_env()
    children: dict[int, mp.Process] = {}
    store = None
    if env is None:
        store = rendezvous_store("127.0.0.1", config.tp, config.tp_timeout_s)
        env = LaunchEnv("127.0.0.1", store.port, config.tp, 0, 0)
        ctx = mp.get_context("spawn")  # before any thread or server starts
        for rank in range(1, config.tp):
            p = ctx.Process(
                target=_spawned_rank,
                name=f"tp-rank-{rank}",
                daemon=True,
                args=(rank, config, model_dir, env.master_addr, env.master_port, backend),
            )
            p.start()
            children[rank] = p
            log.info("tp_rank_spawned", rank=rank, pid=p.pid)
    elif env.world_size != config.tp:
        raise ValueError(f"WORLD_SIZE={env.world_size} but --tp {config.tp}")
    elif env.rank > 0:
        run_worker(config, model_dir, env, backend)
        sys.exit(0)
    tpv = TensorParallelVerifier(model=None, device=rank_device(config.device, env.local_rank), children=children)
    if children:
        threading.Thread(target=tpv._watch, name="tp-watchdog", daemon=True).start()
    started = time.perf_counter()
    tp = init_tp(
        env.world_size,
        0,
        tpv.device,
        config.tp_timeout_s,
        store=store,
        init_method=None if store else f"tcp://{env.master_addr}:{env.master_port}",
        ordered_reduce=config.row_invariant == "on",
    )
    shard = _load(config, model_dir, tp, tpv.device, backend)
    tpv.model = TensorParallelModel(shard, tp, ping_interval_s=config.tp_timeout_s / 4, on_failure=tpv.fatal)
    log.info(
        "tp_ready",
        world_size=config.tp,
        expert_parallel=config.expert_parallel,
        load_s=round(time.perf_counter() - started, 2),
    )
    return tpv

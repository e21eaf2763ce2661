"""`measure_step`: one verify step's cost, the library behind `ddtree bench step` (and the selftest's
step check).

The step is the verifier's: services/verifier/step/batch.py `run_batch` over work items (step_batch.py) into
the target the verifier would build, `LocalTarget` at TP 1 or, for an emulated rank, `ShardedTarget`
over the rank-0 handle `TensorParallelModel` in a one-rank group (its step message, forward,
all-reduces and argmax gather all run; the peers it would wait for do not exist). After warm-up steps:
- one step counted (op_count.py): everything `target.run` does (the step message, the forward, the LM
  head and the greedy accept walk or the argmax combine); the forward's part, per decoder layer and
  per submodule, apart. Batch building and slot allocation (host bookkeeping) are outside it. Work
  done once per forward and cached (an attention plan, a sequence's key slots) lands in the first
  layer that asks for it: Kimi's first layer is dense, so its MoE layers show their own cost.
- `repeat` steps timed eagerly (median and best; the device synchronised around each);
- the same with CUDA graphs through the verifier's static step (services/verifier/step/static_step.py) when
  the device is CUDA (an emulated rank's shard too: its forward, all-reduces included, is replayed, then
  its own vocabulary slice's head; the step message is not sent); otherwise `graphs` is None and
  `graphs_unavailable` says why.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import statistics
import time

import torch

from ddtree.tools.step_cost.collectives import count_collectives, one_rank_group
from ddtree.tools.step_cost.kernel_route import route_kernels
from ddtree.tools.step_cost.layer_scopes import FORWARD, layer_key, layer_scopes, moe_layer_ids
from ddtree.tools.step_cost.op_count import OpCounter
from ddtree.tools.step_cost.step_batch import StepShape, StepWork, make_step_work
from ddtree.tools.step_cost.step_model import ModelSpec, build_model, describe
from ddtree.tools.step_cost.step_ranks import rank_group
from ddtree.tools.step_cost.triton_launches import count_triton_launches

WARMUP_STEPS = {"cpu": 1, "cuda": 3}  # CUDA: the fused MoE's autotuning and the allocator settle
TOP_OPS = 15
PING_INTERVAL_S = 3600.0  # the emulated rank has no peer to keep alive


class _CountedTarget:
    """`target` with `counting` active around each run (only around it: not the batch building)."""

    def __init__(self, target, counting):
        self.target, self.counting, self.config = target, counting, target.config
        self.prepare = getattr(target, "prepare", None)  # run_batch prepares the step before the counted run

    def run(self, inputs, heads):
        with self.counting():
            return self.target.run(inputs, heads)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step, repeat: int, device: torch.device) -> dict:
    """{median, best} ms of `repeat` calls of step(), each between device synchronisations."""
    times = []
    for _ in range(max(repeat, 1)):
        _synchronize(device)
        t0 = time.perf_counter()
        step()
        _synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return {"median": round(statistics.median(times), 3), "best": round(min(times), 3)}


def _make_target(model, tp):
    from ddtree.models.parallel.tp_model import TensorParallelModel
    from ddtree.verifier.step.target import LocalTarget, ShardedTarget

    if tp is None:
        return LocalTarget(model), None
    handle = TensorParallelModel(model, tp, ping_interval_s=PING_INTERVAL_S)
    return ShardedTarget(handle), handle


def _close_handle(handle) -> None:
    """Stop the rank-0 handle and wait for its ping thread: a thread still running when the interpreter
    exits may hold the last reference to the model, and freeing it there aborts the process."""
    handle.close()
    pinger = getattr(handle, "_pinger", None)
    if pinger is not None:
        pinger.join()


def count_step(model, target, work: StepWork, device: torch.device) -> dict:
    """Launches, syncs, Triton launches and collectives of one step (see the module docstring)."""
    counter = OpCounter(device.type)
    collectives: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def counting():
        with counter.value_reads(), count_triton_launches(counter), count_collectives(collectives), counter:
            yield

    with layer_scopes(model, counter):
        work.run(_CountedTarget(target, counting))
    step, forward = counter.total(), counter.total(FORWARD)
    layers = [counter.total(layer_key(i)) for i in range(len(model.model.layers))]
    moe = set(moe_layer_ids(model))
    moe_ops = [t.launches for i, t in enumerate(layers) if i in moe]
    dense_ops = [t.launches for i, t in enumerate(layers) if i not in moe]

    def parts(ids) -> dict:
        """Mean launches per submodule over the layers `ids`; `other`: the layer's own (residual adds,
        all-reduces, and norms run as layer kernels rather than through their modules)."""
        if not ids:
            return {}
        names = [name for name, _ in model.model.layers[ids[0]].named_children()]
        out = {p: statistics.mean(counter.tallies[(*layer_key(i), p)].launches for i in ids) for p in names}
        out["other"] = statistics.mean(counter.tallies[layer_key(i)].launches for i in ids)
        return {k: round(v, 2) for k, v in out.items()}

    return {
        "ops_per_step": step.launches,
        "host_syncs_per_step": step.host_syncs,
        "triton_launches_per_step": step.triton_launches,
        "host_to_device_copies_per_step": step.host_to_device,
        "all_reduces_per_step": collectives["all_reduce"],
        "all_gathers_per_step": collectives["all_gather"],
        "broadcasts_per_step": collectives["broadcast_cpu"],
        "forward": {
            "ops": forward.launches,
            "host_syncs": forward.host_syncs,
            "triton_launches": forward.triton_launches,
        },
        "outside_forward": {
            "ops": step.launches - forward.launches,
            "host_syncs": step.host_syncs - forward.host_syncs,
        },
        "ops_per_moe_layer": max(moe_ops) if moe_ops else None,
        "ops_per_moe_layer_mean": round(statistics.mean(moe_ops), 2) if moe_ops else None,
        "ops_per_dense_layer": max(dense_ops) if dense_ops else None,
        "ops_per_dense_layer_mean": round(statistics.mean(dense_ops), 2) if dense_ops else None,
        "host_syncs_per_moe_layer": max((layers[i].host_syncs for i in moe), default=None),
        "host_syncs_per_dense_layer": max((t.host_syncs for i, t in enumerate(layers) if i not in moe), default=None),
        "moe_layer_parts": parts(sorted(moe)),
        "dense_layer_parts": parts([i for i in range(len(layers)) if i not in moe]),
        "host_sync_sites": [{"site": site, "op": op, "count": n} for (site, op), n in counter.sync_sites.most_common()],
        "top_ops": [{"op": op, "count": n} for op, n in counter.names.most_common(TOP_OPS)],
    }


def graphs_unavailable(model, spec: ModelSpec, device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device (this is {device.type})"
    if spec.tp > 1:
        return "real ranks are measured eagerly here (--emulate-tp N measures a rank's graphs)"
    return None  # any model, an emulated shard too (its forward's all-reduces run in its one-rank group)


def graphs_step_ms(model, work: StepWork, shape: StepShape, repeat: int, device: torch.device):
    """(timing, None) through a static step captured at the tightest bucket that fits this step (batch a
    power of two, keys the step's own when they are not on the 512-doubling ladder), or (None, why)."""
    from ddtree.models.runtime.static_shapes import doubling_sizes, powers_of_two_up_to
    from ddtree.verifier.step.static_step import Bucket, StaticStep
    from ddtree.verifier.step.target import LocalTarget

    keys = shape.context + shape.rows
    bucket = Bucket(
        next(b for b in powers_of_two_up_to(shape.batch * 2) if b >= shape.batch),
        shape.rows,
        next(k for k in doubling_sizes(512, max(keys, 512)) if k >= keys),
    )
    static = StaticStep(model, work.pool.cache, work.pool.pad_slot, (bucket,), work.taps, graphs=True)
    static.capture()
    target = LocalTarget(model, static=static)
    for _ in range(2):
        work.run(target)
    before = static.replays
    timing = time_steps(lambda: work.run(target), repeat, device)
    if static.replays == before:
        return None, f"the step fit no captured bucket ({bucket})"
    return timing, None


@dataclasses.dataclass
class StepBench:
    """A built model and its target, measured at one step shape after another (`measure`)."""

    spec: ModelSpec
    model: torch.nn.Module
    target: object
    device: torch.device
    build_s: float

    def measure(self, shape: StepShape, repeat: int = 5, graphs: bool = True, warmup: int | None = None) -> dict:
        """The step's report (the JSON of `ddtree bench step`); warmup None: WARMUP_STEPS of the device."""
        spec, model, device = self.spec, self.model, self.device
        work = make_step_work(model.config, shape, device, model.dtype, spec.seed)
        if spec.tp > 1:  # the other ranks' replicas of this step's cache
            self.target.model.replicate_kv(work.pool.cache)
        for _ in range(WARMUP_STEPS.get(device.type, 1) if warmup is None else warmup):
            work.run(self.target)
        counts = count_step(model, self.target, work, device)
        eager = time_steps(lambda: work.run(self.target), repeat, device)
        kernel_us = None
        if device.type == "cuda":  # each CUDA kernel's time per eager step (tools/roofline/kernel_times.py)
            from ddtree.tools.roofline.kernel_times import profile_kernels

            kernel_us = profile_kernels(lambda: work.run(self.target), repeat)
        reason = graphs_unavailable(model, spec, device) if graphs else "--no-graphs"
        graphed = None
        if reason is None:
            try:
                graphed, reason = graphs_step_ms(model, work, shape, repeat, device)
            except Exception as err:  # the static step refused or broke: the eager numbers stand
                reason = f"static step failed: {type(err).__name__}: {err}"
        moe = moe_layer_ids(model)
        return {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
            "rows": shape.rows,
            "context": shape.context,
            "batch": shape.batch,
            "taps": list(shape.taps),
            "tp": spec.tp,
            "emulate_tp": spec.emulate_tp,
            "expert_parallel": spec.expert_parallel,
            "kernels": spec.kernels,
            "layers": len(model.model.layers),
            "moe_layers": len(moe),
            "dense_layers": len(model.model.layers) - len(moe),
            "step_ms": {"eager": eager["median"], "graphs": graphed["median"] if graphed else None},
            "step_ms_best": {"eager": eager["best"], "graphs": graphed["best"] if graphed else None},
            "graphs_unavailable": reason,
            "repeat": repeat,
            "warmup": WARMUP_STEPS.get(device.type, 1) if warmup is None else warmup,
            "build_s": round(self.build_s, 2),
            "kernel_us": kernel_us,
            **counts,
            "config": describe(model, spec),
        }


@contextlib.contextmanager
def step_bench(spec: ModelSpec):
    """The model of `spec` built on its device with its target (an emulated rank: in a one-rank group),
    kernels routed as spec.kernels says; torn down on exit: the handle's thread joined, the model and its
    target released (and collected) before the group is destroyed."""
    device = torch.device(spec.device)
    with contextlib.ExitStack() as group:
        if spec.tp > 1:
            tp = group.enter_context(rank_group(spec))
        else:
            tp = group.enter_context(one_rank_group(device)) if spec.emulate_tp > 1 else None
        bench = None
        try:
            with contextlib.ExitStack() as stack:
                t0 = time.perf_counter()
                model = build_model(spec, tp)
                build_s = time.perf_counter() - t0
                target, handle = _make_target(model, tp)
                if handle is not None:
                    stack.callback(_close_handle, handle)
                stack.enter_context(route_kernels(model, spec.kernels))
                bench = StepBench(spec, model, target, device, build_s)
                del model, target, handle
                yield bench
        finally:
            if bench is not None:
                bench.model = bench.target = None
            del bench
            gc.collect()


def measure_step(
    spec: ModelSpec, shape: StepShape, repeat: int = 5, graphs: bool = True, warmup: int | None = None
) -> dict:
    """One shape's report: build, measure, tear down."""
    with step_bench(spec) as bench:
        return bench.measure(shape, repeat, graphs, warmup)

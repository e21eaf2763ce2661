"""Part (c) of `ddtree selftest gpu`: the verify step of one Kimi K2.6 rank, what `ddtree bench step`
measures (tools/step_cost/step_measure.py), over the shapes the deployment runs.

The model is rank 0's shard of Kimi K2.6 at TP 8 (`--emulate-tp 8`: 8 of 64 heads, every routed
expert's 256 of 2048 columns in INT4 groups of 32, a 20480-row vocabulary slice; all 61 layers),
random weights made on the GPU from docs/kimi_k26_config.json, its all-reduces in a one-rank group.
On a GPU that cannot hold all 61 layers (about 76 GB of weights) the depth is halved until it fits, and
the JSON says how many were measured. For AR decode (1 row) and trees of 9 and 17 rows, at contexts 128 / 1k / 8k / 32k: step ms eager and
with CUDA graphs (or why not), launches per step and per MoE layer, host syncs per step, Triton
launches and all-reduces. Nothing is compared: these are the numbers the step is judged by. At the
contexts of `off_contexts` (8k, where the goals are judged) each shape is also timed eagerly with
row invariance off (`ddtree verifier --row-invariant off`: the attention's throughput plan), the cost of
the guarantee on this device: `eager_ms_row_invariant_off` beside `step_ms.eager` (graphs: the static
step's attention is row invariant either way; the rank's all-reduces run in a one-rank group).

Dry run (a CPU): a narrow Kimi-shaped config (kimi_checkpoint.make_config: 2 layers, hidden 128, 8
heads, 8 INT4 experts) as the same TP-8 rank, context 16, rows 1 / 3, the Triton kernels interpreted
(the GPU's path, each launch counted once).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import pathlib
import time
import traceback

from ddtree.tools.selftest import kimi_checkpoint
from ddtree.tools.step_cost.step_model import ModelSpec

REPORTED = ("rows", "context", "step_ms", "step_ms_best", "graphs_unavailable", "ops_per_step", "ops_per_moe_layer",
            "ops_per_moe_layer_mean", "ops_per_dense_layer", "host_syncs_per_step", "triton_launches_per_step",
            "all_reduces_per_step", "forward")  # fmt: skip
DRY_CONFIG = ["--layers", "2", "--experts", "8", "--hidden", "128", "--vocab", "1024", "--heads", "8", "--q-lora", "64",
              "--kv-lora", "64", "--moe-width", "256", "--dense-width", "256"]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class StepPlan:
    emulate_tp: int
    layers: int  # 0 = the config's
    rows: tuple[int, ...]
    contexts: tuple[int, ...]
    off_contexts: tuple[int, ...]  # contexts whose shapes are also timed with row invariance off
    repeat: int
    device: str
    kernels: str


def make_plan(dry_run: bool) -> StepPlan:
    if dry_run:
        return StepPlan(8, 0, (1, 3), (16,), (16,), 1, "cpu", "triton")
    # 8k first: the goal is judged there, and a deadline cuts the shapes measured last
    return StepPlan(8, 0, (1, 9, 17), (8192, 1024, 32768, 128), (8192,), 10, "cuda", "auto")


def config_file(dry_run: bool, work: pathlib.Path) -> pathlib.Path:
    """The Kimi K2.6 config, or (dry run) a narrow config of the same layout written into `work`."""
    if not dry_run:
        return kimi_checkpoint.K26_CONFIG
    raw = kimi_checkpoint.make_config(kimi_checkpoint.parse_args(["--out", str(work), *DRY_CONFIG]))
    path = work / "step_config.json"
    path.write_text(json.dumps(raw, indent=1))
    return path


def open_bench(spec, log):
    """(ExitStack, StepBench) of `spec`, at fewer layers (halved until it fits, at least 2) when the
    device's memory cannot hold them all (an 80 GB GPU does not hold the full-depth rank)."""
    import torch

    from ddtree.tools.step_cost.step_measure import step_bench
    from ddtree.tools.step_cost.step_model import model_config, read_raw_config

    while True:
        stack = contextlib.ExitStack()
        try:
            return stack, stack.enter_context(step_bench(spec))
        except torch.OutOfMemoryError:
            stack.close()
        layers = (spec.layers or model_config(spec, read_raw_config(spec)).num_hidden_layers) // 2
        if layers < 2:
            raise RuntimeError("the Kimi K2.6 rank does not fit this device even at 2 layers")
        log(f"out of device memory at {spec.layers or 'all'} layers: {layers} layers instead")
        gc.collect()  # outside the except clause: its traceback no longer holds the partial model
        torch.cuda.empty_cache()
        spec = dataclasses.replace(spec, layers=layers)


def run_step_check(dry_run: bool, work: pathlib.Path, deadline: float, log, on_row=lambda out: None) -> dict:
    """{plan, model, rows, skipped, errors}; a shape after `deadline` (perf_counter) is skipped; on_row(out)
    after every shape (the JSON saved: record.py)."""
    from ddtree.tools.step_cost.step_batch import StepShape

    plan = make_plan(dry_run)
    source = config_file(dry_run, work)
    spec = ModelSpec(str(source), random_weights=True, device=plan.device, layers=plan.layers,
                     emulate_tp=plan.emulate_tp, kernels=plan.kernels)  # fmt: skip
    out = {"plan": dataclasses.asdict(plan), "source": str(source), "rows": [], "skipped": 0, "errors": []}
    log(f"{'rows':>4} {'context':>7} {'eager ms':>9} {'graphs ms':>9} {'ops':>6} {'ops/MoE':>7} {'syncs':>5} "
        f"{'triton':>6} {'allred':>6}")  # fmt: skip
    stack, bench = open_bench(spec, log)
    with stack:
        out["model"] = {"build_s": round(bench.build_s, 1), "layers": len(bench.model.model.layers)}
        on_row(out)
        for context in plan.contexts:
            for rows in plan.rows:
                if time.perf_counter() > deadline:
                    out["skipped"] += 1
                    continue
                try:
                    report = bench.measure(StepShape(rows=rows, context=context), repeat=plan.repeat)
                except Exception:
                    out["errors"].append(dict(part="step", rows=rows, context=context,
                                              error=traceback.format_exc()[-3000:]))  # fmt: skip
                    on_row(out)
                    continue
                out.setdefault("config", report["config"])
                row = {k: report[k] for k in REPORTED}
                if context in plan.off_contexts:
                    row["eager_ms_row_invariant_off"] = eager_ms_invariance_off(bench, StepShape(rows, context),
                                                                                plan.repeat)  # fmt: skip
                out["rows"].append(row)
                on_row(out)
                graphs = report["step_ms"]["graphs"]
                log(f"{rows:>4} {context:>7} {report['step_ms']['eager']:>9.2f} "
                    f"{'n/a' if graphs is None else f'{graphs:.2f}':>9} {report['ops_per_step']:>6} "
                    f"{report['ops_per_moe_layer']!s:>7} {report['host_syncs_per_step']:>5} "
                    f"{report['triton_launches_per_step']:>6} {report['all_reduces_per_step']:>6}{_off_text(row)}")  # fmt: skip
    unavailable = {r["graphs_unavailable"] for r in out["rows"] if r["graphs_unavailable"]}
    if unavailable:
        log(f"CUDA graphs: {'; '.join(sorted(unavailable))}")
    return out


def _off_text(row: dict) -> str:
    off = row.get("eager_ms_row_invariant_off")
    return "" if off is None else f"  (row invariance off: eager {off:.2f} ms)"


def eager_ms_invariance_off(bench, shape, repeat: int) -> float | None:
    """The eager step's median ms with the attention's throughput plan (MLAKernelConfig.row_invariant False,
    what `--row-invariant off` loads), the model's own backend put back after; None without the Triton
    attention (the torch path has no such plan)."""
    backend = bench.model.attn_backend
    if backend.name != "triton":
        return None
    bench.model.attn_backend = type(backend)(dataclasses.replace(backend.config, row_invariant=False))
    try:
        return bench.measure(shape, repeat, graphs=False)["step_ms"]["eager"]
    finally:
        bench.model.attn_backend = backend

"""`ddtree bench step`: what one verify step costs on this device, and why.

    ddtree bench step --model checkpoints/demo/target --rows 17 --context 1024
    ddtree bench step --config docs/kimi_k26_config.json --random-weights --emulate-tp 8 --layers 4
    ddtree bench step --model DIR --kernels triton --device cpu     # the device path, interpreted

It runs the verifier's step (services/verifier/step/batch.py over a tree of --rows rows per sequence, each
sequence with --context tokens of random latents in the KV cache) and reports step ms (eager, and with
CUDA graphs when the verifier's static step can take the model), launches per step and per decoder
layer, host syncs per step (and where they are asked for), Triton launches and the tensor-parallel
collectives. Launches and syncs are counted with a torch dispatch mode (tools/step_cost/op_count.py: views
and other metadata-only ops are not launches; a sync is an op that reads a tensor's value to the host),
so a CPU counts them too; with --kernels triton on a CPU the kernels run under the Triton interpreter
and each launch counts once.

--emulate-tp N builds rank 0's shard of a TP-N model (its heads, expert columns or, with
--expert-parallel, experts, its vocabulary slice) on this one device; its all-reduces run in a
one-rank group and are counted: the per-rank cost of the real deployment, without its wire time.
--tp N runs N real ranks (this process rank 0, the others spawned: gloo on the CPU, one GPU each on
CUDA) and reports rank 0's step with the collectives' wire time (eagerly).
"""

from __future__ import annotations

import argparse
import json
import pathlib

DTYPES = ("auto", "bfloat16", "float16", "float32")
DEVICE_MODELS = ("h100", "h200", "b200", "rtx-pro-6000")  # tools/roofline/devices.py DEVICES


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "step",
        help="one verify step's cost: ms (eager / graphs), launches, host syncs, all-reduces",
        description=__doc__.split("\n\n")[0],
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a checkpoint directory")
    src.add_argument("--config", help="a config.json (HF or Kimi K2.5 layout); needs --random-weights")
    p.add_argument("--random-weights", action="store_true", help="random weights made on the device (no disk)")
    p.add_argument("--tp", type=int, default=1, help="real tensor-parallel ranks, spawned here (rank 0 is measured)")
    p.add_argument("--emulate-tp", type=int, default=1, help="measure rank 0's shard of a TP-N model")
    p.add_argument("--expert-parallel", action="store_true", help="with --emulate-tp: whole experts per rank")
    p.add_argument("--rows", type=int, default=17, help="tree rows per sequence: root + nodes (1 = AR decode)")
    p.add_argument("--context", type=int, default=1024, help="tokens already in each sequence's KV cache")
    p.add_argument("--batch", type=int, default=1, help="sequences in the step")
    p.add_argument("--layers", type=int, default=0, help="keep the first L decoder layers (0 = all)")
    p.add_argument("--taps", default="", help="comma-separated layers tapped for the drafter (default none)")
    p.add_argument("--kernels", choices=("auto", "torch", "triton"), default="auto",
                   help="auto: the device's choice; triton on a CPU runs the kernels interpreted")  # fmt: skip
    p.add_argument("--device", default="auto", help="auto = cuda when available, else cpu")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: the checkpoint's (random: the config's)")
    p.add_argument("--repeat", type=int, default=5, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: 1 on a CPU, 3 on CUDA)")
    p.add_argument("--no-graphs", action="store_true", help="eager only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device-model", choices=DEVICE_MODELS, default=None,
                   help="model the step on this device from shapes alone (meta tensors, nothing runs; a checkpoint's "
                        "config.json is enough): the roofline of every kernel and the step (tools/roofline/roofline.py)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--out", type=pathlib.Path, default=None, help="also write the JSON here")
    p.set_defaults(fn=run)
    return p


def resolve_device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_args(args: argparse.Namespace) -> None:
    if args.config and not args.random_weights:
        raise ValueError("--config FILE needs --random-weights (a config has no weights)")
    if args.tp < 1 or (args.tp > 1 and args.emulate_tp > 1):
        raise ValueError("--tp N (real ranks) and --emulate-tp N (one rank's shard here) exclude each other; N >= 1")
    if args.emulate_tp < 1 or args.rows < 1 or args.context < 0 or args.batch < 1 or args.repeat < 1:
        raise ValueError("--emulate-tp, --rows, --batch and --repeat must be >= 1, --context >= 0")
    if args.warmup is not None and args.warmup < 0:
        raise ValueError("--warmup must be >= 0")
    if args.expert_parallel and max(args.emulate_tp, args.tp) < 2:
        raise ValueError("--expert-parallel needs --tp N or --emulate-tp N, N >= 2")
    if args.device_model and args.tp > 1:
        raise ValueError("--device-model models one rank from shapes alone: --emulate-tp N, not --tp N")


def spec_and_shape(args: argparse.Namespace):
    from ddtree.tools.step_cost.step_batch import StepShape
    from ddtree.tools.step_cost.step_model import ModelSpec

    spec = ModelSpec(
        source=args.model or args.config,
        random_weights=args.random_weights,
        device=args.device,
        dtype=args.dtype,
        layers=args.layers,
        emulate_tp=args.emulate_tp,
        tp=args.tp,
        expert_parallel=args.expert_parallel,
        kernels=args.kernels,
        seed=args.seed,
    )
    taps = tuple(int(t) for t in args.taps.split(",") if t.strip())
    return spec, StepShape(rows=args.rows, context=args.context, batch=args.batch, taps=taps)


def format_report(r: dict) -> str:
    from ddtree.tools.bench.output import format_table

    c = r["config"]
    shard = "TP 1"
    if r["emulate_tp"] > 1:
        shard = f"rank 0 of TP {r['emulate_tp']} (emulated)"
    elif r["tp"] > 1:
        shard = f"rank 0 of TP {r['tp']}"
    head = (f"{c['source']}{' (random weights)' if c['random_weights'] else ''} on {r['device']}, {shard}, "
            f"kernels {r['kernels']}: {r['rows']} rows x {r['batch']} at context {r['context']}, "
            f"{r['layers']} layers ({r['moe_layers']} MoE)")  # fmt: skip
    graphs = r["step_ms"]["graphs"]
    rows = [
        ["step ms, eager (median)", r["step_ms"]["eager"]],
        ["step ms, CUDA graphs", graphs if graphs is not None else f"n/a: {r['graphs_unavailable']}"],
        ["ops per step (forward)", f"{r['ops_per_step']} ({r['forward']['ops']})"],
        ["ops per MoE layer (max / mean)", f"{r['ops_per_moe_layer']} / {r['ops_per_moe_layer_mean']}"],
        ["ops per dense layer (max / mean)", f"{r['ops_per_dense_layer']} / {r['ops_per_dense_layer_mean']}"],
        ["host syncs per step (forward)", f"{r['host_syncs_per_step']} ({r['forward']['host_syncs']})"],
        ["Triton launches per step", r["triton_launches_per_step"]],
        ["all-reduces per step", r["all_reduces_per_step"]],
    ]
    sites = [f"  {s['count']:>4} x {s['op']} at {s['site']}" for s in r["host_sync_sites"][:8]]
    return "\n".join([head, format_table(["", "value"], rows), *(["host syncs by site:", *sites] if sites else [])])


def run_model(args: argparse.Namespace) -> int:
    """--device-model: the step's roofline from shapes alone."""
    from ddtree.tools.roofline.devices import device_model
    from ddtree.tools.roofline.roofline import format_roofline
    from ddtree.tools.roofline.step_roofline import model_step

    spec, shape = spec_and_shape(args)
    report = model_step(spec, shape, device_model(args.device_model))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2) if args.json else format_roofline(report))
    return 0


def measured_roofline(spec, shape, report: dict) -> dict | None:
    """On a GPU of devices.py's table: the step's roofline with each kernel's measured time (kernel_times.py)."""
    from ddtree.tools.roofline.devices import model_of_gpu
    from ddtree.tools.roofline.kernel_times import attach_measured
    from ddtree.tools.roofline.step_roofline import model_step

    dev = model_of_gpu(report["device"])
    if dev is None:
        return None
    return attach_measured(model_step(spec, shape, dev), report["kernel_us"])


def run(args: argparse.Namespace) -> int:
    check_args(args)
    if args.device_model:
        return run_model(args)
    args.device = resolve_device(args.device)
    if args.kernels == "triton" and args.device == "cpu":
        from ddtree.tools.step_cost.kernel_route import interpret_triton

        interpret_triton()
    from ddtree.tools.step_cost.step_measure import measure_step

    spec, shape = spec_and_shape(args)
    report = measure_step(spec, shape, repeat=args.repeat, graphs=not args.no_graphs, warmup=args.warmup)
    if report.get("kernel_us") is not None:
        report["roofline"] = measured_roofline(spec, shape, report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    text = format_report(report)
    if report.get("roofline"):
        from ddtree.tools.roofline.roofline import format_roofline

        text += "\n" + format_roofline(report["roofline"])
    print(json.dumps(report, indent=2) if args.json else text)
    return 0

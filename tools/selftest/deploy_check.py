"""A deployment part of `ddtree selftest gpu` (issue 37): what start-up costs and what the memory plan admits.

On the Kimi-K2.6-shaped checkpoint of the serving part (serving_check.make_plan / make_checkpoint), one
verifier (AR only) and the gateway as processes on the device:

1. the memory plan (verifier/kv/memory_check.py) of the verifier with the largest KV pool it admits on this
   device (the memory free now less PLAN_MARGIN_BYTES, as the verifier checks its plan against the memory
   free at its start; the dry run: DRY_RUN_DEVICE_BYTES), and what the device reports free once
   that verifier serves (torch.cuda.mem_get_info from this process, whose own CUDA context is counted
   too; the dry run: MemAvailable);
2. warm start: seconds from starting the verifier to its health saying SERVING (its LISTENING line), and
   the latency of the first request through the gateway against the same request again, warm.

`run_deploy_check(dry_run, work, log)` returns a JSON-ready dict: plan (tokens, bytes per GPU, headroom),
free_after_start_bytes, start_s, first_request_s, warm_request_s and errors.
"""

from __future__ import annotations

import pathlib
import time
import traceback

DRY_RUN_DEVICE_BYTES = 3 * 10**9
PLAN_MARGIN_BYTES = 1 << 30  # on CUDA: what may move between this plan and the verifier's own check
REQUEST_TOKENS = 16


def device_bytes(device: str) -> tuple[int, int]:
    """(total, free) bytes of the device: CUDA's, or the host's memory on the CPU."""
    from ddtree.verifier.kv.kv_sizing import free_device_memory

    if device.startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        return total, free
    return DRY_RUN_DEVICE_BYTES, free_device_memory("cpu")


def admitted_plan(model: pathlib.Path, device: str, total: int, flags: list[str]):
    """(VerifierConfig, MemoryPlan): the verifier of `flags` on one device of `total` bytes, its KV pool the
    largest the plan admits there."""
    from ddtree.config import VerifierConfig
    from ddtree.tools.gpu_plan import service_config
    from ddtree.verifier.kv.memory_check import verifier_plan

    config = service_config(VerifierConfig, " ".join(flags), "--device", device)
    largest = verifier_plan(config, str(model), [total]).largest_kv_tokens
    config = service_config(VerifierConfig, " ".join([*flags, "--kv-tokens", str(max(largest, 1))]), "--device", device)
    return config, verifier_plan(config, str(model), [total])


def timed_request(gateway: str) -> float:
    from ddtree.client import generate
    from ddtree.protocol.ddtree.v1 import gateway_pb2

    opts = gateway_pb2.GenerationOptions(max_tokens=REQUEST_TOKENS, ignore_eos=True, no_spec=True)
    t0 = time.perf_counter()
    generate(gateway, "def parse(text):", options=opts)
    return time.perf_counter() - t0


def run_deploy_check(dry_run: bool, work: pathlib.Path, log=print) -> dict:
    from ddtree.launcher import start_service
    from ddtree.tools.selftest import serving_check as gs

    plan = gs.make_plan(dry_run)
    out: dict = dict(errors=[])
    model = work / "deploy-model"
    try:
        if not (model / "config.json").exists():
            model.mkdir(parents=True, exist_ok=True)
            gs.make_checkpoint(plan, model)
        total, free = device_bytes(plan.device)
        # The verifier checks its plan against the memory free when it starts, which this process's CUDA
        # context (and anything a part before held) already takes: plan against that, less a margin.
        room = total if not plan.device.startswith("cuda") else free - PLAN_MARGIN_BYTES
        flags = ["--dtype", "bfloat16", "--max-batch", "4", "--prefill-chunk", str(plan.prefill_chunk)]
        config, mem = admitted_plan(model, plan.device, room, flags)
        gpu = mem.gpus[0]
        out["plan"] = dict(device_bytes=gpu.device_bytes, used_bytes=gpu.used, headroom_bytes=gpu.headroom,
                           kv_tokens=mem.kv_tokens, items={i.what: i.bytes for i in gpu.items},
                           total_bytes=total, free_bytes=free)  # fmt: skip
        log(f"memory plan on {room / 1e9:.1f} GB ({total / 1e9:.1f} GB total, {free / 1e9:.1f} GB free): "
            f"KV {mem.kv_tokens:,} tokens, {gpu.used / 1e9:.2f} GB planned")  # fmt: skip
        args = ["verifier", "--model", str(model), "--port", "0", "--device", plan.device, *flags]
        args += ["--kv-tokens", str(mem.kv_tokens), "--max-context", str(min(mem.kv_tokens, 4096))]
        t0 = time.perf_counter()
        verifier = start_service("verifier", args, work / "logs", timeout=1800)
        try:
            out["start_s"] = time.perf_counter() - t0
            out["free_after_start_bytes"] = device_bytes(plan.device)[1]
            gw = start_service("gateway", ["gateway", "--verifier", verifier.address, "--tokenizer", str(model),
                                           "--port", "0", "--http-port", "-1"], work / "logs")  # fmt: skip
            try:
                out["first_request_s"] = timed_request(gw.address)
                out["warm_request_s"] = timed_request(gw.address)
            finally:
                gw.stop()
        finally:
            verifier.stop()
        log(f"start {out['start_s']:.1f} s, first request {out['first_request_s']:.3f} s, warm "
            f"{out['warm_request_s']:.3f} s; free after start {out['free_after_start_bytes'] / 1e9:.2f} GB "
            f"(planned headroom {gpu.headroom / 1e9:.2f} GB)")  # fmt: skip
    except Exception:
        out["errors"].append(dict(part="deploy", error=traceback.format_exc()[-3000:]))
        traceback.print_exc()
    return out

"""`ddtree inspect CONFIG --device-memory-gb G [--drafter DRAFTER]`: the memory plan of a deployment, GPU by GPU.

The verifier's ranks on GPUs 0 .. tp-1 (verifier/kv/memory_check.py) and, with --drafter, the drafter
(drafter/memory_check.py), each with the settings the services would run with: `--verifier-args` /
`--drafter-args` are the services' own flags (defaults: CUDA, bfloat16, the services' defaults otherwise), so
that the plan is the one they check at start-up. The drafter's contexts are planned for the verifier's
--max-batch sequences.

Placement: the drafter's --tp defaults to the verifier's, its rank r on verifier rank r's GPU, drafting with
its shard (drafter/tp_drafter.py; the features reach its rank 0 through verifier rank 0's ring, so that ring
is on GPU 0 only). `--drafter-args "--tp 1"` plans one whole drafter on its --device's GPU (GPU 0 by default: the
placement of the kimi-k26 env files today).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex

import torch

from ddtree.config import DrafterConfig, VerifierConfig, add_config_flags, config_from_flags
from ddtree.drafter.factory import drafter_dtype
from ddtree.drafter.memory_check import drafter_plan_items, read_drafter_config
from ddtree.models.checkpoint.memory_plan import MemoryPlan, gpu_plan
from ddtree.models.parallel.process_group import rank_device
from ddtree.verifier.kv.memory_check import verifier_plan

GPU_DEFAULTS = ("--device", "cuda", "--dtype", "bfloat16")


def service_config(cls, flags: str, *defaults: str):
    """A service config from its own command-line flags (one string), `defaults` first; no environment."""
    parser = argparse.ArgumentParser(prog=f"--{cls.flag_group}-args", add_help=False)
    add_config_flags(parser, cls)
    return config_from_flags(cls, parser.parse_args([*defaults, *shlex.split(flags)]), environ={})


def deployment_configs(tp: int, ep: bool, verifier_args: str = "", drafter_args: str = ""):
    """(VerifierConfig, DrafterConfig) on GPUs with inspect's --tp / --ep and the services' extra flags."""
    layout = ("--tp", str(tp), *(("--expert-parallel", "true") if ep else ()))
    verifier = service_config(VerifierConfig, verifier_args, *GPU_DEFAULTS, *layout)
    drafter = service_config(DrafterConfig, drafter_args, "--device", "cuda", "--dtype", "bfloat16", "--tp", str(tp))
    return verifier, drafter


def deployment_plan(
    checkpoint: str, device_memory_gb: float, verifier: VerifierConfig, drafter: DrafterConfig | None, drafter_dir=None
) -> MemoryPlan:
    """Every GPU of `device_memory_gb` (1e9 B): the verifier's ranks, the drafter's items on its GPU."""
    device = int(device_memory_gb * 1e9)
    if drafter_dir is None:
        return verifier_plan(verifier, checkpoint, [device] * verifier.tp)
    dcfg = read_drafter_config(drafter_dir)
    taps, s = len(dcfg.target_layer_ids), drafter_dtype(drafter).itemsize
    if drafter.tp > 1:  # co-located: drafter rank r beside verifier rank r
        if drafter.tp != verifier.tp:
            raise ValueError(f"drafter --tp {drafter.tp}: 1 or the verifier's --tp ({verifier.tp})")
        extra = {
            (rank_device(verifier.device, r).index or 0): drafter_plan_items(drafter, dcfg, s, verifier.max_batch, r)
            for r in range(verifier.tp)
        }
        devices = [device] * verifier.tp
        return verifier_plan(verifier, checkpoint, devices, taps, extra=extra, with_drafter=True)
    items = drafter_plan_items(drafter, dcfg, s, verifier.max_batch)
    index = torch.device(drafter.device).index or 0
    plan = verifier_plan(verifier, checkpoint, [device] * verifier.tp, taps, extra={index: items}, with_drafter=True)
    if all(g.index != index for g in plan.gpus):  # a GPU of its own
        plan = dataclasses.replace(plan, gpus=(*plan.gpus, gpu_plan(index, device, items)))
    return plan

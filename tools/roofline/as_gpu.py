"""Kernel wrappers choosing as on a GPU while nothing runs on one: the launches a step would make on a
GPU of a given arch, recorded on the CPU (scripts/bench/compile_launches.py interprets them; the roofline,
tools/roofline/step_roofline.py, records them over meta tensors)."""

from __future__ import annotations

import contextlib
import importlib
import pkgutil


@contextlib.contextmanager
def as_on_gpu(arch: int, smem_bytes: int, sms: int = 132):
    """While active the kernels' wrappers choose as on a GPU of `arch` (90 = sm_90): not interpreted (so no
    exact-fp32 stand-ins for bf16 dots), any device accepted, `smem_bytes` of shared memory per block and
    `sms` SMs for the tile and split choices, the arch as the device's capability."""
    import torch

    import ddtree.kernels

    stand_ins = dict(is_interpreted=lambda kernel: False, check_device=lambda device, interpreted: None,
                     device_smem_budget=lambda device: smem_bytes, num_sms=lambda device: sms,
                     get_device_capability=lambda device=None: divmod(arch, 10))  # fmt: skip
    modules = [  # every module of the kernels' rooms (mla/, moe/, gemm/ and the top)
        importlib.import_module(m.name)
        for m in pkgutil.walk_packages(ddtree.kernels.__path__, "ddtree.kernels.")
        if not m.ispkg
    ]
    saved = [(m, name, getattr(m, name)) for m in (*modules, torch.cuda) for name in stand_ins if hasattr(m, name)]
    for module, name, _ in saved:
        setattr(module, name, stand_ins[name])
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)

"""Which kernels a measured model runs, whatever its device: `--kernels auto | torch | triton`.

auto: what the modules choose themselves (on CUDA the Triton GEMMs and the fused MoE where triton is
installed; on the CPU the torch paths). torch: the torch paths everywhere. triton: the Triton kernels
everywhere; on the CPU they run under the Triton interpreter (TRITON_INTERPRET=1, set before triton is
imported: `interpret_triton()`), which is how a CPU counts the launches the device path makes.

The packed linears (services/models/layers/packed_linear.py) and the routed experts (moe_experts.py) choose
by `x.is_cuda`; `route_kernels` overrides that choice on each instance (their `forward`, or their
kernel entry returning None) and sets the model's `layer_kernels` (models/layers/layer_kernels.py: norms,
SiLU-and-mul), restoring both on exit. The attention backend is chosen when the model is built
(make_attention_backend), not here.
"""

from __future__ import annotations

import contextlib
import os
import sys

from ddtree.models.deepseek_v3.moe_experts import StackedExperts
from ddtree.models.layers.packed_linear import _PackedLinear

KERNELS = ("auto", "torch", "triton")


def interpret_triton() -> None:
    """Run Triton kernels on the CPU: TRITON_INTERPRET=1 before triton is imported (it is read when the
    kernels are decorated); an error when triton was imported already without it."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "triton" in sys.modules:
        raise ValueError("--kernels triton on the CPU needs TRITON_INTERPRET=1 before triton is imported; "
                         "set it in the environment")  # fmt: skip
    os.environ["TRITON_INTERPRET"] = "1"


def _kernel_forward(module: _PackedLinear):
    """The packed linear's CUDA branch (packed_linear.py), on any device."""

    def forward(x):
        y = module.kernel_gemm(x.reshape(-1, x.shape[-1]))
        if y is None:
            raise RuntimeError(f"{type(module).__name__}: the Triton GEMM is not installed (--kernels triton)")
        y = y.view(*x.shape[:-1], module.out_features)
        return y if module.bias is None else y + module.bias.to(y.dtype)

    return forward


def _fused_forward(module: StackedExperts):
    def forward(x, topk_weights, topk_ids):
        y = module.fused(x, topk_weights, topk_ids)
        if y is None:
            raise RuntimeError("the Triton fused MoE is not installed (--kernels triton)")
        return y

    return forward


_ABSENT = object()


def _no_kernel(*args, **kwargs):
    return None


@contextlib.contextmanager
def route_kernels(model, kernels: str):
    """The packed linears, routed experts and layer kernels of `model` run `kernels` while active."""
    if kernels == "auto":
        yield
        return
    overrides = []
    if hasattr(model, "layer_kernels"):  # norms, SiLU-and-mul (models/layers/layer_kernels.py)
        from ddtree.models.layers.layer_kernels import make_layer_kernels

        overrides.append((model, "layer_kernels", make_layer_kernels(kernels)))
    for module in model.modules():
        if isinstance(module, _PackedLinear):
            overrides.append(
                (module, "forward", _kernel_forward(module))
                if kernels == "triton"
                else (module, "kernel_gemm", _no_kernel)
            )
        elif isinstance(module, StackedExperts):
            overrides.append(
                (module, "forward", _fused_forward(module)) if kernels == "triton" else (module, "fused", _no_kernel)
            )
    saved = [(module, name, vars(module).get(name, _ABSENT)) for module, name, _ in overrides]
    for module, name, value in overrides:
        setattr(module, name, value)
    if hasattr(model, "route_to_kernels"):  # the one-time routing (INT4 words to pair order) before any count
        model.route_to_kernels()
    try:
        yield
    finally:
        for module, name, previous in saved:
            if previous is _ABSENT:
                delattr(module, name)
            else:
                setattr(module, name, previous)

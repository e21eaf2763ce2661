"""The step's roofline from shapes alone (`ddtree bench step ... --device-model NAME`): the verifier's step
(step_batch.py, as `ddtree bench step` measures it) run over meta tensors, with no weight allocated, the
kernels' wrappers choosing as on that device (tools/roofline/as_gpu.py) and every launch recorded instead of
run: each Triton `kernel[grid](...)` (its grid and arguments), each aten op that would launch on the device
(op_count.py's rules: views, metadata and empty allocations launch nothing) and each all-reduce /
all-gather of the tensor-parallel group, attributed to the module that launched it. What is recorded is
what `target.run` launches (the forward, the LM head, the argmax combine), the same scope as the counts
of step_measure.count_step. Costs: launch_costs.py / aten_costs.py; time: roofline.py.

The full-depth Kimi K2.6 TP-8 rank at 8k context is recorded in seconds on a CPU. The forward reads no value
back to the host, so nothing recorded depends on a value (the routed experts' bytes follow the routing
model of launch_costs.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ddtree.tools.roofline.aten_costs import op_cost
from ddtree.tools.roofline.devices import DeviceModel
from ddtree.tools.roofline.launch_costs import StepContext, triton_cost
from ddtree.tools.roofline.roofline import Collective, Launch, roofline
from ddtree.tools.step_cost.collectives import one_rank_group
from ddtree.tools.step_cost.op_count import NOT_LAUNCHED, _tensors, op_name
from ddtree.tools.step_cost.step_batch import StepShape, make_step_work
from ddtree.tools.step_cost.step_model import ModelSpec, build_model
from ddtree.tools.step_cost.triton_launches import kernel_function

_LAYER = re.compile(r"(^|\.)layers\.\d+(\.|$)")
STEP_SITE = "step"  # launches outside every module (the head's argmax combine, the step's own ops)


def fold_site(name: str) -> str:
    """model.layers.12.mlp.gate -> layers.mlp.gate (one row per kind of module, over the layers)."""
    return _LAYER.sub(r"\1layers\2", name.removeprefix("model.")) or STEP_SITE


class Recorder(TorchDispatchMode):
    """While active: aten ops on meta tensors, Triton launches (not run) and collectives, each a Launch /
    Collective at the innermost module open (`sites`)."""

    def __init__(self, ctx: StepContext):
        super().__init__()
        self.ctx = ctx
        self.launches: list[Launch] = []
        self.collectives: list[Collective] = []
        self.sites: list[str] = [STEP_SITE]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            with self:  # composite ops (to, linear, ...) count as what they decompose into (op_count.py)
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        name = op_name(func)
        if name not in NOT_LAUNCHED and any(t.device.type == "meta" for t in _tensors((args, kwargs, out))):
            self.launches.append(Launch(name, self.sites[-1], op_cost(name, args, kwargs, out)))
        return out

    def triton(self, kernel, grid, args: tuple, kwargs: dict) -> None:
        fn = kernel_function(kernel)
        self.launches.append(Launch(fn.__name__, self.sites[-1], triton_cost(fn, grid, args, kwargs, self.ctx)))

    def collective(self, kind: str, x: torch.Tensor) -> None:
        self.collectives.append(Collective(kind, self.sites[-1], x.numel() * x.element_size()))


@contextlib.contextmanager
def module_sites(model, recorder: Recorder):
    """recorder.sites follows the module calls of `model` (folded names)."""
    handles = []

    def leave(module, args, out) -> None:  # a hook returning a value would replace the module's output
        recorder.sites.pop()

    for name, module in model.named_modules():
        site = fold_site(name)
        handles.append(module.register_forward_pre_hook(lambda m, a, site=site: recorder.sites.append(site)))
        handles.append(module.register_forward_hook(leave))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def intercepted(recorder: Recorder):
    """Triton launches and the group's collectives go to `recorder` and run nothing (an all-gather returns
    its one-rank result's shape); a meta tensor's values read to the host are zeros (at TP 1 the greedy accept
    walk reads its argmax: it then stops after one round of the LM head)."""
    from ddtree.models.parallel.process_group import TPGroup

    saved = [(TPGroup, "all_reduce", TPGroup.all_reduce), (TPGroup, "all_gather", TPGroup.all_gather)]
    jit = sys.modules.get("triton.runtime.jit")
    if jit is not None:
        saved.append((jit.KernelInterface, "__getitem__", jit.KernelInterface.__getitem__))
        jit.KernelInterface.__getitem__ = lambda self, grid: lambda *a, **k: recorder.triton(self, grid, a, k)
    tolist = torch.Tensor.tolist
    saved.append((torch.Tensor, "tolist", tolist))
    torch.Tensor.tolist = lambda t: torch.zeros(t.shape, dtype=t.dtype).tolist() if t.is_meta else tolist(t)
    TPGroup.all_reduce = lambda self, x: recorder.collective("all_reduce", x) or x
    TPGroup.all_gather = lambda self, x: recorder.collective("all_gather", x) or x.unsqueeze(0)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


class _RecordedTarget:
    def __init__(self, target, recorder: Recorder):
        self.target, self.recorder, self.config = target, recorder, target.config
        self.prepare = getattr(target, "prepare", None)

    def run(self, inputs, heads):
        with self.recorder:
            return self.target.run(inputs, heads)


def record_step(spec: ModelSpec, shape: StepShape, dev: DeviceModel) -> tuple[Recorder, object]:
    """(the recorder of one step, the model on meta)."""
    from ddtree.tools.roofline.as_gpu import as_on_gpu
    from ddtree.tools.step_cost.kernel_route import route_kernels
    from ddtree.tools.step_cost.step_measure import _close_handle, _make_target

    spec = dataclasses.replace(spec, device="cpu", kernels="triton", random_weights=True)  # a checkpoint: its config
    import triton  # noqa: F401  (the kernels' module; nothing is compiled or interpreted)

    with contextlib.ExitStack() as stack:
        tp = stack.enter_context(one_rank_group(torch.device("cpu"))) if spec.emulate_tp > 1 else None
        stack.enter_context(as_on_gpu(dev.arch, dev.smem_per_block, dev.sms))
        model = build_model(dataclasses.replace(spec, device="cuda"), tp, allocate=False)
        target, handle = _make_target(model, tp)
        if handle is not None:
            stack.callback(_close_handle, handle)
        stack.enter_context(route_kernels(model, "triton"))
        c = model.config
        ctx = StepContext(shape.rows, shape.context, shape.batch, c.num_experts_per_tok, c.n_routed_experts)
        recorder = Recorder(ctx)
        work = make_step_work(c, shape, torch.device("meta"), model.dtype, spec.seed)
        stack.enter_context(intercepted(recorder))
        stack.enter_context(module_sites(model, recorder))
        work.run(_RecordedTarget(target, recorder))
        return recorder, model


def model_step(spec: ModelSpec, shape: StepShape, dev: DeviceModel) -> dict:
    """The roofline report of one step shape on `dev` (tools/roofline/roofline.py's keys, and the shape)."""
    recorder, model = record_step(spec, shape, dev)
    ranks = max(spec.emulate_tp, spec.tp)
    return {
        "rows": shape.rows,
        "context": shape.context,
        "batch": shape.batch,
        "emulate_tp": spec.emulate_tp,
        "layers": len(model.model.layers),
        **roofline(recorder.launches, recorder.collectives, dev, ranks),
    }

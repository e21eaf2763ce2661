"""Host syncs inside the target's forward, counted with `ddtree bench step`'s dispatch-mode counter
(tools/step_cost/op_count.py: on the CPU a sync is any op that reads a tensor's value to the host).

`verifier_step_counts(model, rows, context)` runs one verifier step the way the server does
(services/verifier/step/batch.py run_batch over a tree of `rows` rows, or an AR decode at rows 1, on a KV pool
of `context` random latents, tools/step_cost/step_batch.py) through a LocalTarget, and counts only what runs
inside `model.forward` (batch building and the metadata's preparation happen before it, as in the server).
"""

from __future__ import annotations

import contextlib

from ddtree.tools.step_cost.op_count import OpCounter
from ddtree.tools.step_cost.step_batch import StepShape, make_step_work
from ddtree.tools.step_cost.triton_launches import count_triton_launches
from ddtree.verifier.step.target import LocalTarget


@contextlib.contextmanager
def counting_forward(model, counter: OpCounter):
    """While active, every `model.forward(...)` call runs under `counter` (value reads and Triton launches
    included)."""
    original = model.forward

    def forward(*args, **kwargs):
        with counter.value_reads(), count_triton_launches(counter), counter:
            return original(*args, **kwargs)

    model.forward = forward
    try:
        yield counter
    finally:
        del model.forward


def verifier_step_counts(model, rows: int, context: int, target=None, counted=None) -> OpCounter:
    """The counter of the forward of one verifier step (see the module docstring): `counted`'s forward
    (default `model`; a tensor-parallel handle for the sharded target's forward)."""
    work = make_step_work(model.config, StepShape(rows=rows, context=context), model.device, model.dtype)
    counter = OpCounter(model.device.type)
    with counting_forward(counted or model, counter):
        work.run(target or LocalTarget(model))
    return counter


def sync_report(counter: OpCounter) -> str:
    return ", ".join(f"{n} x {op} at {site}" for (site, op), n in counter.sync_sites.most_common()) or "none"


def write_kimi_int4(
    out, layers: int, experts: int, hidden: int, vocab: int, heads: int, lora: int, width: int, dense_width: int
):
    """A Kimi-shaped INT4 checkpoint in `out` (first layer dense), small enough for the CPU: q and kv LoRA
    ranks `lora`, routed experts of width `width`, the dense MLP of `dense_width`."""
    from ddtree.tools.selftest import kimi_checkpoint

    args = kimi_checkpoint.parse_args(
        ["--out", str(out), "--layers", str(layers), "--dense-layers", "1", "--experts", str(experts),
         "--hidden", str(hidden), "--vocab", str(vocab), "--heads", str(heads), "--q-lora", str(lora),
         "--kv-lora", str(lora), "--moe-width", str(width), "--dense-width", str(dense_width), "--no-vision"]
    )  # fmt: skip
    kimi_checkpoint.write_checkpoint(args)
    return out

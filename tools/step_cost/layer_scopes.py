"""Which part of the model an op belongs to, for OpCounter's scopes.

Scope keys: ("forward",) for the model's forward (embedding, final norm, and at TP N the LM head
shard), ("forward", "layer", i) for decoder layer i outside its submodules' calls (the residual adds,
the all-reduces, norms run as layer kernels on the norm modules' weights), ("forward", "layer", i,
child) for what runs inside a direct submodule's call (self_attn, mlp, ...). What the target runs
outside the forward (the step message, the LM head along the greedy walk, the argmax combine) stays in
the caller's scope.
Module hooks open and close the layers' scopes; the forward is wrapped on the instance, because the
targets call `model.forward(...)` directly (no module hooks fire there).
"""

from __future__ import annotations

import contextlib

from ddtree.models.deepseek_v3.moe import DeepseekV3MoE

FORWARD = ("forward",)


def layer_key(i: int) -> tuple:
    return (*FORWARD, "layer", i)


def moe_layer_ids(model) -> list[int]:
    return [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, DeepseekV3MoE)]


@contextlib.contextmanager
def layer_scopes(model, counter):
    """Attribute ops to the forward, its decoder layers and their submodules while active."""
    handles = []

    def open_scope(key):
        return lambda module, args: counter.enter_scope(key)

    def close_scope(module, args, out):
        counter.exit_scope()

    for i, layer in enumerate(model.model.layers):
        modules = [(layer_key(i), layer)] + [((*layer_key(i), name), m) for name, m in layer.named_children()]
        for key, module in modules:
            handles.append(module.register_forward_pre_hook(open_scope(key)))
            handles.append(module.register_forward_hook(close_scope))
    original = model.forward

    def forward(*args, **kwargs):
        with counter.scope(FORWARD):
            return original(*args, **kwargs)

    model.forward = forward
    try:
        yield
    finally:
        del model.forward  # the class's method again
        for h in handles:
            h.remove()

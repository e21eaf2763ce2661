"""The verify / decode forward compiled for the CPU (`--cpu-compile on`): one inductor build per bucket.

On the CPU a step of the demo target is mostly fixed cost: ~700 small aten ops per forward at a few µs
each, around 103 matmuls that are themselves small. torch.compile (inductor) of the static-shape forward
(models/static_forward.py, spliced mode) removes nearly all of it:

- `freezing`: the model's weights become constants of the build, so linears run as prepacked oneDNN
  matmuls and everything between them (norms, RoPE, the router, softmax) is fused into C++ loops;
- `cpp_wrapper`: the build's launcher is C++ too, not a Python function calling kernels;
- static shapes, one build per bucket (B, Q, K): dynamic sizes (one build for all keys) ran slower than
  the eager forward on the demo;
- spliced mode: the forward only reads the KV cache; this step's rows are written after it
  (`index_copy_`, one op). A forward that mutates the cache made the build copy the whole cache back at
  every call (in an experiment: 8.3 ms against 1.9 ms for one AR row at 1k context).

Measured on the demo target (fp32, 1 thread, a Sapphire Rapids vCPU) by
`python -m scripts.bench_cpu_compile`: eager / compiled 1.51x, 1.46x, 1.23x for an AR row at 128, 1024,
4096 tokens of context; 1.67x, 1.31x, 0.89x for a 17-row tree (so trees past 2048 keys stay eager:
static_step.COMPILED_TREE_KEYS); each build ~11 s. The compiled forward reorders floating-point sums:
its logits differ from the eager forward's in the last bits (~1e-5, the same argmax), as the eager
forward's own rows do between a 1-row and a 17-row batch.

The builds need a C++ compiler (inductor's, `g++` by default); `--cpu-compile on` without one is a
start-up error, not a silent slow path. Each build holds its own packed copy of the layer weights
(measured: ~25-35 MB per build on the demo target, plus ~130 MB once for inductor itself), a reason the
buckets are few.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
from collections import abc

import torch

from ddtree.models.static_forward import static_forward


def compiler_missing() -> str | None:
    """Why inductor cannot build C++ here (no compiler on PATH), or None."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        compiler = get_cpp_compiler()
    except Exception as err:  # inductor raises when its search finds nothing
        return f"inductor finds no C++ compiler ({err})"
    if shutil.which(compiler) is None:
        return f"inductor's C++ compiler {compiler!r} is not on PATH"
    return None


@contextlib.contextmanager
def _compile_settings(builds: int) -> abc.Iterator[None]:
    """freezing + cpp_wrapper for the builds made inside, and room for `builds` of them: every bucket's
    build is an entry of the same function's cache, and past dynamo's recompile limit (8) a new shape
    would silently run eagerly. The process-wide configs are restored after."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    limit = max(builds, 8)
    with (
        inductor_config.patch(freezing=True, cpp_wrapper=True),
        dynamo_config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True),
        torch.inference_mode(),
    ):
        yield


class CompiledStaticForward:
    """static_forward of `model` (spliced mode, these taps) compiled for the CPU, one build per input
    shape (static: `dynamic=False`), at most `builds` of them: call `build` once per bucket at start-up;
    a later call whose shapes no build fits raises (StaticStep.run then runs that step eagerly)."""

    def __init__(self, model, tap_layer_ids: tuple[int, ...], builds: int):
        fn = functools.partial(static_forward, model, tap_layer_ids=tuple(tap_layer_ids))

        def forward(input_ids, positions, write_slots, key_slots, hidden_mask, kv_cache, rows, key_cols):
            return fn(input_ids, positions, write_slots, key_slots, hidden_mask, kv_cache, rows, key_cols=key_cols)

        self.builds = builds
        self._compiled = torch.compile(forward, dynamic=False, fullgraph=True)

    def __call__(self, *inputs: torch.Tensor):
        """(input_ids, positions, write_slots, key_slots, hidden_mask, kv_cache, rows, key_cols) ->
        static_forward's (hidden rows, taps, cache rows), from a build made by `build`. Inputs no build
        fits raise (dynamo's fail_on_recompile stance) rather than build here, under other settings, in the
        middle of a step."""
        with torch.compiler.set_stance("fail_on_recompile"), torch.inference_mode():
            return self._compiled(*inputs)

    def build(self, *inputs: torch.Tensor) -> None:
        """Make the build for these inputs' shapes now (one call; its outputs are dropped)."""
        with _compile_settings(self.builds):
            self._compiled(*inputs)

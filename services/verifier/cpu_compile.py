"""The verify / decode forward compiled for the CPU (`--cpu-compile on`): one AOTInductor build per bucket.

On the CPU a step of the demo target is mostly fixed cost: ~700 small aten ops per forward at a few µs
each, around 100 matmuls that are themselves small. Compiling the static-shape forward
(models/static_forward.py, spliced mode) ahead of time removes nearly all of it:

- `freezing`: the model's weights become constants of the build, so linears run as BLAS matmuls on them
  and everything between them (norms, RoPE, the router, softmax) is fused into C++ loops;
- AOTInductor (`torch.export` then `aoti_compile_and_package`): the build is a shared library called
  straight from the step, without torch.compile's guards and runtime wrappers around it (0.3 ms of a
  2 ms call on the demo); each bucket's step calls its own build, so nothing is looked up per call;
- static shapes, one build per bucket (B, Q, K): dynamic sizes (one build for all keys) ran slower than
  the eager forward on the demo;
- spliced mode: the forward only reads the KV cache; this step's rows are written after it
  (`index_copy_`, one op). A forward that mutates the cache made the build copy the whole cache back at
  every call (in an experiment: 8.3 ms against 1.9 ms for one AR row at 1k context).

Measured on the demo target (fp32, 1 thread, a Sapphire Rapids vCPU) by
`python -m scripts.bench.bench_cpu_compile`: see docs/design.md, "Compiled CPU step". The build reorders
floating-point sums: its logits differ from the eager forward's in the last bits (~1e-5, the same
argmax), as the eager forward's own rows do between a 1-row and a 17-row batch.

The builds (models/aot_compile.py) need a C++ compiler (inductor's, `g++` by default); `--cpu-compile
on` without one is a start-up error, not a silent slow path. Each build holds its own copy of the layer
weights, a reason the buckets are few: the demo verifier at the default --max-context (9 builds) starts
in 121 s instead of 5 and holds 1181 instead of 476 MiB.
"""

from __future__ import annotations

import torch

from ddtree.models.aot_compile import aot_compile
from ddtree.models.static_forward import static_forward


class _SplicedForward(torch.nn.Module):
    """static_forward of `model` in spliced mode with fixed taps, as the module torch.export traces."""

    def __init__(self, model, tap_layer_ids: tuple[int, ...]):
        super().__init__()
        self.model, self.taps = model, tuple(tap_layer_ids)

    def forward(self, input_ids, positions, write_slots, key_slots, key_bias, kv_cache, rows, key_cols):
        return static_forward(
            self.model, input_ids, positions, write_slots, key_slots, key_bias, kv_cache, rows, self.taps, key_cols
        )


class CompiledStaticForward:
    """One bucket's build: static_forward of `model` (spliced mode, these taps) at the shapes of `inputs`
    (input_ids, positions, write_slots, key_slots, key_bias, kv_cache, rows, key_cols), made when
    constructed. A call takes tensors of exactly those shapes and dtypes (the bucket's buffers) and returns
    static_forward's (hidden rows, taps, cache rows)."""

    def __init__(self, model, tap_layer_ids: tuple[int, ...], inputs: tuple[torch.Tensor, ...]):
        self._run = aot_compile(_SplicedForward(model, tap_layer_ids), inputs)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        return self._run(*inputs)

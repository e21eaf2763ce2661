"""Ahead-of-time CPU builds of a static-shape forward (`--cpu-compile on`): torch.export, then AOTInductor.

One build per input shape: the module traced at exactly these inputs (shapes, dtypes and strides are
baked in, so a caller passes tensors laid out as the ones it built with: its own preallocated buffers),
compiled with inductor's `freezing` (the module's weights become constants of the build: matmuls run
as BLAS calls on them, everything between fused into C++ loops) into a shared library, loaded, and
called straight from the step, without torch.compile's guards and runtime wrappers per call.

Both services use it: the verifier for its target's step (verifier/cpu_compile.py), the drafter for its
block forward (drafter/static_draft.py). Measured on the demo models: docs/design.md, "Compiled CPU step".
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch._inductor.config as inductor_config


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


def aot_compile(module: torch.nn.Module, inputs: tuple) -> Callable:
    """module's forward built for these inputs (tensors, or lists of them); returns the loaded build, called
    with inputs of the same shapes, dtypes and strides. The package is written to a temporary directory,
    removed once loaded."""
    module = module.eval()
    # Outside inference mode, export and build alike: a build made under inference mode ran 2x slower
    # (measured on the demo target: 2.2 against 1.1 ms for one AR row at 512 keys).
    with torch.inference_mode(False), tempfile.TemporaryDirectory(prefix="ddtree-cpu-build-") as tmp:
        example = torch.utils._pytree.tree_map(_fresh_like, inputs)
        program = torch.export.export(module, tuple(example), strict=False)
        with inductor_config.patch(freezing=True):
            package = torch._inductor.aoti_compile_and_package(program, package_path=str(Path(tmp) / "step.pt2"))
        return torch._inductor.aoti_load_package(package)


def _fresh_like(t):
    """A normal (not inference-mode) copy of t with t's strides, for export to trace."""
    if not isinstance(t, torch.Tensor):
        return t
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(t)

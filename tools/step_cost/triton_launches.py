"""Triton kernel launches, counted once each: `kernel[grid](...)` goes through
`triton.runtime.jit.KernelInterface.__getitem__` for every kind of kernel (compiled `JITFunction`,
`InterpretedFunction` under TRITON_INTERPRET=1, `Autotuner`, `Heuristics`), so wrapping it while a step
is measured sees each launch exactly once, autotuned or not; the launch runs inside
`OpCounter.launch`, so what the launch path itself does with torch (the interpreter's copies) is the
kernel's and is not counted again."""

from __future__ import annotations

import contextlib
import sys


def kernel_function(kernel):
    """The Python function under a kernel object (Autotuner -> JITFunction / InterpretedFunction -> it)."""
    fn = kernel
    while hasattr(fn, "fn"):
        fn = fn.fn
    return fn


def kernel_name(kernel) -> str:
    return getattr(kernel_function(kernel), "__name__", type(kernel).__name__)


@contextlib.contextmanager
def count_triton_launches(counter):
    """While active, every `kernel[grid](...)` counts as one launch in `counter` (an OpCounter).
    Nothing happens when triton was never imported (then no kernel can launch)."""
    jit = sys.modules.get("triton.runtime.jit")
    if jit is None:
        yield
        return
    interface = jit.KernelInterface
    original = interface.__getitem__

    def getitem(self, grid):
        launch = original(self, grid)
        name = kernel_name(self)

        def counted(*args, **kwargs):
            with counter.launch(name):
                return launch(*args, **kwargs)

        return counted

    interface.__getitem__ = getitem
    try:
        yield
    finally:
        interface.__getitem__ = original

"""How the kernel tests run Triton. Import this first in a kernel test module, together with its fixture:

    from tests.support.triton_env import DEVICE, triton_interpret_env  # noqa: F401  (before anything imports kernels)

Without CUDA the kernels run under the Triton interpreter on the CPU. triton reads TRITON_INTERPRET when
a function is decorated, i.e. when triton itself and each kernel module are first imported, and again
while an interpreted kernel runs. So this module sets it around the first import of triton and the
kernels, then restores the environment; the autouse fixture sets it again for each kernel test only.
The rest of the session (and the services it starts) keeps the environment it had.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

_previous = os.environ.get("TRITON_INTERPRET")
INTERPRET = _previous == "1" or not torch.cuda.is_available()
DEVICE = torch.device("cpu" if INTERPRET else "cuda")

if INTERPRET and "triton" in sys.modules and _previous != "1":
    raise RuntimeError("triton was imported before tests/support/triton_env.py could set TRITON_INTERPRET=1 (transformers "
                       "imports it): run the kernel tests first or in their own pytest process")  # fmt: skip
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"
try:
    pytest.importorskip("triton")
    import ddtree.kernels.gemm.fp8  # noqa: F401
    import ddtree.kernels.gemm.int4  # noqa: F401
    import ddtree.kernels.mla.attention  # noqa: F401
    import ddtree.kernels.mla.backend  # noqa: F401
    import ddtree.kernels.mla.latent_write  # noqa: F401
    import ddtree.kernels.moe.fused  # noqa: F401
finally:
    if _previous is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _previous


@pytest.fixture(autouse=True)
def triton_interpret_env(monkeypatch):
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield

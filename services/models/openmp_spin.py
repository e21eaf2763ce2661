"""How long an engine's OpenMP workers busy-wait after each parallel region: `--omp-spin-count`.

torch's CPU build runs its parallel ops on libgomp. When a parallel region ends, each worker thread
busy-waits GOMP_SPINCOUNT rounds of its spin loop before it sleeps. Within a forward, the next region
comes microseconds later and finds the worker awake. libgomp's default is 300000 rounds. On the 2-core
demo VM that is about 4 ms of a core burnt after every region: 4.0 ms, against 0.3-0.5 ms at 10000-30000,
counted from the process's schedstat while its main thread sleeps.

The drafter and the verifier take turns within a step on the same cores. The verifier's forward ends, and
for the next 4 ms, which is most of the drafter's turn, a verifier worker spins on one of the two cores.
A drafter on 2 threads does the same through the verifier's turn (verify 11.2 -> 14.2 ms). 30000 rounds still spans the gaps between the
ops of one forward, and it frees the core soon after the forward ends. Interleaved on the demo VM, code at
4096 tokens, 4 prompts (`scripts.bench_ab --arm-env NAME=GOMP_SPINCOUNT=N`), DDTree / AR tok/s:
- 300000 (libgomp's default): 279.5 / 177.6;
- 30000: 305.4 / 183.0;
- 10000 with the drafter on 2 threads: 307.3 / 159.1. Too short: AR's ops start to wait for wake-ups.

The default, 30000, is config.DEFAULT_OMP_SPIN_COUNT. libgomp reads its environment once, when it is
loaded, which happens when torch is imported. So the engine commands call `apply_spin_count` before
anything imports torch (cli.engine_parser keeps the command modules, which import torch, out of their
start). A GOMP_SPINCOUNT or OMP_WAIT_POLICY already in the environment is the operator's own choice, and
it wins.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

SPIN_VARIABLE = "GOMP_SPINCOUNT"
# Variables that already decide libgomp's waiting; when either is set, --omp-spin-count leaves it alone.
OPERATOR_VARIABLES = (SPIN_VARIABLE, "OMP_WAIT_POLICY")


def apply_spin_count(
    spins: int, environ: MutableMapping[str, str] | None = None, torch_loaded: bool | None = None
) -> str:
    """Set GOMP_SPINCOUNT=spins for this process's OpenMP. torch must not be imported yet.

    Returns how the setting stands, for the start-up log:
    - "set": the variable was written;
    - "libgomp default": spins is -1, so nothing is written;
    - "environment": an operator's GOMP_SPINCOUNT / OMP_WAIT_POLICY is there, and it wins;
    - "too late": torch is already loaded, so libgomp has read its environment.

    environ and torch_loaded stand in for os.environ and "torch in sys.modules" in tests."""
    if spins < -1:
        raise ValueError(f"spins must be >= -1 (-1 = libgomp's own default), got {spins}")
    environ = os.environ if environ is None else environ
    torch_loaded = "torch" in sys.modules if torch_loaded is None else torch_loaded
    if spins == -1:
        return "libgomp default"
    if any(name in environ for name in OPERATOR_VARIABLES):
        return "environment"
    if torch_loaded:
        return "too late"
    environ[SPIN_VARIABLE] = str(spins)
    return "set"

"""How long an engine's OpenMP workers busy-wait after each parallel region: `--omp-spin-count`.

torch's CPU build runs its parallel ops on libgomp. When a parallel region ends, each worker thread
busy-waits GOMP_SPINCOUNT rounds of its spin loop before it sleeps. Within a forward, the next region
comes microseconds later and finds the worker awake. libgomp's default (300000 rounds) keeps a core
busy for milliseconds after every region.

The drafter and the verifier take turns within a step on the same cores: with libgomp's default, a
verifier worker spins through most of the drafter's turn after the verifier's forward ends (and a
multi-threaded drafter does the same through the verifier's). The default here (config.
DEFAULT_OMP_SPIN_COUNT) still spans the gaps between the ops of one forward and frees the core soon after
the forward ends; a much shorter spin makes AR's ops wait for wake-ups.

libgomp reads its environment once, when it is loaded, which happens when torch is imported. So the
engine commands call `apply_spin_count` before anything imports torch (cli.engine_parser keeps the
command modules, which import torch, out of their start). This module sits outside models/runtime/cpu,
which imports torch, so that importing it loads no torch. A GOMP_SPINCOUNT or OMP_WAIT_POLICY already in
the environment is the operator's own choice, and it wins.
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

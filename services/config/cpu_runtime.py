"""How an engine runs on the CPU: its threads and OpenMP's busy-wait (`ddtree.models.runtime.cpu` and
`ddtree.models.runtime.openmp_spin` apply them)."""

from __future__ import annotations

import dataclasses

from .flags import ConfigBase, option

# The engines' OpenMP spin count (ddtree.models.runtime.openmp_spin sets it, and says why this value).
DEFAULT_OMP_SPIN_COUNT = 30000


@dataclasses.dataclass(frozen=True)
class CpuRuntimeFields(ConfigBase):
    """Both engines' CPU threads."""

    flag_group = "CPU runtime"

    threads: int = option(0, "torch CPU threads (0 = torch's default)")
    omp_spin_count: int = option(
        DEFAULT_OMP_SPIN_COUNT,
        "rounds an OpenMP worker busy-waits after a parallel region before it sleeps (GOMP_SPINCOUNT, set "
        "before torch loads; -1 = libgomp's own default, whose wait the other engine's turn loses); a "
        "GOMP_SPINCOUNT or OMP_WAIT_POLICY in the environment wins",
        at_least=-1,
    )

"""The CPU runtime: what an engine process does only when its forwards run on the CPU (the demo).

The engines (the engine commands in cli, the verifier's scheduler and server, the drafter's server)
call these names only:
- `engine_threads(requested)`, `main_thread_single()`, `claim_for_steps(threads)`: one OpenMP pool per
  engine, owned by the thread that runs its steps (threads.py);
- `single_threaded`: the initializer of gRPC handler and helper threads, which then open no pool;
- `EngineThread`, `run_on`: the drafter's compute calls on its one step thread;
- `use_column_major_weights(model)`: the verifier's target weights in the layout the CPU's BLAS runs
  fastest at a step's few rows (weight_layout.py).

This package imports torch. libgomp's busy-wait after a parallel region, which must be set before torch
loads, is `apply_spin_count` in models/runtime/openmp_spin.py, outside it: the engine commands import that
module first.
"""

from __future__ import annotations

from ddtree.models.runtime.cpu.threads import (
    EngineThread,
    claim_for_steps,
    engine_threads,
    main_thread_single,
    run_on,
    single_threaded,
)
from ddtree.models.runtime.cpu.weight_layout import use_column_major_weights

__all__ = [
    "EngineThread",
    "claim_for_steps",
    "engine_threads",
    "main_thread_single",
    "run_on",
    "single_threaded",
    "use_column_major_weights",
]

"""`ddtree selftest gpu`: checks that this install computes what it should on its hardware.

`gpu.py` is the command; `selftest/kernels/kernel_check.py` (part a: each Triton kernel against its torch reference, with
`selftest/kernels/mla_bench.py`, `selftest/kernels/moe_bench.py` and `draft_graph.py`) and `serving_check.py` (part b: a Kimi-K2.6-shaped
checkpoint from `kimi_checkpoint.py`, served by the three services with the replay drafter of
`selftest/oracle/replay_drafter.py`, DDTree against AR) are its two parts. `compare.py` (the tensor comparator),
`selftest/oracle/trees.py` and `selftest/oracle/contexts.py` (the oracle drafters' trees and bookkeeping) are shared with
the test suite.
"""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `selftest` and its subcommands."""
    from ddtree.tools.selftest import gpu, invariance_check

    p = subparsers.add_parser(
        "selftest", help="check this install on its hardware: gpu, invariance", description=__doc__.split("\n\n")[0]
    )
    sub = p.add_subparsers(dest="selftest_command", required=True)
    gpu.add_parser(sub)
    invariance_check.add_parser(sub)
    return p

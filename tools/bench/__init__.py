"""`ddtree bench context | twopoint | compare | overhead | step`: decode speed measured the way docs/design.md §8
asks, and what one verify step costs on this device (`step`).

Each subcommand is one module here with its own `add_parser`; `runner.py` (endpoints, one measured
generation), `prompts.py` (prompts of an exact length by kind of text) and `output.py` (tables, JSON,
plots) are shared with `ddtree diagnose` (tools/diagnose.py). The arithmetic over step
records lives in services/telemetry/report.py.
"""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `bench` and its subcommands."""
    from ddtree.tools.bench import compare, context, overhead, step, twopoint

    p = subparsers.add_parser(
        "bench",
        help="measure decode speed: context | twopoint | compare | overhead | step",
        description=__doc__.split("\n\n")[0],
    )
    sub = p.add_subparsers(dest="bench_command", required=True)
    for module in (context, twopoint, compare, overhead, step):
        module.add_parser(sub)
    return p

"""A drafter process serving the oracle engine (tests/support/oracle_engine.py), for tests only.

Run like `ddtree drafter` (the same flags, plus `--oracle-seed`), as `python -m tests.support.oracle_drafter
drafter --model DIR --target DIR --port 0 --oracle-seed 7`: it loads the target in fp32 (the oracle
replays the fp32 verifier's greedy choices), serves it through the production Drafter server
(`ddtree.drafter.server.serve_engine`) and prints the same `LISTENING drafter host:port` line, so the
launcher starts it like the real one (`start_service(..., module="tests.support.oracle_drafter")`).
"""

from __future__ import annotations

import argparse
import sys

import torch

from ddtree.config import DrafterConfig, add_config_flags, config_from_flags
from ddtree.drafter.server import serve_engine
from ddtree.models.checkpoint.loader import load_target
from ddtree.protocol.server import serve_until_stopped
from ddtree.telemetry.logging import configure_logging
from tests.support.oracle_engine import OracleDraftEngine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.oracle_drafter")
    parser.add_argument("command", choices=["drafter"])
    add_config_flags(parser, DrafterConfig)
    parser.add_argument("--oracle-seed", type=int, default=0, help="noise seed of the oracle's trees")
    args = parser.parse_args(argv)
    cfg = config_from_flags(DrafterConfig, args)
    configure_logging(cfg.log_level, cfg.log_format)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    target = load_target(cfg.target, dtype=torch.float32, device=cfg.device).eval()
    engine = OracleDraftEngine(target, default_budget=cfg.default_budget, max_budget=cfg.max_budget,
                               seed=args.oracle_seed)  # fmt: skip
    running = serve_engine(engine, cfg)
    serve_until_stopped(running)
    return 0


if __name__ == "__main__":
    sys.exit(main())

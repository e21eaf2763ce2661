"""`ddtree selftest gpu`'s drafter: the oracle's noisy trees (selftest/oracle/trees.py) over a *replayed* greedy
continuation, so its acceptance is known and its draft costs no target forward.

    python -m ddtree.tools.selftest.oracle.replay_drafter drafter --model DIR --target DIR --port 0 --reference FILE
        [--taps 1,2,3] [--oracle-seed 7] [--window 2048]

The tests' oracle drafter asks the target itself for the greedy continuation of the whole history at every
step (window 0, an fp32 forward over the full context per draft): right for the small test models, far too
slow for a full-width model at 32k tokens. Here the continuation comes from FILE, JSON
`{"sequences": [[prompt ids + AR output ids], ...]}`, which the check writes after each AR run (re-read
when it changes): a sequence is matched on its first commit (tokens at their absolute positions), and each
draft proposes the reference's next `depth` tokens after the root, broken and padded with wrong siblings by
`noisy_tree`. If the root leaves the reference (DDTree diverged from AR) the tree is empty: an AR step.

The verifier still checks every node against its own forward, and it sends real features of the `--taps`
layers over a `--window` (the DFlash drafter's default, 2048), so transport is measured as in production;
the features themselves are checked for shape and dropped.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys
import zlib

from ddtree.config import DrafterConfig, add_config_flags, config_from_flags
from ddtree.contract.token_tree import TokenTree
from ddtree.drafter.engine import SeqDraftInput
from ddtree.drafter.server import serve_engine
from ddtree.models.checkpoint.loader import load_config
from ddtree.protocol.server import serve_until_stopped
from ddtree.telemetry.logging import configure_logging
from ddtree.tools.selftest.oracle.contexts import OracleContexts
from ddtree.tools.selftest.oracle.trees import noisy_tree


class ReplayDraftEngine(OracleContexts):
    """`contexts`: seq_id -> [index of its reference sequence or -1, committed length]."""

    model_id = "replay-oracle"

    def __init__(self, reference: pathlib.Path, vocab_size: int, hidden_size: int, taps: tuple[int, ...],
                 window: int, depth: int = 7, default_budget: int = 16, max_budget: int = 1024, seed: int = 7):  # fmt: skip
        super().__init__(vocab_size, hidden_size, taps, window, depth, default_budget, max_budget, seed)
        self.reference = reference
        self.sequences: list[list[int]] = []
        self._mtime = None

    def _expected_start(self, s: SeqDraftInput) -> int | None:
        return None if s.reset else self.contexts[s.seq_id][1]  # a reset starts where the window does

    def _reload(self) -> None:
        try:
            mtime = self.reference.stat().st_mtime_ns
        except FileNotFoundError:
            return
        if mtime != self._mtime:
            self.sequences = json.loads(self.reference.read_text())["sequences"]
            self._mtime = mtime

    def _match(self, start: int, tokens: list[int]) -> int:
        """The reference holding `tokens` at positions start.. (re-reading the file once if none does)."""
        for attempt in range(2):
            if attempt:
                self._reload()
            for i, ref in enumerate(self.sequences):
                if ref[start : start + len(tokens)] == tokens:
                    return i
        return -1

    def append(self, seqs: list[SeqDraftInput]) -> None:
        self._validate(seqs)
        for s in seqs:
            tokens = list(s.commit_token_ids)
            if s.reset:
                self.contexts[s.seq_id] = [self._match(s.commit_start, tokens), s.commit_start + len(tokens)]
            else:
                self.contexts[s.seq_id][1] += len(tokens)

    def draft(self, seqs: list[SeqDraftInput]) -> list[TokenTree]:
        self.append(seqs)
        trees = []
        for s in seqs:
            ref_index, length = self.contexts[s.seq_id]
            ref = self.sequences[ref_index] if ref_index >= 0 else []
            on_track = length < len(ref) and ref[length] == s.root_token_id
            truth = ref[length + 1 : length + 1 + self.depth] if on_track else []
            rng = random.Random(zlib.crc32(f"{ref_index}:{length}".encode(), self.seed & 0xFFFFFFFF))
            trees.append(noisy_tree(truth, self._budget(s), self.vocab_size, rng))
        return trees


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddtree.tools.selftest.oracle.replay_drafter")
    parser.add_argument("command", choices=["drafter"])
    add_config_flags(parser, DrafterConfig)
    parser.add_argument("--reference", required=True, help="JSON file of reference sequences (re-read on change)")
    parser.add_argument("--taps", default="0", help="comma-separated target layers whose features it takes")
    parser.add_argument("--oracle-seed", type=int, default=7, help="noise seed of the trees")
    args = parser.parse_args(argv)
    cfg = config_from_flags(DrafterConfig, args)
    configure_logging(cfg.log_level, cfg.log_format)
    target = load_config(cfg.target)
    taps = tuple(int(t) for t in args.taps.split(","))
    engine = ReplayDraftEngine(pathlib.Path(args.reference), target.vocab_size, target.hidden_size, taps, cfg.resolved_window(),
                               default_budget=cfg.default_budget, max_budget=cfg.max_budget, seed=args.oracle_seed)  # fmt: skip
    running = serve_engine(engine, cfg)
    serve_until_stopped(running)
    return 0


if __name__ == "__main__":
    sys.exit(main())

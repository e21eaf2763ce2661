"""A verifier engine (ddtree.verifier.engine.build_engine) over an in-process model, with a drafter engine
served on a loopback port (port 0) and reached through a real DrafterClient."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ddtree.config import DrafterConfig, VerifierConfig
from ddtree.drafter.server import serve_engine
from ddtree.verifier.drafting.drafter_client import DrafterClient
from ddtree.verifier.engine import VerifierEngine, build_engine


@contextlib.contextmanager
def engine_with_drafter(model, config: VerifierConfig, draft_engine, timeout_s: float = 30) -> Iterator[VerifierEngine]:
    """The engine, not started (submit first to batch sequences from the first step, or start at once);
    on exit the engine (its scheduler and client) and then the drafter server are stopped."""
    drafter = serve_engine(draft_engine, DrafterConfig(port=0, grace_s=0.0))
    try:
        engine = build_engine(config, model=model, drafter=DrafterClient(f"127.0.0.1:{drafter.port}", timeout_s))
        try:
            yield engine
        finally:
            engine.stop()
    finally:
        drafter.stop(0)

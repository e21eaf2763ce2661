"""Where the tests find the repository and the test-only drafter process."""

from __future__ import annotations

import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
ORACLE_DRAFTER = "tests.support.oracle_drafter"  # `python -m` module of the oracle drafter process (test-only engine)

"""Which sequences draft this step, when drafting overlaps verifying (`--overlap-draft-min-batch`).

Sequential steps draft every speculative sequence, then verify them all: the drafter and the verifier
run in turn, each idle while the other works. With many sequences the step splits the speculative
sequences into two groups that alternate: while the target verifies group A's trees (drafted in the
previous step), the drafter drafts group B's; the next step swaps them. The drafter's time is then
hidden behind the verify forward, at the price of two smaller forwards per cycle instead of one big
one. That pays when the forward is dominated by per-row work (many sequences), not by its fixed cost
(few), hence the minimum batch.

Every sequence still alternates draft -> verify -> draft: its own steps are the same as sequential
steps (same context, same root, same tree budget rule), so its tokens are unchanged.

`split_drafts` is the pure policy. It keeps the two groups balanced: a group of k sequences with trees
in hand is verified while at most max(k, ceil(n / 2)) of the sequences without a tree draft, the
longest-waiting first. Starting from nothing drafted, the first step drafts half (the other half waits
one step); from then on the groups swap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def split_drafts(needing: Sequence[str], with_tree: int, waited_since: dict[str, float]) -> tuple[list[str], list[str]]:
    """needing: ids of speculative sequences without a tree; with_tree: how many hold one (verified now);
    waited_since[id]: when the sequence's current step began (smaller = waited longer).

    Returns (draft now, wait): both lists of ids, the first in the order drafted.
    """
    total = len(needing) + with_tree
    take = min(len(needing), max(with_tree, math.ceil(total / 2)))
    order = sorted(needing, key=lambda rid: (waited_since[rid], rid))
    return order[:take], order[take:]


def overlapping(decode_count: int, min_batch: int) -> bool:
    """Overlap drafting with verifying when at least min_batch sequences decode (min_batch 0 = never)."""
    return min_batch > 0 and decode_count >= min_batch

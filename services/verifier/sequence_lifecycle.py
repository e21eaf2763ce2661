"""A sequence's life outside its steps: admission, the prefix cache's pins, the KV rows a step reserves,
and the end (finish or abort). With `apply.apply_outcome` (a step's outcome) these are the only functions
that write a `Sequence`'s fields or its page table; the scheduler, the batch, the prefix sharing and the
engine call them. A sequence is born with its page table at the pool's page size (`Sequence(...,
page_size=)`; the scheduler refuses another).

- `reserve_rows` / `drop_scratch`: a forward's new rows get slots in the sequence's table (scratch until
  the step's outcome commits them, page_table.py); a step that fails before its commit drops them.
- `pin_prefix`: a prefix-cache hit at admission: the cache's pages are shared in the table, pinned by
  the match (its features live in the cache).
- `enter_prompt`: at the end of its prefill the prompt entered the cache: the table shares those pages,
  the sequence pins the entry, and its feature log keeps the rows after it.
- `log_features`: the feature log (the drafter's taps of the committed tokens after the pinned prefix)
  starts, is replaced by its rows in one tensor, or is dropped.
- `unplace`: at finish or abort, once its KV went to the cache or the pool: no table, no pin, no log.
- `place_decoding` / `stage_commit`: the states a measurement starts from (`ddtree bench step`, the GPU
  check's drafter part) without running the steps that lead there.
"""

from __future__ import annotations

import torch

from ddtree.verifier.kv.kv_pool import LatentKVPool
from ddtree.verifier.kv.page_table import PageTable
from ddtree.verifier.sequence import PendingCommit, Phase, Sequence


def reserve_rows(seq: Sequence, pool: LatentKVPool, rows: int) -> torch.Tensor:
    """Slots for `rows` new rows after the committed ones (scratch until committed)."""
    return seq.table.extend(pool, rows)


def drop_scratch(seq: Sequence, pool: LatentKVPool) -> None:
    """The scratch rows of a step that failed before its commit go back to the pool."""
    seq.table.trim(pool)


def pin_prefix(seq: Sequence, match) -> None:
    """A prefix hit (prefix_cache.PrefixMatch, without its features): its pages shared, the match pinned."""
    seq.prefix_match = match
    seq.table.share(match.slots)


def enter_prompt(seq: Sequence, entered, rows_after: torch.Tensor | None) -> None:
    """The prompt entered the cache as `entered` (a PrefixMatch, pinned; the caller released the old pin);
    `rows_after`: the logged features after it (None: not logged)."""
    seq.table.share_entered(entered.slots)
    seq.prefix_match = entered
    if rows_after is not None:
        seq.feature_log = [rows_after]


def log_features(seq: Sequence, rows: list[torch.Tensor] | None) -> None:
    """The feature log: [] to start one, [rows] to hold them in one tensor, None to drop it."""
    seq.feature_log = rows


def unplace(seq: Sequence, page_size: int) -> None:
    """After finish or abort, the sequence's KV handed on: an empty table, no pin, no feature log."""
    seq.prefix_match = None
    seq.table = PageTable(page_size)
    seq.feature_log = None


def place_decoding(seq: Sequence, pool: LatentKVPool, context: list[int], root: int) -> None:
    """As if the prompt `context` had been prefilled and `root` were the next input: its rows committed in
    the table (holding whatever the pool had), the sequence decoding."""
    seq.table.extend(pool, len(context))
    seq.table.commit(len(context))
    seq.committed = list(context)
    seq.prefill_done = len(context)
    seq.root = root
    seq.phase = Phase.DECODE


def stage_commit(seq: Sequence, root: int, pending: PendingCommit) -> None:
    """The commit the drafter gets with the next Draft call, and the root it drafts from."""
    seq.root = root
    seq.pending_commit = pending

"""What the scheduler does with the prefix cache (prefix_cache.py) over a sequence's life.

- Admission (`admit`): the sequence starts from the longest cached prefix of its prompt (all but the
  last token, whose logits give the first output token; whole pages), shared and pinned
  (`Sequence.prefix_match`); its cached features seed the drafter (a speculative sequence whose prefix
  has none prefills in full). A request that reads its whole prompt (Features, prompt_logprobs) takes
  nothing from the cache.
- Waiting (`must_wait`): a request whose prompt a running sequence is prefilling, and has not entered
  into the cache yet, waits for that prefill rather than computing the same KV beside it (the `n`
  choices of one request prefill their prompt once); requests behind it go on.
- Prefill end (`prefilled`): the prompt's whole pages and features enter the cache
  (`PrefixCache.enter`), pinned by the sequence from then on as a hit pins them.
- Finish or abort (`release`): the committed tokens' KV and features go into the cache (without a
  cache, the pages are freed).

Features are held once: the cache holds those of the prefix a sequence pins, and the sequence's
`feature_log` only those of its committed tokens after it (`_logged_rows`), handed to the cache (moved,
not copied) when they enter.

Prefilling sequences are kept by prompt key (`Sequence.prompt_key`, a hash of the prompt), so a pass
over the queue costs O(waiting requests): prompts are compared only on a key hit, and once per waiting
request and prefill it waits for (`_waits_for`), however many steps that prefill takes.
"""

from __future__ import annotations

import dataclasses

import torch

from ddtree.telemetry.logging import get_logger
from ddtree.verifier.kv.kv_pool import LatentKVPool
from ddtree.verifier.kv.prefix_cache import PrefixCache
from ddtree.verifier.sequence import Sequence, extend_pending
from ddtree.verifier.sequence_lifecycle import drop_scratch, enter_prompt, log_features, pin_prefix, unplace
from ddtree.verifier.step.step_outcome import StepOutcome

log = get_logger("ddtree.verifier.kv.prefix_sharing")


def usable_prefix(prompt_len: int, page_size: int) -> int:
    """The most a prefix match may give a prompt: all but its last token, in whole pages."""
    return (prompt_len - 1) // page_size * page_size


def _pinned(seq: Sequence) -> int:
    """Committed tokens at the start of `seq` that the cache holds for it (its prefix_match)."""
    return seq.prefix_match.length if seq.prefix_match is not None else 0


def _logged_rows(seq: Sequence) -> torch.Tensor | None:
    """The features of `seq`'s committed tokens after its pinned prefix, [n, F] in one fresh tensor that
    the log then holds alone (so the caller may hand it to the cache). None when not kept for each of
    those tokens; a log missing a row is dropped, since none of it could enter the cache."""
    if not seq.feature_log:
        return None
    rows = torch.cat(seq.feature_log)
    if rows.shape[0] != len(seq.committed) - _pinned(seq):
        log_features(seq, None)
        return None
    log_features(seq, [rows])
    return rows


class PrefixSharing:
    def __init__(self, pool: LatentKVPool, cache: PrefixCache | None, window: int, keeps_features: bool):
        """cache None: no prefix cache (nothing shared, pages freed at the end). keeps_features: the
        drafter reads tapped features, so they are kept for the cache (`Sequence.feature_log`)."""
        self.pool = pool
        self.cache = cache
        self.window = window
        self.keeps_features = keeps_features
        # prompt key -> running sequences prefilling that prompt whose prefill computes part of what a
        # match would give; each leaves at its prefill's end (its prompt entered) or its finish.
        self._prefilling: dict[int, list[Sequence]] = {}
        self._waits_for: dict[Sequence, Sequence] = {}  # waiting request -> the prefill its prompt equals

    def must_wait(self, seq: Sequence) -> bool:
        """A running sequence is prefilling `seq`'s very prompt and has not entered it into the cache yet:
        `seq` waits (admitted once that prefill completes, it then takes the prompt from the cache)."""
        if self.cache is None or seq.reads_whole_prompt:  # a request that reads no cache waits for none
            return False
        twins = self._prefilling.get(seq.prompt_key, ())
        twin = self._waits_for.get(seq)
        if twin is not None and twin in twins:
            return True
        prompt = seq.params.input_ids
        twin = next((s for s in twins if s.params.input_ids == prompt), None)  # equality on a key hit only
        if twin is None:
            self._waits_for.pop(seq, None)
            return False
        self._waits_for[seq] = twin
        return True

    def admit(self, seq: Sequence) -> StepOutcome | None:
        """At admission: start from the longest cached prefix, returned as the outcome that commits it (the
        scheduler applies it; None: no hit); a prefill left to compute is one that requests with the same
        prompt wait for."""
        self._waits_for.pop(seq, None)
        if self.cache is None:
            return None
        log_features(seq, [] if self.keeps_features else None)
        hit = None if seq.reads_whole_prompt else self._reuse_prefix(seq)  # Features, prompt_logprobs: no reuse
        if (hit.prefill_end if hit else seq.prefill_done) < usable_prefix(seq.prompt_len, self.pool.page_size):
            self._prefilling.setdefault(seq.prompt_key, []).append(seq)
        return hit

    def _reuse_prefix(self, seq: Sequence) -> StepOutcome | None:
        """The longest cached prefix (all but the last prompt token), pinned and shared in the sequence's
        page table, as the outcome that commits its tokens. A speculative sequence needs the prefix's
        features to seed the drafter."""
        prompt = seq.params.input_ids
        match = self.cache.match(list(prompt[:-1]))
        if match.length == 0 or (seq.use_spec and match.features is None):
            self.cache.release(match)
            return None
        # The pin alone: the features live in the cache (their copy here goes to the drafter, cut to its window).
        pin_prefix(seq, dataclasses.replace(match, features=None))
        tokens = tuple(prompt[: match.length])
        pending = seq.pending_commit
        if match.features is not None and seq.use_spec:
            pending = extend_pending(pending, list(tokens), 0, match.features, self.window)
        log.info("prefix_hit", request_id=seq.request_id, cached_tokens=match.length, prompt_tokens=len(prompt))
        return StepOutcome(committed=tokens, prefill_end=match.length, cached_tokens=match.length, pending=pending)

    def prefilled(self, seq: Sequence) -> None:
        """At the end of its prefill the sequence's prompt (whole pages) enters the prefix cache, and the
        sequence holds it from then on as a shared, pinned prefix, as if it had been a hit; its feature
        log keeps the rows after it (the partial last page's)."""
        self._forget(seq)
        if self.cache is None:
            return
        pinned, rows = _pinned(seq), _logged_rows(seq)
        entered = self.cache.enter(seq.committed, seq.slots, rows, features_from=pinned)
        if entered is None:  # the cache holds part of it under another sequence's slots: it enters at the end
            return
        if seq.prefix_match is not None:
            self.cache.release(seq.prefix_match)
        # the cache holds the rows of the entered prefix: the log keeps the rest
        enter_prompt(seq, entered, None if rows is None else rows[entered.length - pinned :].clone())

    def release(self, seq: Sequence) -> None:
        """At finish or abort: hand the committed tokens' KV (and features) to the prefix cache, or free it."""
        self._forget(seq)
        self._waits_for.pop(seq, None)
        drop_scratch(seq, self.pool)  # the scratch of a step that failed before its commit
        if self.cache is None:
            self.pool.free(seq.table.pages)
        else:
            pinned, rows = _pinned(seq), _logged_rows(seq)
            self.pool.free(self.cache.insert(seq.committed, seq.slots, rows, features_from=pinned, owned=True))
            if seq.prefix_match is not None:
                self.cache.release(seq.prefix_match)
        unplace(seq, self.pool.page_size)

    def make_room(self, need: int) -> None:
        """Evict unpinned cache leaves until `need` slots are free (or nothing more can go)."""
        if self.cache is not None and self.pool.num_free < need:
            self.cache.evict(need - self.pool.num_free)

    def _forget(self, seq: Sequence) -> None:
        twins = self._prefilling.get(seq.prompt_key)
        if twins is not None and seq in twins:
            twins.remove(seq)
            if not twins:
                del self._prefilling[seq.prompt_key]

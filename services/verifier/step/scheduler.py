"""The verifier's step loop: continuous batching of speculative steps and chunked prefill.

One thread owns the model, the KV pool and every running sequence. RPC threads only `submit` and
`abort` (under the lock) and read their sequence's event queue. Each step:
  1. admit waiting requests whose worst-case KV reservation fits (prompt + max_new + one tree); one whose
     prompt another sequence is prefilling waits for that prefill and takes the prompt from the cache
     (what the prefix cache does over a sequence's life: prefix_sharing.py);
  2. finish sequences whose client aborted;
  3. the step, a pipeline of values: schedule (the decoding sequences and at most prefill_chunk prompt
  tokens, several short prompts may share them) -> draft (one RPC for all speculative sequences;
  step_drafter.py) -> forward (one target forward over every work item; batch.py) -> commit (one
  StepOutcome per item; work_items.py, commit.py) -> apply (apply.py writes each outcome into its
  sequence, streams it, and says whether the sequence ends).
Admission by reservation means a running sequence never runs out of KV mid-generation.
"""

from __future__ import annotations

import collections
import threading
import time

import grpc

from ddtree.config import VerifierConfig
from ddtree.contract.token_tree import EMPTY_TREE
from ddtree.models.runtime.cpu import claim_for_steps, engine_threads
from ddtree.telemetry.logging import get_logger
from ddtree.telemetry.step_log import open_step_log
from ddtree.verifier import metrics
from ddtree.verifier.drafting.step_drafter import StepDrafter, StepDrafts
from ddtree.verifier.kv.kv_pool import LatentKVPool
from ddtree.verifier.kv.page_table import check_accounting
from ddtree.verifier.kv.prefix_cache import PrefixCache
from ddtree.verifier.kv.prefix_sharing import PrefixSharing
from ddtree.verifier.sequence import Phase, Sequence
from ddtree.verifier.step.apply import NO_CLOCK, Ending, apply_outcome, begin_prefill, end_sequence
from ddtree.verifier.step.batch import kv_needed, run_batch
from ddtree.verifier.step.step_outcome import StepOutcome, failed_outcome
from ddtree.verifier.step.step_records import StepClock
from ddtree.verifier.step.target import Target
from ddtree.verifier.step.work_items import PrefillItem, VerifyItem, WorkItem

log = get_logger("ddtree.verifier.step.scheduler")
INTERNAL_ERROR = "verifier: internal error in a step (logged)"  # the client learns that it failed, not how


class AdmissionError(Exception):
    """Raised by submit; `code` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class Scheduler:
    def __init__(self, target: Target, pool: LatentKVPool, config: VerifierConfig, drafter):
        """drafter: a DrafterPool (or one DrafterClient), or None for AR only."""
        self.target = target  # the model behind one interface at TP 1 and TP N (target.py)
        self.pool = pool
        self.config = config
        self.drafter = drafter
        self._draft_step = StepDrafter(drafter, target.config.vocab_size, config)  # the Draft call of a step
        self.vocab_size = target.config.vocab_size
        self.window = drafter.window if drafter is not None else 0
        self.tap_layer_ids = drafter.tap_layer_ids if drafter is not None else ()
        self.cache = PrefixCache(pool, int(config.prefix_feature_mb * 2**20)) if config.prefix_cache else None
        self._sharing = PrefixSharing(pool, self.cache, self.window, bool(self.tap_layer_ids))
        self.step_log = open_step_log(config.step_log)  # None = off
        self._cond = threading.Condition()
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
        self._reserved = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="verifier-scheduler", daemon=True)
        self.total_steps = 0
        self.total_tokens = 0
        metrics.STATE.track(self)  # running, queued, KV: read at scrape time (metric_state)

    # ---- called from RPC threads ----
    def submit(self, seq: Sequence) -> None:
        if seq.table.page_size != self.pool.page_size:
            raise ValueError(f"a sequence of page size {seq.table.page_size} for a pool of {self.pool.page_size}")
        need = seq.reserved_slots(seq.params.budget)
        with self._cond:
            if self._stopping:
                raise AdmissionError(grpc.StatusCode.UNAVAILABLE, "verifier is shutting down")
            if seq.request_id in self._by_id:
                raise AdmissionError(
                    grpc.StatusCode.ALREADY_EXISTS, f"request_id {seq.request_id!r} is already running"
                )
            if need > self.pool.num_slots:  # it never fits: not a reason to retry later (429)
                raise AdmissionError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"request needs {need} KV tokens (prompt + max_new_tokens + tree), "
                    f"the cache holds {self.pool.num_slots}",
                )
            # A burst can arrive before the loop moves waiting requests into free batch places, so
            # those places do not count against the queue: max_batch + max_queue requests are always
            # admitted (the verifier's stream slots), whatever the step loop's timing.
            free_places = max(0, self.config.max_batch - len(self._running))
            if len(self._waiting) >= self.config.max_queue + free_places:
                raise AdmissionError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"queue full ({len(self._waiting)} requests waiting, {len(self._running)} running; "
                    f"max_batch {self.config.max_batch} + max_queue {self.config.max_queue}); retry later",
                )
            self._waiting.append(seq)
            self._by_id[seq.request_id] = seq
            self._cond.notify_all()

    def abort(self, request_id: str) -> bool:
        """Abort the running request with this id (Verifier.Abort); False when none runs."""
        with self._cond:
            seq = self._by_id.get(request_id)
            if seq is None:
                return False
            self._abort_locked(seq)
            return True

    def abort_sequence(self, seq: Sequence) -> None:
        """Abort this very sequence (its RPC ended). Never by id: a client may reuse the id for a new
        request as soon as a stream finishes, and this RPC's late callback must not abort that one."""
        with self._cond:
            self._abort_locked(seq)

    def _abort_locked(self, seq: Sequence) -> None:
        seq.abort_requested.set()  # a finished sequence ignores it
        self._cond.notify_all()

    @property
    def kv_cached(self) -> int:
        """Slots the prefix cache holds that no running request pins (evictable)."""
        return self.cache.cached_slots - self.cache.pinned_slots if self.cache is not None else 0

    @property
    def kv_held_by_requests(self) -> int:
        """Slots the running requests hold: their own and the cached prefixes they pin, each slot once
        (pool used - kv_cached; free + held + kv_cached == total)."""
        return self.pool.num_used - self.kv_cached

    @property
    def running_count(self) -> int:
        with self._cond:
            return len(self._running) + len(self._waiting)

    def metric_state(self) -> dict[str, int]:
        """The state gauges (`ddtree.verifier.metrics.STATE`), read at scrape time: true when idle too."""
        with self._cond:
            return {
                "running": len(self._running),
                "queued": len(self._waiting),
                "kv_used": self.kv_held_by_requests,
                "kv_cached": self.kv_cached,
                "kv_total": self.pool.num_slots,
            }

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        with self._cond:
            for seq in list(self._running) + list(self._waiting):
                self._finish(seq, Ending("abort"))
        metrics.STATE.untrack(self)

    # ---- the loop ----
    def _loop(self) -> None:
        claim_for_steps(engine_threads(self.config.threads))  # this thread's pool runs the steps' CPU work
        while not self._stopping:
            try:
                self._loop_once()
            except Exception as err:  # the loop must outlive any one bad step
                log.exception("scheduler_loop_error", error=str(err))
                time.sleep(0.01)

    def _loop_once(self) -> None:
        with self._cond:
            if self._stopping:
                return
            self._reap_aborts()
            self._admit()
            if not self._running:
                self._cond.wait(timeout=0.5)
                return
            decode = [s for s in self._running if s.phase is Phase.DECODE]
            prefill = self._prefill_items()
        try:
            self._step(decode, prefill)
            if self.config.debug_checks:
                self.check_accounting()
        except Exception as err:  # a model or pool failure ends this step's sequences, not the server
            log.exception("step_failed", error=str(err))
            with self._cond:
                for seq in decode + [item.seq for item in prefill]:
                    self._fail(seq)

    def check_accounting(self) -> None:
        """free + held by sequences + cached == total in slots and pages, no page held twice (debug
        mode, and tests). A sequence holds its pages after its cached (shared, cache-owned) prefix."""
        with self._cond:
            check_accounting(self.pool, [s.table for s in self._running], self.cache)

    def _admit(self) -> None:
        for seq in list(self._waiting):
            if len(self._running) >= self.config.max_batch:
                return
            if self._sharing.must_wait(seq):
                continue  # admitted once that prefill entered the prompt into the cache; the rest go on
            need = seq.reserved_slots(seq.params.budget)
            if self._reserved + need > self.pool.num_slots:
                return  # FIFO: wait for KV to be released
            self._waiting.remove(seq)
            self._reserved += need
            begin_prefill(seq)
            self._running.append(seq)
            hit = self._sharing.admit(seq)
            if hit is not None:  # the prompt's cached prefix, committed as a step would
                self._apply(seq, hit)

    def _reap_aborts(self) -> None:
        for seq in [s for s in self._waiting if s.abort_requested.is_set()]:
            self._waiting.remove(seq)
            self._finish(seq, Ending("abort"))
        for seq in [s for s in self._running if s.abort_requested.is_set()]:
            self._finish(seq, Ending("abort"))

    def _finish(self, seq: Sequence, ending: Ending) -> None:
        """Remove a sequence everywhere and release its KV (caller holds the lock)."""
        if not end_sequence(seq, ending):
            return
        if seq in self._running:
            self._running.remove(seq)
            self._reserved -= seq.reserved_slots(seq.params.budget)
        metrics.REQUESTS.labels(finish_reason=seq.finish_reason or "error").inc()
        metrics.E2E.observe(time.perf_counter() - seq.arrival)
        self._by_id.pop(seq.request_id, None)
        self._sharing.release(seq)
        if self.drafter is not None and seq.drafter_seeded:
            # Release outside the hot path would be nicer; it is one small RPC per finished request.
            threading.Thread(target=self.drafter.release, args=([seq.draft_id],), daemon=True).start()

    def _fail(self, seq: Sequence, message: str = INTERNAL_ERROR) -> None:
        """End one sequence with an error event (caller holds the lock): a fault of the verifier (INTERNAL)."""
        self._finish(seq, Ending("error", error=message))

    def _prefill_items(self) -> list[PrefillItem]:
        """This step's prefill: up to prefill_chunk prompt tokens, taken from the prefilling sequences in
        admission order (several short prompts share a step; a long one is split across steps)."""
        items, room = [], self.config.prefill_chunk
        for seq in self._running:
            if room <= 0:
                break
            if seq.phase is Phase.PREFILL:
                end = min(seq.prefill_done + room, seq.prompt_len)
                items.append(PrefillItem(seq, seq.prefill_done, end))
                room -= end - seq.prefill_done
        return items

    def _step(self, decode: list[Sequence], prefill: list[PrefillItem]) -> None:
        """One step: draft -> work items -> forward -> commit -> apply."""
        start = time.perf_counter()
        drafts = self._draft(decode, prefill)
        items, outcomes = self._work_items(decode, prefill, drafts)
        forward = time.perf_counter()
        outcomes += self._forward_and_commit(items)
        clock = StepClock(start, forward, time.perf_counter())
        self._observe(items, outcomes, bool(prefill), clock)
        with self._cond:
            for seq, outcome in outcomes:
                self._apply(seq, outcome, clock)

    def _draft(self, decode: list[Sequence], prefill: list[PrefillItem]) -> StepDrafts:
        """One Draft call for the step's speculative sequences; the others' shapes price the tree cut."""
        spec = [s for s in decode if s.use_spec and self.drafter is not None]
        others = [(1, s.context_len) for s in decode if not (s.use_spec and self.drafter is not None)]
        others += [(p.rows, p.context) for p in prefill]
        return self._draft_step.draft(spec, others, len(decode))

    def _work_items(
        self, decode: list[Sequence], prefill: list[PrefillItem], drafts: StepDrafts
    ) -> tuple[list[WorkItem], list[tuple[Sequence, StepOutcome]]]:
        """The step's work items, grammar-constrained; a sequence whose grammar preparation fails gets a
        failed outcome instead (it ends alone)."""
        verify = [
            VerifyItem(
                s,
                drafts.trees[s.draft_id].tree if s.draft_id in drafts.trees else EMPTY_TREE,
                drafts.trees.get(s.draft_id),
                speculating=s.draft_id in drafts.trees,
                lost=s.draft_id in drafts.lost,
                resend=s.draft_id in drafts.resend,
            )
            for s in decode
        ]
        items, failed = [], []
        for item in verify + prefill:
            try:
                items.append(item.with_grammar())
            except Exception as err:
                log.exception("sequence_step_failed", request_id=item.seq.request_id, error=str(err))
                failed.append((item.seq, failed_outcome(INTERNAL_ERROR)))
        return items, failed

    def _forward_and_commit(self, items: list[WorkItem]) -> list[tuple[Sequence, StepOutcome]]:
        """One target forward over the items, then each item's commit; a commit that fails ends its
        sequence alone (logged)."""
        if not items:
            return []
        with self._cond:
            self._sharing.make_room(kv_needed(items))
        outputs = run_batch(self.target, self.pool, items, self.tap_layer_ids)
        outcomes = []
        for item, out in zip(items, outputs):
            try:
                outcomes.append((item.seq, item.commit(out, self.window)))
            except Exception as err:
                log.exception("sequence_commit_failed", request_id=item.seq.request_id, error=str(err))
                outcomes.append((item.seq, failed_outcome(INTERNAL_ERROR)))
        return outcomes

    def _observe(
        self, items: list[WorkItem], outcomes: list[tuple[Sequence, StepOutcome]], prefill: bool, clock: StepClock
    ) -> None:
        """The tree cut's cost fit and calibration learn from this step (step_drafter.StepDrafter.observe)."""
        verified = [(o.verified, o.accepted_nodes) for _, o in outcomes if o.drafted is not None and o.failure is None]
        self._draft_step.observe(
            [(item.rows, item.context) for item in items],
            prefill,
            (clock.forward - clock.start) * 1e3,
            (clock.committed - clock.forward) * 1e3,
            verified,
        )

    def _apply(self, seq: Sequence, outcome: StepOutcome, clock: StepClock = NO_CLOCK) -> None:
        """Write one outcome into its sequence (apply.py) and end the sequence when it says so (caller holds
        the lock)."""
        try:
            ending = apply_outcome(seq, outcome, self.pool, clock, self.step_log)
            if outcome.starts_decode:
                self._sharing.prefilled(seq)  # the prompt enters the prefix cache
        except Exception as err:
            log.exception("sequence_apply_failed", request_id=seq.request_id, error=str(err))
            ending = Ending("error", error=INTERNAL_ERROR)
        if outcome.verified is not None and outcome.failure is None:
            self.total_steps += 1
            self.total_tokens += outcome.accept_length
        if ending is not None:
            self._finish(seq, ending)

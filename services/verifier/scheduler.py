"""The verifier's step loop: continuous batching of speculative steps and chunked prefill.

One thread owns the model, the KV pool and every running sequence. RPC threads only `submit` and
`abort` (under the lock) and read their sequence's event queue. Each step:
  1. admit waiting requests whose worst-case KV reservation fits (prompt + max_new + one tree); one whose
     prompt another sequence is prefilling waits for that prefill and takes the prompt from the cache
     (what the prefix cache does over a sequence's life: prefix_sharing.py);
  2. finish sequences whose client aborted;
  3. Draft (one RPC for all speculative sequences; step_drafter.py), 4. one target forward over all
  trees plus at most prefill_chunk prompt tokens (several short prompts may share them), 5. accept +
  commit per sequence, stream the tokens and the step record (step_records.py).
Admission by reservation means a running sequence never runs out of KV mid-generation.
"""

from __future__ import annotations

import collections
import threading
import time

import grpc

from ddtree.config import VerifierConfig
from ddtree.contract.step_record import StepRecord
from ddtree.contract.token_tree import EMPTY_TREE, TokenTree
from ddtree.models.cpu_threads import claim_for_steps, engine_threads
from ddtree.telemetry.logging import get_logger
from ddtree.telemetry.step_log import open_step_log
from ddtree.verifier import metrics
from ddtree.verifier.batch import PrefillItem, VerifyItem, WorkItem, kv_needed, run_batch
from ddtree.verifier.commit import commit_prefill, commit_verify
from ddtree.verifier.grammar import DEAD_END
from ddtree.verifier.kv_pool import LatentKVPool
from ddtree.verifier.page_table import PageTable, check_accounting
from ddtree.verifier.prefix_cache import PrefixCache
from ddtree.verifier.prefix_sharing import PrefixSharing
from ddtree.verifier.sequence import Phase, Sequence, StreamEvent
from ddtree.verifier.step_drafter import StepDrafter
from ddtree.verifier.step_records import record_step
from ddtree.verifier.target import Target

log = get_logger("ddtree.verifier.scheduler")
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
        self.cache = PrefixCache(pool) if config.prefix_cache else None
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
        seq.table = PageTable(self.pool.page_size)
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
                self._finish(seq, "abort")
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
                    self._fail(seq, INTERNAL_ERROR)

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
            seq.phase = Phase.PREFILL
            self._running.append(seq)
            self._sharing.admit(seq)

    def _reap_aborts(self) -> None:
        for seq in [s for s in self._waiting if s.abort_requested.is_set()]:
            self._waiting.remove(seq)
            self._finish(seq, "abort")
        for seq in [s for s in self._running if s.abort_requested.is_set()]:
            self._finish(seq, "abort")

    def _finish(self, seq: Sequence, reason: str | None) -> None:
        """Remove a sequence everywhere and release its KV (caller holds the lock)."""
        if seq.phase is Phase.FINISHED:
            return
        if reason is not None:
            seq.finish_reason = reason
            seq.events.put(StreamEvent((), None, reason))
        if seq in self._running:
            self._running.remove(seq)
            self._reserved -= seq.reserved_slots(seq.params.budget)
        metrics.REQUESTS.labels(finish_reason=seq.finish_reason or "error").inc()
        metrics.E2E.observe(time.perf_counter() - seq.arrival)
        self._by_id.pop(seq.request_id, None)
        self._sharing.release(seq)
        seq.phase = Phase.FINISHED
        if self.drafter is not None and seq.drafter_seeded:
            # Release outside the hot path would be nicer; it is one small RPC per finished request.
            threading.Thread(target=self.drafter.release, args=([seq.draft_id],), daemon=True).start()

    def _fail(self, seq: Sequence, message: str, status: grpc.StatusCode = grpc.StatusCode.INTERNAL) -> None:
        """End one sequence with an error event (caller holds the lock); `status` is what its stream ends with:
        INTERNAL for a fault of the verifier, INVALID_ARGUMENT for one of the request (its grammar's dead end)."""
        if seq.phase is not Phase.FINISHED:
            seq.events.put(StreamEvent((), None, "error", error=message, error_status=status))
            self._finish(seq, None)

    def _end_dead(self, seq: Sequence) -> None:
        """A grammar's dead end (no token allowed, grammar.py) ends its sequence: "stop" where the grammar
        accepts (a finished grammar whose stop ids min_tokens holds back), else an error naming why."""
        if seq.grammar.matcher.is_accepting() and not seq.grammar.matcher.is_error():
            self._finish(seq, "stop")
        else:
            log.warning("grammar_dead_end", request_id=seq.request_id, reason=seq.grammar.dead_end_reason())
            # The request's own grammar (or its parser limits, grammar_limits) allows no way on: a client error.
            message = f"grammar: no token is allowed ({seq.grammar.dead_end_reason()})"
            self._fail(seq, message, grpc.StatusCode.INVALID_ARGUMENT)

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
        t0 = time.perf_counter()
        spec = [s for s in decode if s.use_spec and self.drafter is not None]
        spec_ids = {id(s) for s in spec}
        others = [(1, s.context_len) for s in decode if id(s) not in spec_ids]
        others += [(p.end - p.start, p.start) for p in prefill]
        self._draft_step.draft(spec, others, len(decode))
        items: list[WorkItem] = []
        failed: list[Sequence] = []  # a grammar failure (prepare, commit) ends its sequence, not the step
        for item in [VerifyItem(s, s.draft.tree if s.draft else EMPTY_TREE) for s in decode] + prefill:
            try:
                if isinstance(item, VerifyItem):
                    item = VerifyItem(item.seq, _constrained(item.seq, item.tree))
                elif item.is_last and item.seq.grammar is not None:
                    item.seq.grammar.prepare()  # the first token's mask
                items.append(item)
            except Exception as err:
                log.exception("sequence_step_failed", request_id=item.seq.request_id, error=str(err))
                failed.append(item.seq)
        shape = [_item_shape(item) for item in items]  # before the commit moves the contexts on
        t1 = time.perf_counter()
        committed = self._verify(items) if items else []
        t2 = time.perf_counter()
        self._draft_step.observe(
            shape,
            bool(prefill),
            (t1 - t0) * 1e3,
            (t2 - t1) * 1e3,
            [
                (item.tree, tokens)
                for item, tokens, _ in committed
                if isinstance(item, VerifyItem) and id(item.seq) in spec_ids and tokens is not None
            ],
        )
        with self._cond:
            for seq in failed:
                self._fail(seq, INTERNAL_ERROR)
            for item, tokens, accept_length in committed:
                seq = item.seq
                if tokens is None:
                    self._fail(seq, INTERNAL_ERROR)
                    continue
                dead = bool(tokens) and tokens[-1] == DEAD_END
                tokens = tokens[:-1] if dead else tokens
                if isinstance(item, PrefillItem):
                    if not tokens and not dead:
                        continue
                    seq.phase = Phase.DECODE
                    self._sharing.prefilled(seq)
                    metrics.TTFT.observe(time.perf_counter() - seq.arrival)
                    metrics.GENERATED_TOKENS.inc(len(tokens))
                    if seq.emit(tokens, None):
                        self._finish(seq, None)
                    elif dead:
                        self._end_dead(seq)
                    continue
                record = self._record(seq, item.tree, accept_length, t0, t1, t2)
                seq.draft = None
                if seq.last_token_time is not None:
                    metrics.ITL.observe((time.perf_counter() - seq.last_token_time) / max(len(tokens), 1))
                metrics.GENERATED_TOKENS.inc(len(tokens))
                if seq.emit(tokens, record):
                    self._finish(seq, None)
                elif dead:
                    self._end_dead(seq)

    def _verify(self, items: list[WorkItem]) -> list[tuple[WorkItem, list[int] | None, int]]:
        """One target forward over the items, then accept + commit each: (item, tokens, accept length);
        tokens None: that sequence's commit failed (logged), which ends it alone."""
        with self._cond:
            self._sharing.make_room(kv_needed(items))
        outputs = run_batch(self.target, self.pool, items, self.tap_layer_ids)
        committed = []
        for out in outputs:
            try:
                if isinstance(out.item, VerifyItem):
                    verdict, tokens = commit_verify(out, self.pool, self.window)
                    accept_length = len(verdict.accepted_nodes)
                else:
                    tokens, accept_length = commit_prefill(out, self.pool, self.window), 0
                if out.item.seq.grammar is not None and tokens:
                    out.item.seq.grammar.advance([t for t in tokens if t != DEAD_END])
            except Exception as err:
                log.exception("sequence_commit_failed", request_id=out.item.seq.request_id, error=str(err))
                committed.append((out.item, None, 0))
                continue
            committed.append((out.item, tokens, accept_length))
        return committed

    def _record(
        self, seq: Sequence, tree: TokenTree, accept_length: int, t0: float, t1: float, t2: float
    ) -> StepRecord:
        """The step record of a verified sequence (step_records.py), counted in the totals GetInfo reports."""
        self.total_steps += 1
        self.total_tokens += accept_length
        return record_step(seq, tree, accept_length, t0, t1, t2, self.step_log)


def _item_shape(item: WorkItem) -> tuple[int, int]:
    """(rows, context tokens before them) of a work item, what the step's cost model reads."""
    if isinstance(item, VerifyItem):
        return 1 + item.tree.n, item.seq.context_len
    return item.end - item.start, item.start


def _constrained(seq: Sequence, tree: TokenTree) -> TokenTree:
    """The tree a grammar-constrained sequence verifies: grammar-invalid nodes pruned, masks set (grammar.py)."""
    return tree if seq.grammar is None else seq.grammar.prepare(tree)

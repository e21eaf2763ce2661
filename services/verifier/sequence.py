"""Per-request state on the verifier, and the messages its stream carries.

A sequence moves WAITING -> PREFILL -> DECODE -> FINISHED. Between steps it holds:
- `committed`: token ids whose latents are in the KV pool, at positions 0..len-1, addressed by `table`
  (its pages; `slots` = the committed tokens' slots in position order);
- `root`: the last emitted token (the previous bonus), not yet in the KV cache, at position len(committed);
- `pending_commit`: what the drafter has not seen yet (tokens, their start position, tapped features).

Who writes what: a step's work on a sequence comes back as a value (`step_outcome.StepOutcome`), and
`apply.py` alone writes decode state (committed, root, generated, pending commit, prefill progress,
speculation, step counts, token times, phase, finish) and emits its stream events. The KV bookkeeping
(`table`, `prefix_match`, `feature_log`) belongs to the prefix cache's driver (prefix_sharing.py).
"""

from __future__ import annotations

import dataclasses
import enum
import queue
import threading
import time
import uuid
from collections.abc import Iterator

import grpc
import torch

from ddtree.contract.sampling_params import SamplingConfig
from ddtree.contract.step_record import StepRecord
from ddtree.contract.token_tree import TokenTree
from ddtree.verifier.constraints.grammar import SequenceGrammar
from ddtree.verifier.constraints.penalties import PenaltyCounts
from ddtree.verifier.kv.page_table import PageTable, pages_for
from ddtree.verifier.sampling.logprobs import PromptRows
from ddtree.verifier.sampling.sampling import make_generator


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclasses.dataclass(frozen=True)
class GenerateParams:
    request_id: str
    input_ids: tuple[int, ...]
    sampling: SamplingConfig
    max_new_tokens: int
    stop_token_ids: frozenset[int]  # eos ids (unless ignore_eos) + the request's stop ids
    use_spec: bool
    budget: int
    chain: bool = False  # ask the drafter for a width-1 tree (a chain)
    feature_taps: tuple[int, ...] = ()  # a Features request: the layers whose rows it streams (features_rpc.py)
    grammar: str = ""  # an llguidance grammar every output token must follow (grammar.py); "" = none
    top_logprobs: int | None = None  # set: each emitted token's logprob and this many top tokens (logprobs.py)
    prompt_logprobs: int | None = None  # set: each prompt token's logprob, rank and this many top tokens (logprobs.py)


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    """One message to the client: tokens committed by a step (or the first token)."""

    token_ids: tuple[int, ...]
    step: StepRecord | None = None
    finish_reason: str | None = None
    error: str | None = None
    error_status: grpc.StatusCode = grpc.StatusCode.INTERNAL  # with error: the status the stream ends with
    features: torch.Tensor | None = None  # a Features request: rows of the tokens just committed (CPU)
    logprobs: tuple = ()  # with top_logprobs: (logprob, top ids, top logprobs) per token_ids entry
    prompt_logprobs: PromptRows | None = None  # a prefill chunk's prompt logprobs (before the first token)


@dataclasses.dataclass(frozen=True)
class PendingCommit:
    token_ids: list[int]
    start: int
    features: torch.Tensor | None  # [n, num_taps * hidden]


def extend_pending(
    pend: PendingCommit | None, tokens: list[int], start: int, features: torch.Tensor | None, window: int
) -> PendingCommit:
    """`pend` followed by newly committed tokens (from `start`), keeping at most `window` of them (0 = all)."""
    if pend is None:
        pend = PendingCommit(list(tokens), start, features)
    else:
        assert pend.start + len(pend.token_ids) == start, "pending commit must stay contiguous"
        feats = None if features is None else torch.cat([pend.features, features.to(pend.features.device)])
        pend = PendingCommit(pend.token_ids + list(tokens), pend.start, feats)
    if window and len(pend.token_ids) > window:
        cut = len(pend.token_ids) - window
        feats = None if pend.features is None else pend.features[cut:].clone()
        pend = PendingCommit(pend.token_ids[cut:], pend.start + cut, feats)
    return pend


@dataclasses.dataclass(frozen=True)
class DraftedTree:
    """A tree drafted for the sequence's next verify, with what its step record reports."""

    tree: TokenTree
    draft_ms: float
    transport_ms: float
    feature_bytes: int


class Sequence:
    def __init__(
        self,
        params: GenerateParams,
        arrival: float | None = None,
        grammar: SequenceGrammar | None = None,
        *,
        page_size: int = 1,
    ):
        """page_size: the KV pool's (the scheduler refuses a sequence of another); 1 is DDTree's default."""
        self.params = params
        self.phase = Phase.WAITING
        self.arrival = time.perf_counter() if arrival is None else arrival
        self.committed: list[int] = []
        self.table = PageTable(page_size)  # KV pages, at the pool's page size from birth
        self.prefill_done = 0  # prompt tokens already in the KV cache
        self.prefix_match = None  # the PrefixMatch pinning them
        self.cached_tokens = 0  # prompt tokens taken from the prefix cache (usage.cached_tokens)
        # Taps of the committed tokens after the prefix the cache holds for it (prefix_match), for the
        # prefix cache (prefix_sharing.py): the cache keeps those of that prefix, so no row is held twice.
        self.feature_log: list[torch.Tensor] | None = None
        self.prompt_key = hash(params.input_ids)  # equal prompts, equal keys: finds a twin prefill (prefix_sharing.py)
        self.root: int | None = None
        self.generated: list[int] = []
        # The output's token counts for penalties and the request's logit masks (penalties.py); apply.py
        # counts every token appended to `generated`. None: the request adjusts no logits.
        sampling = params.sampling
        self.penalty_counts = PenaltyCounts(sampling, params.input_ids) if sampling.adjusts_logits else None
        self.pending_commit: PendingCommit | None = None
        self.drafter_seeded = False  # the drafter holds this sequence's context
        self.context_resends = 0  # times the drafter lost its context and it was sent again (reset)
        # The drafter's key for this sequence's context: unique per Sequence (and across verifiers
        # sharing a drafter), never the client's request id, so that a late Release of a finished
        # request cannot drop the context of a new request that reuses its id.
        self.draft_id = uuid.uuid4().hex
        self.use_spec = params.use_spec
        self.steps = 0
        self.accept_lengths: list[int] = []  # per step: root + matched nodes
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_reason: str | None = None
        self.stop_token_id: int | None = None  # the stop token that ended it (not emitted)
        self.events: queue.Queue[StreamEvent] = queue.Queue()
        self.abort_requested = threading.Event()
        self.grammar = grammar  # params.grammar's state (server.py builds it)
        self._generators: dict[str, torch.Generator | None] = {}

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The request's sampling generator on `device`, made once (seeded from the request's seed) and
        reused by every step; None = the global RNG (no seed set)."""
        key = str(device)
        if key not in self._generators:
            self._generators[key] = make_generator(self.params.sampling, device)
        return self._generators[key]

    @property
    def request_id(self) -> str:
        return self.params.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.params.input_ids)

    @property
    def context_len(self) -> int:
        return len(self.committed)

    @property
    def slots(self) -> torch.Tensor:
        """int64 [context_len]: the committed tokens' KV slots in position order."""
        return self.table.slots

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.generated)

    @property
    def reads_whole_prompt(self) -> bool:
        """Every prompt row is computed, none taken from the prefix cache: a Features request streams
        every row's features, a prompt_logprobs request scores every prompt token."""
        return bool(self.params.feature_taps) or self.params.prompt_logprobs is not None

    @property
    def wants_logits(self) -> bool:
        """Full logits for every row: a sampled request, stop ids masked (min_tokens), logprobs, a grammar,
        or penalties / logit masks (they apply before the choice; the greedy walk shortcut reads raw argmaxes)."""
        return (
            not self.params.sampling.greedy
            or self.params.sampling.adjusts_logits
            or self.masks_stops
            or self.params.top_logprobs is not None
            or self.grammar is not None
        )

    @property
    def masks_stops(self) -> bool:
        """This step's choices need the stop ids masked (min_tokens not reached yet): full logits."""
        return len(self.generated) < self.params.sampling.min_tokens and bool(self.params.stop_token_ids)

    def reserved_slots(self, budget: int) -> int:
        """Worst-case KV slots for its whole life: prompt + outputs + one tree in flight, in whole pages."""
        page = self.table.page_size
        return pages_for(self.prompt_len + self.params.max_new_tokens + budget + 1, page) * page

    def iter_events(self, context: grpc.ServicerContext) -> Iterator[StreamEvent]:
        """The stream's events, for the RPC that serves this sequence (Generate, Features). Waits at most
        1 s at a time, so a client gone away (`context.is_active()` false) ends the iteration; an error
        event aborts the RPC here (`context.abort` raises) with the event's status."""
        while True:
            try:
                event = self.events.get(timeout=1.0)
            except queue.Empty:
                if not context.is_active():
                    return
                continue
            if event.error:
                context.abort(event.error_status, event.error)
            yield event

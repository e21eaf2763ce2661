"""What one step did to one sequence, as a value.

A work item's commit (commit.py), a prefix-cache hit at admission (prefix_sharing.py) and a failed
commit each produce a `StepOutcome`; `apply.apply_outcome` is the one function that writes an outcome
into its sequence, streams it and records it. Nothing in between touches the sequence's decode state,
so an outcome can be inspected (tests, the tree cut's observation) before it lands.
"""

from __future__ import annotations

import dataclasses

import torch

from ddtree.contract.token_tree import TokenTree
from ddtree.verifier.constraints.grammar import GrammarStep
from ddtree.verifier.sampling.logprobs import PromptRows
from ddtree.verifier.sequence import DraftedTree, PendingCommit


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    # KV: tokens whose latents entered the cache this step, in position order after the committed ones.
    committed: tuple[int, ...] = ()
    kv_rows: int = 0  # a prefill chunk: keep the first kv_rows new slots (page_table.commit)
    accepted_nodes: tuple[int, ...] | None = None  # a verify: keep these nodes' slots (page_table.commit_tree)
    prefill_end: int | None = None  # prompt tokens in the cache after this step (prefill chunks, prefix hits)
    cached_tokens: int = 0  # a prefix hit: prompt tokens taken from the prefix cache
    # Output: tokens for the client (before the stop / length cut), and what follows them.
    emitted: tuple[int, ...] = ()
    logprobs: tuple = ()  # with top_logprobs: (logprob, top ids, top logprobs) per emitted token
    next_root: int | None = None  # the last emitted token (the next step's root); None: no token chosen
    starts_decode: bool = False  # the prompt's last chunk: its first token is chosen (or its grammar is stuck)
    dead_end: bool = False  # the grammar allows no token after `emitted`: the sequence ends there
    # The drafter's side.
    pending: PendingCommit | None = None  # the drafter's next commit (replaces the sequence's)
    drafted: DraftedTree | None = None  # a verify: what its Draft call reported (for the step record)
    drafter_has_context: bool = False  # the Draft call carried this sequence's commit
    stops_speculating: bool = False  # the drafter lost this sequence's state: AR from now on (same tokens)
    resends_context: bool = False  # the drafter lost its context: `pending` goes again with reset=True
    # Rows for the prefix cache and the stream.
    taps: torch.Tensor | None = None  # [len(committed), F] drafter taps of the committed tokens (CPU)
    feature_rows: torch.Tensor | None = None  # a Features request's rows of the committed tokens (CPU)
    prompt_logprobs: PromptRows | None = None  # a prompt_logprobs chunk's rows, streamed before any token
    verified: TokenTree | None = None  # a verify: the tree verified (an AR step verifies the empty tree)
    grammar: GrammarStep | None = None  # the step's grammar (grammar.py): `advance` goes on from its matcher
    failure: str | None = None  # the commit failed: the sequence ends with this error, nothing else applies

    @property
    def accept_length(self) -> int:
        """Root + matched nodes of a verify (0 for a prefill chunk or a prefix hit)."""
        return len(self.accepted_nodes) if self.accepted_nodes is not None else 0


def failed_outcome(message: str) -> StepOutcome:
    """The outcome of a step that failed for one sequence (its grammar preparation or its commit)."""
    return StepOutcome(failure=message)

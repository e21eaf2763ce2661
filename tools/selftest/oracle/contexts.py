"""What the oracle drafters share: the tests' `OracleDraftEngine` (the target's own greedy continuation)
and `ddtree selftest gpu`'s `ReplayDraftEngine` (selftest/oracle/replay_drafter.py, a replayed one).

Both speak the Drafter contract like the DFlash engine (`services/drafter/engine.py`): the same `info`,
`knows` and `release` answers and the same checks of each call's sequences, with the same messages, over
`contexts` (seq_id -> the engine's own state of that sequence). An engine says where a commit must start
(`_expected_start`: the whole history for the oracle, anywhere after a reset for the windowed replay).
"""

from __future__ import annotations

from ddtree.drafter.engine import SeqDraftInput


class OracleContexts:
    model_id = "oracle"
    start_note = ""  # appended to a wrong commit_start's message

    def __init__(self, vocab_size: int, hidden_size: int, tap_layer_ids: tuple[int, ...], window: int,
                 depth: int, default_budget: int, max_budget: int, seed: int):  # fmt: skip
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.tap_layer_ids = tap_layer_ids
        self.window = window
        self.depth = depth  # the trees' depth: the truth they are built around
        self.default_budget = default_budget
        self.max_budget = max_budget
        self.seed = seed
        self.feature_width = len(tap_layer_ids) * hidden_size  # a commit's feature row
        self.contexts: dict = {}

    def info(self) -> dict:
        return dict(
            model_id=self.model_id,
            block_size=self.depth + 1,
            mask_token_id=-1,
            target_layer_ids=list(self.tap_layer_ids),
            window=self.window,
            default_budget=self.default_budget,
            max_budget=self.max_budget,
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
            active_sequences=len(self.contexts),
        )

    def knows(self, seq_id: str) -> bool:
        return seq_id in self.contexts

    def release(self, seq_ids) -> int:
        return sum(self.contexts.pop(s, None) is not None for s in seq_ids)

    def _expected_start(self, s: SeqDraftInput) -> int | None:
        """Where the commit of a known sequence, or of a reset, must start; None: anywhere."""
        raise NotImplementedError

    def _validate(self, seqs: list[SeqDraftInput]) -> None:
        """ValueError naming the first sequence of the call that breaks the contract, and how."""
        seen = set()
        for s in seqs:
            where = f"sequence {s.seq_id!r}"
            if s.seq_id in seen:
                raise ValueError(f"{where} appears twice in one call")
            seen.add(s.seq_id)
            if not s.reset and s.seq_id not in self.contexts:
                raise ValueError(f"{where} is unknown; send reset=true with its context first")
            expected = self._expected_start(s)
            if expected is not None and s.commit_start != expected:
                raise ValueError(f"{where}: commit_start {s.commit_start}, expected {expected}{self.start_note}")
            if s.reset and not s.commit_token_ids:
                raise ValueError(f"{where}: reset with an empty commit")
            if any(not 0 <= t < self.vocab_size for t in (*s.commit_token_ids, s.root_token_id)):
                raise ValueError(f"{where}: token id outside [0, {self.vocab_size})")
            if tuple(s.commit_features.shape) != (len(s.commit_token_ids), self.feature_width):
                raise ValueError(
                    f"{where}: commit_features shape {tuple(s.commit_features.shape)}, expected "
                    f"({len(s.commit_token_ids)}, {self.feature_width})"
                )
            if not 0 <= s.budget <= self.max_budget:
                raise ValueError(f"{where}: budget {s.budget} outside [0, {self.max_budget}]")

    def _budget(self, s: SeqDraftInput) -> int:
        """The tree's node budget: the request's, else the default; a chain gets noisy_tree's first
        `depth` nodes (its chain), with no room left for siblings."""
        budget = s.budget or self.default_budget
        return min(budget, self.depth) if s.chain else budget

"""The accept walk's result (`ddtree.verifier.sampling.accept.accept`): which nodes of a tree were accepted."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    accepted_nodes: tuple[int, ...]  # starts with 0 (the root), strictly increasing
    accepted_tokens: tuple[int, ...]  # root token + matched node tokens, same length
    next_root: int  # the target's choice at the last accepted node (the bonus token): the next tree's root

    @property
    def num_accepted_drafts(self) -> int:
        """Matched draft nodes, excluding the root."""
        return len(self.accepted_nodes) - 1

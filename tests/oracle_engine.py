"""The oracle drafter: trees built from the target's own greedy continuation, with controlled noise.

It speaks the Drafter contract like the DFlash engine but ignores the features: it keeps each
sequence's full token history and asks the target model (loaded in this process) for the greedy
continuation after the root. A random drafter rarely matches anything, so this is how tests drive
the verifier through zero, partial and full-depth acceptance (and a correct sibling that is not the
first child), and how `diagnose` can show the verifier's best case. The tree it returns is honest
input: the verifier still checks every token against its own forward.

Noise, per tree, from an RNG seeded by the engine's seed and the sequence's token history (not by its
id, which the verifier makes fresh per request), so the same history always gets the same tree: the chain
breaks at depth b drawn uniformly from 1..D+1 (b = D+1: the whole chain is right); with probability 1/3
the right token at depth b is also present as a later sibling; the remaining budget goes to wrong
siblings at random depths.
"""

from __future__ import annotations

import array
import random
import zlib

import torch

from ddtree.contract.token_tree import TokenTree
from ddtree.drafter.engine import SeqDraftInput
from ddtree.models.attention import AttentionMetadata, SeqAttention


class OracleDraftEngine:
    def __init__(
        self,
        target,
        depth: int = 7,
        default_budget: int = 16,
        max_budget: int = 1024,
        seed: int = 0,
        tap_layer_ids: tuple[int, ...] = (0,),
    ):
        self.target = target
        self.depth = depth
        self.default_budget = default_budget
        self.max_budget = max_budget
        self.seed = seed
        self.tap_layer_ids = tap_layer_ids
        self.vocab_size = target.config.vocab_size
        self.feature_width = len(tap_layer_ids) * target.config.hidden_size
        self.history: dict[str, list[int]] = {}

    def info(self) -> dict:
        return dict(
            model_id="oracle",
            block_size=self.depth + 1,
            mask_token_id=-1,
            target_layer_ids=list(self.tap_layer_ids),
            window=0,
            default_budget=self.default_budget,
            max_budget=self.max_budget,
            hidden_size=self.target.config.hidden_size,
            vocab_size=self.vocab_size,
            active_sequences=len(self.history),
        )

    def knows(self, seq_id: str) -> bool:
        return seq_id in self.history

    def release(self, seq_ids) -> int:
        return sum(self.history.pop(s, None) is not None for s in seq_ids)

    def _validate(self, seqs: list[SeqDraftInput]) -> None:
        seen = set()
        for s in seqs:
            where = f"sequence {s.seq_id!r}"
            if s.seq_id in seen:
                raise ValueError(f"{where} appears twice in one call")
            seen.add(s.seq_id)
            known = s.seq_id in self.history and not s.reset
            if not known and not s.reset:
                raise ValueError(f"{where} is unknown; send reset=true with its context first")
            expected = len(self.history[s.seq_id]) if known else 0
            if s.commit_start != expected:
                raise ValueError(
                    f"{where}: commit_start {s.commit_start}, expected {expected} "
                    f"(the oracle needs the whole history: window 0)"
                )
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

    def append(self, seqs: list[SeqDraftInput]) -> None:
        """Earlier chunks of long commits: extend the histories only."""
        self._validate(seqs)
        for s in seqs:
            self.history[s.seq_id] = ([] if s.reset else self.history.get(s.seq_id, [])) + list(s.commit_token_ids)

    def draft(self, seqs: list[SeqDraftInput]) -> list[TokenTree]:
        self._validate(seqs)
        trees = []
        for s in seqs:
            hist = ([] if s.reset else self.history.get(s.seq_id, [])) + list(s.commit_token_ids)
            self.history[s.seq_id] = hist
            budget = s.budget or self.default_budget
            if s.chain:  # noisy_tree's first `depth` nodes are its chain; no room left for siblings
                budget = min(budget, self.depth)
            truth = self._greedy(hist + [s.root_token_id], self.depth)
            rng = random.Random(zlib.crc32(array.array("q", hist).tobytes(), self.seed & 0xFFFFFFFF))
            trees.append(noisy_tree(truth, budget, self.vocab_size, rng))
        return trees

    @torch.inference_mode()
    def _greedy(self, context: list[int], steps: int) -> list[int]:
        """The target's greedy continuation of `context`, by plain AR decoding with a private cache."""
        cfg = self.target.config
        param = next(self.target.parameters())
        total = len(context) + steps
        cache = torch.zeros(cfg.num_hidden_layers, total, cfg.kv_cache_width, dtype=param.dtype, device=param.device)
        ids = torch.tensor(context, dtype=torch.int64)
        out: list[int] = []
        pos = 0
        for _ in range(steps):
            n = ids.numel()
            meta = AttentionMetadata(seqs=(SeqAttention(0, n, torch.arange(pos), torch.arange(pos, pos + n), None),))
            res = self.target.forward(
                ids.to(param.device),
                torch.arange(pos, pos + n, device=param.device),
                meta,
                cache,
                logits_rows=torch.tensor([n - 1], device=param.device),
            )
            tok = int(res.logits[0].argmax())
            out.append(tok)
            pos += n
            ids = torch.tensor([tok])
        return out


def noisy_tree(truth: list[int], budget: int, vocab_size: int, rng: random.Random) -> TokenTree:
    """A chain along `truth` broken at a random depth, plus siblings, within `budget` nodes."""
    depth = min(len(truth), budget)
    if depth == 0:
        return TokenTree((), (), ())
    brk = rng.randint(1, depth + 1)

    def wrong(d: int, avoid: set[int]) -> int:
        while True:
            t = rng.randrange(vocab_size)
            if t != truth[d - 1] and t not in avoid:
                return t

    tokens, parents, depths = [], [], []
    children: dict[int, set[int]] = {}
    for d in range(1, depth + 1):
        tok = truth[d - 1] if d != brk else wrong(d, set())
        tokens.append(tok)
        parents.append(d - 1)
        depths.append(d)
        children.setdefault(d - 1, set()).add(tok)
    if brk <= depth and len(tokens) < budget and rng.random() < 1 / 3:
        tokens.append(truth[brk - 1])
        parents.append(brk - 1)
        depths.append(brk)
        children[brk - 1].add(truth[brk - 1])
    while len(tokens) < budget and len(tokens) < 4 * depth:
        d = rng.randint(1, depth)
        tok = wrong(d, children.setdefault(d - 1, set()))
        tokens.append(tok)
        parents.append(d - 1)
        depths.append(d)
        children[d - 1].add(tok)
    return TokenTree(tuple(tokens), tuple(parents), tuple(depths))

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
siblings at random depths. A sequence that asks for a table (SeqDraft.table_width = K) gets the same
noise as per-depth rows of K tokens: the truth at rank 0 of every row but row b, where a wrong token
leads and the truth is rank 1 with probability 1/3; the other ranks are random wrong tokens, with
log-probs -(rank + 1) ln 2.
"""

from __future__ import annotations

import array
import math
import random
import zlib

import torch

from ddtree.contract.token_tree import TokenTree
from ddtree.drafter.engine import SeqDraftInput
from ddtree.models.layers.attention import AttentionMetadata, SeqAttention
from ddtree.tools.selftest.oracle.contexts import OracleContexts
from ddtree.tools.selftest.oracle.trees import noisy_tree
from ddtree.tree.best_first import TokenTable


class OracleDraftEngine(OracleContexts):
    """`contexts`: seq_id -> the sequence's whole token history (window 0)."""

    start_note = " (the oracle needs the whole history: window 0)"

    def __init__(
        self,
        target,
        depth: int = 7,
        default_budget: int = 16,
        max_budget: int = 1024,
        seed: int = 0,
        tap_layer_ids: tuple[int, ...] = (0,),
    ):
        cfg = target.config
        super().__init__(cfg.vocab_size, cfg.hidden_size, tap_layer_ids, 0, depth, default_budget, max_budget, seed)
        self.target = target

    def _expected_start(self, s: SeqDraftInput) -> int:
        return 0 if s.reset else len(self.contexts[s.seq_id])

    def append(self, seqs: list[SeqDraftInput]) -> None:
        """Earlier chunks of long commits: extend the histories only."""
        self._validate(seqs)
        for s in seqs:
            self.contexts[s.seq_id] = ([] if s.reset else self.contexts.get(s.seq_id, [])) + list(s.commit_token_ids)

    def draft(self, seqs: list[SeqDraftInput]) -> list[TokenTree | TokenTable]:
        self._validate(seqs)
        trees = []
        for s in seqs:
            hist = ([] if s.reset else self.contexts.get(s.seq_id, [])) + list(s.commit_token_ids)
            self.contexts[s.seq_id] = hist
            budget = self._budget(s)
            truth = self._greedy(hist + [s.root_token_id], self.depth)
            rng = random.Random(zlib.crc32(array.array("q", hist).tobytes(), self.seed & 0xFFFFFFFF))
            if s.table_width:
                trees.append(noisy_table(truth, s.table_width, self.vocab_size, rng))
            else:
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


def noisy_table(truth: list[int], width: int, vocab_size: int, rng: random.Random) -> TokenTable:
    """Per-depth rows of `width` (<= vocab_size) distinct tokens around `truth` (the module's noise), as a
    drafter's top-K table."""
    brk = rng.randint(1, len(truth) + 1)
    rows = []
    for d, right in enumerate(truth, start=1):
        others = [t for t in rng.sample(range(vocab_size), min(vocab_size, width + 1)) if t != right]
        row = [right] if d != brk else [others.pop(0)] + ([right] if width > 1 and rng.random() < 1 / 3 else [])
        row += others[: width - len(row)]
        if len(row) < width:  # the vocabulary has no other token left
            row.append(right)
        rows.append(row)
    logprobs = [[-(r + 1) * math.log(2) for r in range(width)] for _ in rows]
    shape = (len(rows), width)
    return TokenTable(torch.tensor(logprobs, dtype=torch.float32).view(shape), torch.tensor(rows).view(shape))

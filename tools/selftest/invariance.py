"""Row invariance of the verify forward: every tree row's logits against its AR twin, bitwise.

A DDTree verify step runs, per sequence, the tree's rows [root, nodes] (root: the last step's bonus token)
over the committed context, under the ancestor mask, beside other sequences. The AR twin of a row is the
same token decoded alone (batch 1, one row): its context is the committed context and then the row's
ancestors (root first), each of them decoded alone before it. Greedy DDTree equals AR bit for bit when every
row's logits equal its twin's; this module computes both sides over one latent cache:

    cache slots  [contexts (prefilled once, shared) | tree rows (the batched step) | AR twins' rows]

A twin's ancestors are the twins' own rows (decoded alone, in topological order), never the tree's: the
comparison covers the latent each row writes as well as the logits it reads.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from ddtree.models.layers.attention import AttentionMetadata, SeqAttention


@dataclasses.dataclass(frozen=True)
class Tree:
    """A verify step's rows of one sequence: parents[i] < i (topological), parents[0] = -1 (the root)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents) or not self.tokens or self.parents[0] != -1:
            raise ValueError("a tree has a root (parent -1) and one parent per row")
        if any(not 0 <= p < i for i, p in enumerate(self.parents) if i):
            raise ValueError(f"parents must precede their children: {self.parents}")

    def ancestors(self, i: int) -> list[int]:
        """Rows on the path root .. parent(i), root first."""
        path = []
        while self.parents[i] >= 0:
            i = self.parents[i]
            path.append(i)
        return path[::-1]

    def mask(self) -> torch.Tensor:  # bool [n, n]: row i sees row j iff j is i or an ancestor of i
        n = len(self.tokens)
        m = torch.eye(n, dtype=torch.bool)
        for i in range(n):
            m[i, self.ancestors(i)] = True
        return m

    def depths(self) -> list[int]:
        return [len(self.ancestors(i)) for i in range(len(self.tokens))]


def random_tree(num_rows: int, vocab_size: int, rng: random.Random) -> Tree:
    """A random tree of `num_rows` rows: each node's parent drawn among the earlier rows, biased to the
    latest ones (a best-first tree is deep and narrow)."""
    parents = [-1] + [max(0, i - 1 - int(rng.expovariate(1.0) * 2)) for i in range(1, num_rows)]
    return Tree(tuple(rng.randrange(vocab_size) for _ in range(num_rows)), tuple(parents))


@dataclasses.dataclass(frozen=True)
class Comparison:
    rows: int  # rows compared
    differing: int  # rows whose logits are not bitwise equal to their twin's
    max_abs_diff: float  # largest |tree - twin| over every compared logit
    argmax_flips: int  # rows whose argmax differs from their twin's

    def merged(self, other: Comparison) -> Comparison:
        return Comparison(self.rows + other.rows, self.differing + other.differing,
                          max(self.max_abs_diff, other.max_abs_diff),
                          self.argmax_flips + other.argmax_flips)  # fmt: skip


@dataclasses.dataclass
class _Slots:
    next: int = 0

    def take(self, n: int) -> torch.Tensor:
        out = torch.arange(self.next, self.next + n, dtype=torch.int64)
        self.next += n
        return out


def _forward(model, seqs: list[tuple[list[int], list[int], SeqAttention]], cache, step=None) -> torch.Tensor:
    """One forward over sequences (token ids, positions, attention) laid end to end: fp32 logits [T, V].
    `step(model, ids, positions, meta, cache)`, when given, runs the forward instead (e.g. a static step)."""
    ids = torch.tensor([t for s in seqs for t in s[0]], dtype=torch.int64)
    pos = torch.tensor([p for s in seqs for p in s[1]], dtype=torch.int64)
    meta = AttentionMetadata(seqs=tuple(s[2] for s in seqs))
    device = cache.device
    if step is not None:
        return step(model, ids.to(device), pos.to(device), meta, cache).float().cpu()
    out = model.forward(ids.to(device), pos.to(device), meta, cache)
    return out.logits.float().cpu()


def compare_tree_rows(
    model, contexts: list[list[int]], trees: list[Tree], step=None, cache_of=None, verify=None
) -> Comparison:
    """Prefill each context alone, verify every tree in one batched step (sequence b: trees[b] over
    contexts[b]), decode every row's AR twin alone; compare each row's logits with its twin's.
    `step` runs every forward when given (see _forward); `verify`, when given, runs the batched tree step
    instead (e.g. through the static step, its rows against twins decoded by `step`); `cache_of(num_slots)`
    makes the cache (default model.new_kv_cache)."""
    rows = sum(len(c) for c in contexts) + 2 * sum(len(t.tokens) for t in trees)
    cache = (cache_of or model.new_kv_cache)(rows)
    slots = _Slots()
    ctx_slots = []
    for ctx in contexts:  # the shared committed context, each prefilled alone
        s = slots.take(len(ctx))
        ctx_slots.append(s)
        empty = torch.empty(0, dtype=torch.int64)
        _forward(model, [(ctx, list(range(len(ctx))), SeqAttention(0, len(ctx), empty, s))], cache, step)
    batch, start = [], 0
    for ctx, s, tree in zip(contexts, ctx_slots, trees, strict=True):
        n, P = len(tree.tokens), len(ctx)
        pos = [P + d for d in tree.depths()]
        batch.append((list(tree.tokens), pos, SeqAttention(start, n, s, slots.take(n), tree.mask())))
        start += n
    tree_logits = _forward(model, batch, cache, verify or step)
    result = Comparison(0, 0, 0.0, 0)
    row0 = 0
    for ctx, s, tree in zip(contexts, ctx_slots, trees, strict=True):
        twin_slots: list[int] = []
        for i, token in enumerate(tree.tokens):
            anc = tree.ancestors(i)
            prefix = torch.cat([s, torch.tensor([twin_slots[a] for a in anc], dtype=torch.int64)])
            own = slots.take(1)
            twin_slots.append(int(own))
            meta = SeqAttention(0, 1, prefix, own)
            twin = _forward(model, [([token], [len(ctx) + len(anc)], meta)], cache, step)[0]
            result = result.merged(_compare(tree_logits[row0 + i], twin))
        row0 += len(tree.tokens)
    return result


def _compare(got: torch.Tensor, twin: torch.Tensor) -> Comparison:
    same = torch.equal(got, twin)
    diff = 0.0 if same else float((got - twin).abs().nan_to_num(float("inf")).max())
    return Comparison(1, int(not same), diff, int(int(got.argmax()) != int(twin.argmax())))


def random_cuts(length: int, rng: random.Random, max_chunks: int = 4) -> list[int]:
    """Chunk lengths summing to `length`: a prompt prefilled in up to `max_chunks` chunks at random cut points
    (as --prefill-chunk budgets and the prefix cache cut it)."""
    cuts = sorted(rng.sample(range(1, length), min(max_chunks - 1, length - 1)))
    return [b - a for a, b in zip([0, *cuts], [*cuts, length])]


def compare_prefill_rows(
    model, contexts: list[list[int]], rng: random.Random, step=None, cache_of=None, tail: int = 4
) -> Comparison:
    """Prefill rows against their twins: each context prefilled whole and alone (the reference), then in random
    chunks where chunk j of every context shares one batched step (other sequences beside it, each its own
    chunk length); every chunked row's logits against the whole prefill's row, bitwise. And its last `tail`
    tokens decoded alone one at a time over the whole prefill of the rest: the AR twins of those rows. Each
    variant writes its own cache slots, so the comparison covers the latents the rows write too. `step` and
    `cache_of` as compare_tree_rows'."""
    ends = [len(c) for c in contexts]
    cache = (cache_of or model.new_kv_cache)(3 * sum(ends))
    slots = _Slots()
    empty = torch.empty(0, dtype=torch.int64)
    whole = []
    for ctx in contexts:  # the reference: one chunk, one sequence
        whole.append(
            _forward(
                model,
                [(ctx, list(range(len(ctx))), SeqAttention(0, len(ctx), empty, slots.take(len(ctx))))],
                cache,
                step,
            )
        )
    result = Comparison(0, 0, 0.0, 0)
    chunks = [random_cuts(len(c), rng) for c in contexts]
    done = [0] * len(contexts)
    written = [empty] * len(contexts)
    for j in range(max(len(c) for c in chunks)):
        batch, owners, start = [], [], 0
        for b, ctx in enumerate(contexts):
            if j >= len(chunks[b]):
                continue
            lo, n = done[b], chunks[b][j]
            own = slots.take(n)
            batch.append((ctx[lo : lo + n], list(range(lo, lo + n)), SeqAttention(start, n, written[b], own)))
            owners.append((b, lo, n, own))
            start += n
        logits = _forward(model, batch, cache, step)
        row = 0
        for b, lo, n, own in owners:
            for i in range(n):
                result = result.merged(_compare(logits[row + i], whole[b][lo + i]))
            row += n
            done[b], written[b] = lo + n, torch.cat([written[b], own])
    for b, ctx in enumerate(contexts):  # AR twins of the last rows
        head = max(1, len(ctx) - tail)  # at least the first token prefilled
        prefix = slots.take(head)
        _forward(model, [(ctx[:head], list(range(head)), SeqAttention(0, head, empty, prefix))], cache, step)
        for p in range(head, len(ctx)):
            own = slots.take(1)
            twin = _forward(model, [([ctx[p]], [p], SeqAttention(0, 1, prefix, own))], cache, step)[0]
            result = result.merged(_compare(whole[b][p], twin))
            prefix = torch.cat([prefix, own])
    return result

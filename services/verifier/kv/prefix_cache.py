"""Prefix cache: a radix tree over committed token ids whose edges own latent KV slots.

Only committed tokens enter, never tree nodes, so a hit reuses KV that the target computed for exactly
those tokens at exactly those positions. They enter twice: a sequence's prompt when its prefill
completes (`enter`: its whole pages become the cache's, pinned by that sequence as a hit pins them, so
a request with the same prompt that arrives while it still runs, such as the other choices of an
`n` > 1 request, reuses the prompt instead of prefilling it again), and at its end (finish or abort)
the prompt and accepted outputs (`insert`).
Every edge also keeps the target's tapped features of its tokens (host memory), so a sequence that
starts from a cached prefix can seed the drafter with the same context it would have had after a
full prefill: acceptance is the same with and without a hit. Those features are held within
`feature_budget` bytes (--prefix-feature-mb): past it the least recently used edges drop theirs, so a
speculative sequence on such a prefix prefills it again (the KV stays cached for the rest). Without the
budget they would grow with the KV pool, and a token's features can weigh more than its KV (the demo
pair: 3 KB against 1.6 KB). (The alternative, a draft-context cache
inside the drafter keyed by token ids, would need a new RPC and per-replica affinity for prefixes.)

Reference counts pin the edges a running sequence uses; eviction frees least-recently-used leaves with
no reference. Accounting: pool free + slots held by sequences alone + slots in the cache == total;
`pinned_slots` of the cache's are pinned (held by running sequences as their shared prefixes).

Page size P > 1 (like SGLang's paged radix cache): the cache holds whole pages only. Edges are cut at
page boundaries, children are keyed by their first page of tokens, a match is a whole number of pages,
and insert adopts the whole pages of a sequence and hands the partial last page back (its tokens are
recomputed by the next request). Page size 1 is the token-granular cache.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import torch

from ddtree.verifier.kv.kv_pool import LatentKVPool


class _Node:
    __slots__ = ("tokens", "slots", "features", "children", "parent", "ref", "last_used")

    def __init__(self, tokens: list[int], slots: torch.Tensor, features: torch.Tensor | None, parent):
        self.tokens = tokens  # the edge's token ids
        self.slots = slots  # int64 [len(tokens)] KV slots, owned by the cache
        self.features = features  # [len(tokens), F] or None
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.ref = 0
        self.last_used = time.monotonic()


@dataclasses.dataclass(frozen=True)
class PrefixMatch:
    length: int
    slots: torch.Tensor  # int64 [length]
    features: torch.Tensor | None  # [length, F] (None when not kept for every token)
    last: object  # deepest matched node (or None); release() unpins its path


def _nbytes(features: torch.Tensor | None) -> int:
    return 0 if features is None else features.numel() * features.element_size()


class PrefixCache:
    def __init__(self, pool: LatentKVPool, feature_budget: int = 256 << 20):
        """feature_budget: bytes of features kept over all edges (the rows' own bytes; an edge split from
        another shares its storage until both are dropped)."""
        self.pool = pool
        self.page_size = pool.page_size
        self.root = _Node([], torch.empty(0, dtype=torch.int64), None, None)
        self.cached_slots = 0
        self.pinned_slots = 0  # of cached_slots: those of nodes some match pins (ref > 0)
        self.feature_budget = feature_budget
        self.feature_bytes = 0  # of every edge's features
        self._lock = threading.RLock()

    def _key(self, tokens: list[int], i: int) -> tuple[int, ...]:
        """A child's key: its first page of tokens."""
        return tuple(tokens[i : i + self.page_size])

    def _common(self, edge: list[int], tokens: list[int], i: int) -> int:
        """Tokens of `edge` that match tokens[i:], rounded down to whole pages."""
        n = 0
        while n < len(edge) and i + n < len(tokens) and edge[n] == tokens[i + n]:
            n += 1
        return n - n % self.page_size

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut node's edge after `at` tokens; returns the new upper node."""
        upper = _Node(
            node.tokens[:at], node.slots[:at], None if node.features is None else node.features[:at], node.parent
        )
        upper.ref, upper.last_used = node.ref, node.last_used
        node.parent.children[self._key(upper.tokens, 0)] = upper
        node.tokens, node.slots = node.tokens[at:], node.slots[at:]
        node.features = None if node.features is None else node.features[at:]
        node.parent = upper
        upper.children[self._key(node.tokens, 0)] = node
        return upper

    def match(self, tokens: list[int], with_features: bool = True) -> PrefixMatch:
        """Longest cached prefix of `tokens` (whole pages); pins its nodes (release() them when done).
        with_features False: the match's features are None (a pin only, no copy of the rows)."""
        with self._lock:
            tokens = tokens[: len(tokens) - len(tokens) % self.page_size]
            node, i, path = self.root, 0, []
            now = time.monotonic()
            while i < len(tokens) and self._key(tokens, i) in node.children:
                child = node.children[self._key(tokens, i)]
                n = self._common(child.tokens, tokens, i)
                if n < len(child.tokens):
                    child = self._split(child, n)
                path.append(child)
                i += n
                node = child
            # Pins are counted on every node from the deepest match up to the root. Later splits copy
            # the count to the new upper node, which sits on the same parent chain, so release()
            # walking up from the same deepest node undoes exactly what was done here.
            self._walk_up(path[-1] if path else None, +1, now)
            slots = torch.cat([nd.slots for nd in path]) if path else torch.empty(0, dtype=torch.int64)
            feats = None
            if with_features and path and all(nd.features is not None for nd in path):
                feats = torch.cat([nd.features for nd in path])
            return PrefixMatch(i, slots, feats, path[-1] if path else None)

    def _walk_up(self, node, delta: int, now: float | None = None) -> None:
        while node is not None and node is not self.root:
            node.ref += delta
            assert node.ref >= 0, "prefix cache reference count below zero"
            if (node.ref > 0) != (node.ref - delta > 0):  # pinned now, or no longer
                self.pinned_slots += node.slots.numel() if node.ref > 0 else -node.slots.numel()
            if now is not None:
                node.last_used = now
            node = node.parent

    def release(self, match: PrefixMatch) -> None:
        with self._lock:
            self._walk_up(match.last, -1)

    def insert(
        self,
        tokens: list[int],
        slots: torch.Tensor,
        features: torch.Tensor | None,
        features_from: int = 0,
        owned: bool = False,
    ) -> torch.Tensor:
        """Adopt the KV of `tokens` (slots[i] holds token i; page-aligned: token i at page offset i % P).
        Returns the pages (page size 1: slots) the cache did not take: those whose tokens were cached
        already, and a partial last page; the caller frees them.

        features: None, or the rows of tokens[features_from:] ([n, F]; rows past the whole pages are not
        read). The tokens before features_from are cached already (the caller's pinned prefix) and keep
        the features they have. owned: `features` is a fresh tensor handed over, so a new edge that starts
        at its first row keeps a view of it, not a copy (its storage then also holds the rows past the
        whole pages, less than a page's)."""
        assert len(tokens) == slots.numel()
        P = self.page_size
        whole = len(tokens) - len(tokens) % P
        assert features is None or features.shape[0] >= whole - features_from, "a feature row per token"

        def rows(start: int, end: int, view: bool) -> torch.Tensor | None:
            if features is None or start < features_from:
                return None
            part = features[start - features_from : end - features_from]
            return part if view and owned and start == features_from else part.clone()

        rejected = [slots[whole::P] // P] if whole < len(tokens) else []  # the partial last page
        with self._lock:
            node, i = self.root, 0
            while i < whole:
                child = node.children.get(self._key(tokens, i))
                if child is None:
                    leaf = _Node(list(tokens[i:whole]), slots[i:whole].clone(), rows(i, whole, view=True), node)
                    node.children[self._key(tokens, i)] = leaf
                    self.cached_slots += leaf.slots.numel()
                    self.feature_bytes += _nbytes(leaf.features)
                    break
                n = self._common(child.tokens, tokens[:whole], i)
                if n < len(child.tokens):
                    child = self._split(child, n)
                own = self.pool.pages_of(slots[i : i + n])
                # the cache's own pages (a shared prefix) are not ours to free
                rejected.append(own[own != self.pool.pages_of(child.slots[:n])])
                if child.features is None:
                    child.features = rows(i, i + n, view=False)
                    self.feature_bytes += _nbytes(child.features)
                child.last_used = time.monotonic()
                node, i = child, i + n
            self._trim_features()
            return torch.cat(rejected) if rejected else torch.empty(0, dtype=torch.int64)

    def _trim_features(self) -> None:
        """Drop the features of the least recently used edges until they fit feature_budget (caller holds the
        lock). A match through such an edge has no features: a speculative sequence then prefills."""
        if self.feature_bytes <= self.feature_budget:
            return
        held, stack = [], list(self.root.children.values())
        while stack:
            nd = stack.pop()
            stack.extend(nd.children.values())
            if nd.features is not None:
                held.append(nd)
        for nd in sorted(held, key=lambda x: x.last_used):
            self.feature_bytes -= _nbytes(nd.features)
            nd.features = None
            if self.feature_bytes <= self.feature_budget:
                break

    def enter(
        self, tokens: list[int], slots: torch.Tensor, features: torch.Tensor | None, features_from: int = 0
    ) -> PrefixMatch | None:
        """A running sequence's committed `tokens` (slots[i] holds token i, page-aligned) enter the cache
        in whole pages, which the cache owns from now on, pinned by the returned match (the sequence
        keeps them as its shared prefix and release()s the match at its end, like a hit's). The match
        carries no features (they are the cache's). `features`: the rows of tokens[features_from:], the
        tokens before being the sequence's pinned hit, handed over (insert's `owned`: not copied).

        None where the cache holds part of those tokens under other slots (another sequence computed
        the same prefix at the same time): nothing changes, the sequence keeps its own KV and inserts
        it at its end. Tokens the cache holds under these very slots (the sequence's own hit) stay."""
        assert len(tokens) == slots.numel()
        whole = len(tokens) - len(tokens) % self.page_size
        with self._lock:
            held = self.match(tokens[:whole], with_features=False)
            if not torch.equal(held.slots, slots[: held.length]):
                self.release(held)
                return None
            assert held.length >= features_from, "the tokens before features_from are the sequence's pinned hit"
            taken = self.insert(tokens[:whole], slots[:whole], features, features_from, owned=True)
            assert taken.numel() == 0, "the cache refused pages of a prefix it did not hold"
            entered = self.match(tokens[:whole], with_features=False)
            self.release(held)
            assert entered.length == whole
            return entered

    def evict(self, need: int) -> int:
        """Free at least `need` slots from unreferenced leaves, least recently used first."""
        freed = 0
        with self._lock:
            while freed < need:
                leaves = []
                stack = [self.root]
                while stack:
                    nd = stack.pop()
                    stack.extend(nd.children.values())
                    if nd is not self.root and not nd.children and nd.ref == 0:
                        leaves.append(nd)
                if not leaves:
                    break
                for leaf in sorted(leaves, key=lambda x: x.last_used):
                    self.pool.free(self.pool.pages_of(leaf.slots))
                    freed += leaf.slots.numel()
                    self.cached_slots -= leaf.slots.numel()
                    self.feature_bytes -= _nbytes(leaf.features)
                    del leaf.parent.children[self._key(leaf.tokens, 0)]
                    if freed >= need:
                        break
        return freed

    def all_slots(self, pinned_only: bool = False) -> torch.Tensor:
        """The slots the cache holds (pinned_only: those of pinned nodes), by walking the tree."""
        with self._lock:
            out, stack = [], list(self.root.children.values())
            while stack:
                nd = stack.pop()
                if nd.ref > 0 or not pinned_only:
                    out.append(nd.slots)
                stack.extend(nd.children.values())
            return torch.cat(out) if out else torch.empty(0, dtype=torch.int64)

    def all_pages(self, pinned_only: bool = False) -> torch.Tensor:
        return self.pool.pages_of(self.all_slots(pinned_only))

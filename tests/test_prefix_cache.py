"""The radix prefix cache against a brute-force model of what it should hold."""

from __future__ import annotations

import random

import torch

from ddtree.verifier.kv_pool import LatentKVPool
from ddtree.verifier.prefix_cache import PrefixCache


def _check(cache: PrefixCache, pool: LatentKVPool, held: int) -> None:
    cached = cache.all_slots()
    assert cached.numel() == cached.unique().numel() == cache.cached_slots
    assert pool.num_free + held + cache.cached_slots == pool.num_slots


def test_match_insert_split_and_evict():
    pool = LatentKVPool(1, 64, 2, torch.float32, "cpu")
    cache = PrefixCache(pool)
    a = [1, 2, 3, 4, 5]
    slots_a = pool.alloc(5)
    assert cache.insert(a, slots_a, torch.arange(5.0)[:, None]).numel() == 0
    _check(cache, pool, 0)
    m = cache.match([1, 2, 3, 9])
    assert m.length == 3 and torch.equal(m.slots, slots_a[:3]) and m.features.flatten().tolist() == [0, 1, 2]
    # a second sequence computed [1, 2, 3, 9, 9] itself: the shared part's slots come back to free
    own = pool.alloc(5)
    rejected = cache.insert([1, 2, 3, 9, 9], own, None)
    assert torch.equal(rejected.sort().values, own[:3].sort().values)
    pool.free(rejected)
    _check(cache, pool, 0)
    assert cache.evict(100) == 4  # the leaves [4, 5] and [9, 9]; [1, 2, 3] is pinned by the match
    again = cache.match([1, 2, 3])
    assert again.length == 3
    cache.release(m)
    assert cache.evict(100) == 0, "still pinned by the second match"
    cache.release(again)
    assert cache.evict(100) == 3
    assert pool.num_free == pool.num_slots and cache.cached_slots == 0


def test_random_traffic_keeps_accounting_and_matches_brute_force():
    rng = random.Random(0)
    pool = LatentKVPool(1, 400, 2, torch.float32, "cpu")
    cache = PrefixCache(pool)
    stored: dict[tuple, int] = {}  # brute force: every cached token prefix -> its slot
    for _ in range(300):
        seq = [rng.randint(0, 3) for _ in range(rng.randint(1, 12))]
        m = cache.match(seq)
        brute = 0
        while brute < len(seq) and tuple(seq[: brute + 1]) in stored:
            brute += 1
        assert m.length == brute
        assert m.slots.tolist() == [stored[tuple(seq[: k + 1])] for k in range(brute)]
        if pool.num_free < len(seq) - m.length:
            cache.evict(len(seq) - m.length - pool.num_free)
            stored = {}
            stack = [((), cache.root)]
            while stack:
                prefix, node = stack.pop()
                for child in node.children.values():
                    p = prefix
                    for t, s in zip(child.tokens, child.slots.tolist()):
                        p = p + (t,)
                        stored[p] = s
                    stack.append((p, child))
        new = pool.alloc(len(seq) - m.length)
        slots = torch.cat([m.slots, new])
        pool.free(cache.insert(seq, slots, None))
        cache.release(m)
        for k in range(len(seq)):
            stored.setdefault(tuple(seq[: k + 1]), int(slots[k]))
        _check(cache, pool, 0)

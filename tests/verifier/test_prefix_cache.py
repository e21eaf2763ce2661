"""The radix prefix cache against a brute-force model of what it should hold, and running sequences that
enter their prompts into it (PrefixCache.enter) against ids written into the KV they computed."""

from __future__ import annotations

import random

import pytest
import torch

from ddtree.verifier.kv.kv_pool import LatentKVPool
from ddtree.verifier.kv.page_table import PageTable, check_accounting
from ddtree.verifier.kv.prefix_cache import PrefixCache


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


@pytest.mark.parametrize("page_size", [1, 4])
def test_enter_adopts_a_running_prompt_and_pins_it(page_size):
    """A sequence's prompt enters at its prefill's end: the cache owns its whole pages, pinned by the
    sequence, whose partial last page stays its own; a second sequence that computed the same prompt
    beside it keeps its own KV (None) and hands it back at its end."""
    P = page_size
    pool = LatentKVPool(1, 64, 2, torch.float32, "cpu", page_size=P)
    cache = PrefixCache(pool)
    prompt = list(range(10, 20))  # 10 tokens: whole pages 8 with P = 4
    whole = len(prompt) - len(prompt) % P
    first, second = PageTable(P), PageTable(P)
    for t in (first, second):
        t.extend(pool, len(prompt))
        t.commit(len(prompt))
    entered = cache.enter(prompt, first.slots, torch.arange(10.0)[:, None])
    assert entered.length == whole and torch.equal(entered.slots, first.slots[:whole])
    first.share_entered(entered.slots)
    assert cache.enter(prompt, second.slots, None) is None
    check_accounting(pool, [first, second], cache)
    assert cache.cached_slots == whole and cache.evict(pool.num_slots) == 0  # pinned
    hit = cache.match(prompt[:-1])  # a third request: all but the last token, whole pages
    assert hit.length == (len(prompt) - 1) // P * P and hit.features.flatten().tolist() == list(range(hit.length))
    cache.release(hit)
    # at their ends: the first's pages are the cache's already; the second's duplicates come back
    for t in (first, second):
        t.extend(pool, 3)
        t.commit(3)
    pool.free(cache.insert(prompt + [1, 2, 3], first.slots, None))
    cache.release(entered)
    duplicates = cache.insert(prompt + [4, 5, 6], second.slots, None)
    assert set(duplicates.tolist()) >= set(second.pages[: whole // P].tolist())
    pool.free(duplicates)
    check_accounting(pool, [], cache)
    cache.evict(pool.num_slots)
    assert cache.cached_slots == 0 and pool.num_free == pool.num_slots


@pytest.mark.parametrize("page_size", [1, 4])
def test_running_sequences_that_enter_their_prompts_read_the_right_kv(page_size):
    """Random lives of sequences as the scheduler runs them (match, prefill, enter, decode, finish, with
    eviction when the pool runs low). Every slot written holds an id of the token prefix it was
    computed for; every match must give slots holding exactly the ids of the matched prefixes, and the
    accounting (free + held + cached, nothing held twice) holds after every event."""
    rng = random.Random(page_size)
    P = page_size
    pool = LatentKVPool(1, 256, 1, torch.float32, "cpu", page_size=P)
    cache = PrefixCache(pool)
    ids: dict[tuple, int] = {}

    def write(table, tokens, start, slots):
        for k, slot in enumerate(slots.tolist()):
            pool.cache[0, slot, 0] = float(ids.setdefault(tuple(tokens[: start + k + 1]), len(ids) + 1))

    def room(n):
        if pool.num_free < n:
            cache.evict(n - pool.num_free)
        return pool.num_free >= n

    prompts = [[rng.randint(0, 2) for _ in range(rng.randint(2, 13))] for _ in range(5)]
    running: list[dict] = []
    for _ in range(600):
        r = rng.random()
        if r < 0.3 and len(running) < 5:
            tokens = list(rng.choice(prompts))
            table, match = PageTable(P), cache.match(tokens[:-1])
            for k in range(match.length):
                assert float(pool.cache[0, int(match.slots[k]), 0]) == ids[tuple(tokens[: k + 1])]
            if match.length:
                table.share(match.slots)
            if not room(P * table.pages_needed(len(tokens) - match.length)):
                cache.release(match)
                continue
            write(table, tokens, match.length, table.extend(pool, len(tokens) - match.length))
            table.commit(len(tokens) - match.length)
            entered = cache.enter(tokens, table.slots, None)
            if entered is not None:
                table.share_entered(entered.slots)
                cache.release(match)
                match = entered
            running.append({"tokens": tokens, "table": table, "match": match})
        elif r < 0.75 and running:
            s = rng.choice(running)
            if room(P * s["table"].pages_needed(1)):
                s["tokens"].append(rng.randint(0, 2))
                write(s["table"], s["tokens"], s["table"].length, s["table"].extend(pool, 1))
                s["table"].commit(1)
        elif running:
            s = running.pop(rng.randrange(len(running)))
            pool.free(cache.insert(s["tokens"], s["table"].slots, None))
            cache.release(s["match"])
        check_accounting(pool, [s["table"] for s in running], cache)
    for s in running:
        pool.free(cache.insert(s["tokens"], s["table"].slots, None))
        cache.release(s["match"])
    cache.evict(pool.num_slots)
    assert cache.cached_slots == 0 and pool.num_free == pool.num_slots


def test_enter_takes_the_rows_after_a_hit_without_a_copy():
    """A sequence that started from a hit enters its prompt with the features of the tokens after the hit
    only (features_from): the new edge keeps a view of the tensor handed over, the hit's edge keeps its
    rows, and a later match reads them all; at its end the rows after the entered prompt go in the same way.
    `pinned_slots` counts what the matches pin, against a walk of the tree."""
    P = 4
    pool = LatentKVPool(1, 64, 2, torch.float32, "cpu", page_size=P)
    cache = PrefixCache(pool)
    a = list(range(100, 112))  # a finished sequence: 12 tokens with features 0..11
    ta = PageTable(P)
    ta.extend(pool, 12)
    ta.commit(12)
    pool.free(cache.insert(a, ta.slots, torch.arange(12.0)[:, None]))
    b = a[:8] + [200 + k for k in range(6)]  # 14 tokens: the first 8 cached
    hit = cache.match(b[:-1])
    assert hit.length == 8 and cache.pinned_slots == 8
    tb = PageTable(P)
    tb.share(hit.slots)
    tb.extend(pool, 6)
    tb.commit(6)
    rows = 50.0 + torch.arange(6.0)[:, None]  # tokens 8..13
    entered = cache.enter(b, tb.slots, rows, features_from=8)
    assert entered.length == 12 and entered.features is None
    tb.share_entered(entered.slots)
    cache.release(hit)
    check_accounting(pool, [tb], cache)
    assert cache.pinned_slots == 12 == cache.all_slots(pinned_only=True).numel()
    edges = [nd for nd in cache.root.children[tuple(b[:P])].children.values() if nd.tokens[0] == b[8]]
    assert len(edges) == 1 and edges[0].features.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr()
    again = cache.match(b[:12])
    assert again.features.flatten().tolist() == list(range(8)) + [50.0, 51.0, 52.0, 53.0]
    cache.release(again)
    tb.extend(pool, 2)
    tb.commit(2)
    tail = torch.tensor([[54.0], [55.0], [56.0], [57.0]])  # tokens 12..15
    pool.free(cache.insert(b + [300, 301], tb.slots, tail, features_from=12, owned=True))
    cache.release(entered)
    assert cache.pinned_slots == 0
    check_accounting(pool, [], cache)
    whole = cache.match(b + [300, 301])
    assert whole.length == 16 and whole.features.flatten().tolist() == list(range(8)) + [50.0 + k for k in range(8)]
    cache.release(whole)
    cache.evict(pool.num_slots)
    assert cache.cached_slots == 0 and pool.num_free == pool.num_slots


def test_features_stay_within_their_budget_least_recently_used_first():
    """Issue 47: the features of cached prefixes are bounded (--prefix-feature-mb), not the KV pool's size;
    the edges used last keep theirs (a match returns them exactly), the oldest lose them (a match then has
    none), and the count equals the bytes the edges hold."""
    rng = random.Random(1)
    pool = LatentKVPool(1, 4000, 2, torch.float32, "cpu")
    row_bytes = 8 * 4  # F = 8 fp32
    cache = PrefixCache(pool, feature_budget=60 * row_bytes)
    kept: dict[tuple, torch.Tensor] = {}
    for i in range(40):
        seq = [i] + [rng.randint(0, 50) for _ in range(rng.randint(3, 12))]  # distinct first tokens: own edges
        feats = torch.randn(len(seq), 8)
        pool.free(cache.insert(seq, pool.alloc(len(seq)), feats))
        kept[tuple(seq)] = feats
        held, stack = 0, list(cache.root.children.values())
        while stack:
            nd = stack.pop()
            stack.extend(nd.children.values())
            held += 0 if nd.features is None else nd.features.numel() * 4
        assert held == cache.feature_bytes <= cache.feature_budget
    recent = list(kept)[-3:]  # at most 36 rows: within the budget whatever came before
    for seq in recent:
        m = cache.match(list(seq))
        assert m.length == len(seq) and torch.equal(m.features, kept[seq])
        cache.release(m)
    oldest = cache.match(list(next(iter(kept))))
    assert oldest.length > 0 and oldest.features is None  # the KV stays cached, its features went
    cache.release(oldest)
    _check(cache, pool, 0)

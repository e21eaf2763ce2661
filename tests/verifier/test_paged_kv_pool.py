"""The paged latent KV pool (page size P > 1) against page size 1: allocation and accounting, page tables
that copy accepted tree nodes into place, a prefix cache that shares whole pages, and the verifier with
--page-size 4 / 16 giving the same tokens and acceptance as page size 1 and AR."""

from __future__ import annotations

import concurrent.futures as cf
import random

import grpc
import pytest
import torch

from ddtree.contract.token_tree import TokenTree
from ddtree.verifier.kv.kv_pool import KVPoolExhausted, LatentKVPool
from ddtree.verifier.kv.page_table import PageTable, check_accounting
from ddtree.verifier.kv.prefix_cache import PrefixCache

PAGE_SIZES = [1, 4, 16]


def _pool(page_size: int, slots: int = 256, layers: int = 2) -> LatentKVPool:
    return LatentKVPool(layers, slots, 3, torch.float32, "cpu", page_size=page_size)


def test_pool_hands_out_pages_and_keeps_accounting():
    pool = _pool(4, 40)
    assert (pool.num_pages, pool.num_slots, pool.num_free, pool.num_free_pages) == (10, 40, 40, 10)
    a = pool.alloc(3)
    b = pool.alloc(7)
    assert len(set(a.tolist()) | set(b.tolist())) == 10 and pool.num_free == 0 and pool.num_used == 40
    assert pool.slots_of(a[:1]).tolist() == [4 * int(a[0]) + i for i in range(4)]
    assert torch.equal(pool.pages_of(pool.slots_of(b)), b)
    with pytest.raises(KVPoolExhausted, match="need 1 KV pages of 4 slots, 0 free of 10"):
        pool.alloc(1)
    pool.free(a[1:])
    pool.check()
    assert pool.num_free_pages == 2 and pool.num_free == 8
    with pytest.raises(AssertionError, match="double free"):
        pool.free(a[1:2])
    with pytest.raises(AssertionError, match="double free"):
        pool.free(a[[0, 0]])
    pool.free(a[:1])
    pool.free(b)
    pool.check()
    assert pool.num_free == pool.num_slots and pool.num_used == 0
    with pytest.raises(ValueError, match="multiple of page_size 4"):
        _pool(4, 42)


def _random_tree(rng: random.Random, n: int) -> tuple[TokenTree, list[int]]:
    """A random tree of n nodes and a random accepted root-to-node path (node indices, root first)."""
    parents, depths = [], []
    for i in range(1, n + 1):
        p = rng.randrange(i)
        parents.append(p)
        depths.append(0 if p == 0 else depths[p - 1])
        depths[-1] += 1
    tree = TokenTree(tuple(range(100, 100 + n)), tuple(parents), tuple(depths))
    node, path = rng.randrange(n + 1), []
    while node:
        path.append(node)
        node = parents[node - 1]
    return tree, [0] + path[::-1]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_page_tables_put_accepted_latents_at_their_positions(page_size):
    """Two sequences take turns: prefill chunks and tree verifies with random acceptance. Every row
    written carries a unique value in every layer; after each commit the committed positions hold
    exactly the values of the rows accepted for them (what page size 1 keeps in place)."""
    rng = random.Random(page_size)
    pool = _pool(page_size)
    tables = [PageTable(page_size), PageTable(page_size)]
    expect: list[list[float]] = [[], []]
    value = 0.0
    for step in range(60):
        k = step % 2
        t = tables[k]
        if step < 4 or rng.random() < 0.2:
            q, rows = rng.randint(1, 9), None
        else:
            tree, rows = _random_tree(rng, rng.randint(0, 10))
            q = tree.n + 1
        slots = t.extend(pool, q)
        vals = torch.arange(value, value + q)
        value += q
        pool.cache[:, slots] = vals[None, :, None] + torch.tensor([0.0, 0.5])[:, None, None]
        if rows is None:
            t.commit(q)
            expect[k] += vals.tolist()
        else:
            t.commit_tree(pool, rows)
            expect[k] += vals[rows].tolist()
        check_accounting(pool, tables)
        for j in (0, 1):
            got = pool.cache[:, tables[j].slots, 0]
            assert got[0].tolist() == expect[j] and got[1].tolist() == [v + 0.5 for v in expect[j]]
    # a step that fails before its commit leaves scratch pages: trim returns them
    tables[0].extend(pool, 2 * page_size + 1)
    tables[0].trim(pool)
    check_accounting(pool, tables)
    for t in tables:
        pool.free(t.pages)
    assert pool.num_free == pool.num_slots


def test_page_size_one_commit_moves_nothing():
    pool = _pool(1, 32)
    t = PageTable(1)
    t.extend(pool, 3)
    t.commit(3)
    scratch = t.extend(pool, 6)
    before = pool.cache.clone()
    t.commit_tree(pool, [0, 2, 5])
    assert torch.equal(pool.cache, before), "page size 1 must not copy KV"
    assert t.slots[3:].tolist() == scratch[[0, 2, 5]].tolist()
    assert pool.num_used == 6


def test_prefix_cache_shares_whole_pages_only():
    pool = _pool(4, 64)
    cache = PrefixCache(pool)
    a = list(range(1, 11))  # 10 tokens: 2 whole pages + a partial one
    ta = PageTable(4)
    ta.extend(pool, 10)
    ta.commit(10)
    tail = ta.pages[2:]
    rejected = cache.insert(a, ta.slots, torch.arange(10.0)[:, None])
    assert rejected.tolist() == tail.tolist(), "the partial last page goes back to the caller"
    pool.free(rejected)
    assert cache.cached_slots == 8
    check_accounting(pool, [], cache)
    assert cache.match(a[:3]).length == 0
    m7 = cache.match(a[:7])
    assert m7.length == 4 and m7.slots.tolist() == ta.slots[:4].tolist()
    m = cache.match(a + [99])
    assert m.length == 8 and m.features.flatten().tolist() == list(range(8))
    # a second sequence starts from the cached 8 tokens, diverges inside the third page
    tb = PageTable(4)
    tb.share(m.slots)
    tb.extend(pool, 8)
    tb.commit(8)
    check_accounting(pool, [tb], cache)
    b = a[:8] + [9, 10, 77, 78, 79, 80, 81, 82]
    pool.free(cache.insert(b, tb.slots, None))  # pages 0-1 are the cache's, page 2-3 adopted
    cache.release(m)
    cache.release(m7)
    assert cache.cached_slots == 16
    check_accounting(pool, [], cache)
    hit = cache.match(b + [1])
    assert hit.length == 16
    cache.release(hit)
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]).length == 8
    assert cache.evict(1000) == 8, "[1..8] is pinned by the last match"
    check_accounting(pool, [], cache)


def test_paged_prefix_cache_random_traffic_matches_brute_force():
    rng = random.Random(1)
    P = 4
    pool = _pool(P, 400)
    cache = PrefixCache(pool)
    for _ in range(200):
        seq = [rng.randint(0, 1) for _ in range(rng.randint(1, 20))]
        cached = set()  # brute force: every cached whole-page prefix
        stack = [((), cache.root)]
        while stack:
            prefix, node = stack.pop()
            for child in node.children.values():
                p = prefix + tuple(child.tokens)
                cached.update(p[:k] for k in range(len(prefix) + P, len(p) + 1, P))
                stack.append((p, child))
        m = cache.match(seq)
        brute = max([k for k in range(0, len(seq) + 1, P) if k == 0 or tuple(seq[:k]) in cached])
        assert m.length == brute
        t = PageTable(P)
        if m.length:
            t.share(m.slots)
        if pool.num_free < t.pages_needed(len(seq) - m.length) * P:
            cache.evict(t.pages_needed(len(seq) - m.length) * P - pool.num_free)
        t.extend(pool, len(seq) - m.length)
        t.commit(len(seq) - m.length)
        check_accounting(pool, [t], cache)
        pool.free(cache.insert(seq, t.slots, None))
        cache.release(m)
        check_accounting(pool, [], cache)
    cache.evict(pool.num_slots)
    assert pool.num_free == pool.num_slots and cache.cached_slots == 0


# ---- the target model: tree verify with page size P leaves the same KV as page size 1 ----


def _decode(model, page_size: int, prompt: list[int], trees, steps: int):
    """Prefill, then `steps` verifies of trees(seq) (greedy); returns the sequence and its pool."""
    from ddtree.contract.sampling_params import SamplingConfig
    from ddtree.verifier.sequence import GenerateParams, Sequence
    from ddtree.verifier.step.apply import apply_outcome
    from ddtree.verifier.step.batch import run_batch
    from ddtree.verifier.step.target import LocalTarget
    from ddtree.verifier.step.work_items import PrefillItem, VerifyItem

    cfg = model.config
    pool = LatentKVPool(cfg.num_hidden_layers, 256, cfg.kv_cache_width, torch.float32, "cpu", page_size=page_size)
    seq = Sequence(GenerateParams("s", tuple(prompt), SamplingConfig(temperature=0.0), 64, frozenset(), True, 16))
    seq.table = PageTable(page_size)
    prefill = PrefillItem(seq, 0, len(prompt))
    apply_outcome(seq, prefill.commit(run_batch(LocalTarget(model), pool, [prefill], ())[0], 0), pool)
    accepted = []
    for _ in range(steps):
        item = VerifyItem(seq, trees(seq))
        outcome = item.commit(run_batch(LocalTarget(model), pool, [item], ())[0], 0)
        apply_outcome(seq, outcome, pool)
        accepted.append(outcome.accepted_nodes)
        check_accounting(pool, [seq.table])
    return seq, pool, accepted


def test_tree_verify_with_pages_leaves_the_same_kv_as_page_size_one(default_ckpt):
    """Trees that put a wrong branch first, so the accepted path is off the chain of rows and every
    accepted node's latents must be copied into place; the KV of the committed tokens must equal page
    size 1's (same computation, other slots) and AR decoding's."""
    from ddtree.models.checkpoint.loader import load_target

    model = load_target(default_ckpt.target).eval()
    V = model.config.vocab_size
    prompt = [(11 * i) % 500 + 30 for i in range(21)]
    ar_seq, ar_pool, _ = _decode(model, 1, prompt, lambda s: TokenTree(), 46)
    truth = ar_seq.committed[len(prompt) :] + [ar_seq.root]  # the greedy continuation
    rng = random.Random(0)

    def trees(seq):
        i = seq.context_len - len(prompt)  # seq.root == truth[i]
        right = truth[i + 1 : i + 1 + rng.randint(0, 4)]
        w = (truth[i + 1] + 1) % V
        tokens, parents, depths = [w, (w + 1) % V], [0, 1], [1, 2]  # a wrong branch first
        for d, tok in enumerate(right, start=1):
            tokens.append(tok)
            parents.append(0 if d == 1 else len(tokens) - 1)
            depths.append(d)
        return TokenTree(tuple(tokens), tuple(parents), tuple(depths))

    runs = {}
    for page_size in PAGE_SIZES:
        rng.seed(0)
        runs[page_size] = _decode(model, page_size, prompt, trees, 9)
    seq1, pool1, acc1 = runs[1]
    assert any(len(a) > 1 and a[1] != 1 for a in acc1), "no off-chain acceptance: nothing to copy"
    n = seq1.context_len
    assert seq1.committed == ar_seq.committed[:n], "tree verify must commit the greedy tokens"
    kv1 = pool1.cache[:, seq1.slots]
    assert torch.allclose(kv1, ar_pool.cache[:, ar_seq.slots[:n]], atol=1e-4, rtol=1e-4)
    for page_size in PAGE_SIZES[1:]:
        seq, pool, acc = runs[page_size]
        assert acc == acc1 and seq.committed == seq1.committed
        assert torch.equal(pool.cache[:, seq.slots], kv1), f"page size {page_size}: KV differs from page size 1"
        assert pool.num_used_pages == -(-n // page_size)


# ---- end to end: the verifier service with --page-size 4 and 16 ----

PAGED = [4, 16]


@pytest.fixture(scope="module")
def paged_verifiers(default_ckpt, tmp_path_factory):
    """One oracle drafter (the oracle_stack's seed) and a verifier per page size, debug checks on."""
    from ddtree.launcher import start_service
    from tests.support.paths import ORACLE_DRAFTER

    log_dir = tmp_path_factory.mktemp("logs-paged")
    procs = [
        start_service(
            "drafter",
            [
                "drafter",
                "--model",
                str(default_ckpt.drafter),
                "--target",
                str(default_ckpt.target),
                "--oracle-seed",
                "7",
                "--port",
                "0",
                "--threads",
                "1",
            ],
            log_dir,
            module=ORACLE_DRAFTER,
        )
    ]
    try:
        for P in PAGED:
            procs.append(
                start_service(
                    f"verifier-p{P}",
                    [
                        "verifier",
                        "--model",
                        str(default_ckpt.target),
                        "--drafter",
                        procs[0].address,
                        "--port",
                        "0",
                        "--threads",
                        "1",
                        "--page-size",
                        str(P),
                        "--debug-checks",
                        "true",
                        "--max-batch",
                        "8",
                        "--kv-tokens",
                        "8192",
                        "--max-context",
                        "2048",
                        "--prefill-chunk",
                        "64",
                    ],
                    log_dir,
                )
            )
        yield {P: p for P, p in zip(PAGED, procs[1:])}
    finally:
        for p in reversed(procs):
            p.stop()


def _generate(address: str, ids: list[int], request_id: str, budget: int, max_new: int = 24):
    from ddtree.protocol.ddtree.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

    req = verifier_pb2.GenerateRequest(
        request_id=request_id,
        input_ids=ids,
        max_new_tokens=max_new,
        ignore_eos=True,
        spec=common_pb2.SpecOptions(no_spec=budget == 0, budget=budget),
    )
    with grpc.insecure_channel(address) as ch:
        msgs = list(verifier_pb2_grpc.VerifierStub(ch).Generate(req, timeout=300))
    return [t for m in msgs for t in m.token_ids], [s.accept_length for m in msgs for s in m.steps]


def _run(address: str, prompts: list[list[int]], budget: int, tag: str):
    with cf.ThreadPoolExecutor(4) as ex:
        return list(ex.map(lambda ip: _generate(address, ip[1], f"{tag}-{budget}-{ip[0]}", budget), enumerate(prompts)))


PROMPTS = [[(37 * i + 11 * k) % 3000 + 50 for i in range(n)] for k, n in enumerate([1, 5, 16, 17, 63, 130])]


@pytest.mark.slow
def test_paged_verifier_matches_page_size_one_and_ar(oracle_stack, paged_verifiers):
    """Same request ids on the page-size-1 stack and on each paged verifier: the oracle drafts the same
    trees, so tokens and accept lengths must be identical, and equal to AR."""
    ar = [tokens for tokens, _ in _run(oracle_stack.verifier, PROMPTS, 0, "ar")]
    for budget in (8, 32):
        ref = _run(oracle_stack.verifier, PROMPTS, budget, "pg")
        assert [tokens for tokens, _ in ref] == ar, "page size 1 DDTree differs from AR"
        assert max(n for _, accepts in ref for n in accepts) >= 4, "too little acceptance to test commits"
        for P, proc in paged_verifiers.items():
            got = _run(proc.address, PROMPTS, budget, "pg")
            assert got == ref, f"page size {P}, budget {budget}: tokens or accept lengths differ from page size 1"
    for P, proc in paged_verifiers.items():
        assert [tokens for tokens, _ in _run(proc.address, PROMPTS, 0, "ar")] == ar, f"page size {P}: AR differs"
        assert "step_failed" not in proc.log_path.read_text()


@pytest.mark.slow
def test_paged_prefix_hits_reuse_whole_pages(paged_verifiers):
    from ddtree.protocol.ddtree.v1 import verifier_pb2, verifier_pb2_grpc

    ids = [(37 * i) % 3000 + 50 for i in range(300)]
    for P, proc in paged_verifiers.items():
        first = _generate(proc.address, ids, "paged-reuse", 8, max_new=40)
        second = _generate(proc.address, ids, "paged-reuse", 8, max_new=40)
        assert second == first, f"page size {P}: tokens or acceptance changed with a prefix hit"
        assert f'"cached_tokens": {299 // P * P}' in proc.log_path.read_text(), "no whole-page prefix reuse"
        turn2 = ids + first[0][:30] + [61, 62, 63]  # a second chat turn: prompt + answer cached
        spec = _generate(proc.address, turn2, "paged-turn2", 8)
        assert f'"cached_tokens": {330 // P * P}' in proc.log_path.read_text(), "no reuse of prompt + answer"
        assert spec[0] == _generate(proc.address, turn2, "paged-turn2-ar", 0)[0]
        with grpc.insecure_channel(proc.address) as ch:
            info = verifier_pb2_grpc.VerifierStub(ch).GetInfo(verifier_pb2.VerifierInfoRequest(), timeout=30)
        assert info.running_requests == 0 and info.kv_used_tokens == 0, "KV held after every request finished"
        assert 0 < info.kv_cached_tokens and info.kv_cached_tokens % P == 0


@pytest.mark.slow
def test_paged_scheduler_returns_the_pool_to_empty(default_ckpt):
    """Mixed traffic on page size 4 (shared prefixes, aborts, AR and speculative requests), accounting
    checked after every step; then everything is free once the cache is evicted."""
    from ddtree.config import DrafterConfig, VerifierConfig
    from ddtree.contract.sampling_params import SamplingConfig
    from ddtree.drafter.server import serve_engine
    from ddtree.models.checkpoint.loader import load_target
    from ddtree.verifier.drafting.drafter_pool import DrafterPool
    from ddtree.verifier.engine import build_engine
    from ddtree.verifier.sequence import GenerateParams, Sequence
    from tests.support.oracle_engine import OracleDraftEngine

    dcfg = DrafterConfig(port=0, grace_s=0.0)
    model = load_target(default_ckpt.target).eval()
    oracle = OracleDraftEngine(load_target(default_ckpt.target).eval(), default_budget=dcfg.default_budget,
                               max_budget=dcfg.max_budget)  # fmt: skip
    drafter = serve_engine(oracle, dcfg)
    vcfg = VerifierConfig(kv_tokens=2048, page_size=4, max_batch=6, max_queue=100, prefill_chunk=32, debug_checks=True)
    engine = build_engine(vcfg, model=model, drafter=DrafterPool(f"127.0.0.1:{drafter.port}", 10))
    sched, pool = engine.scheduler, engine.pool
    engine.start()
    rng = random.Random(0)
    base = [(13 * j) % 2000 + 40 for j in range(90)]
    seqs = []
    try:
        for i in range(30):
            ids = base[: rng.randint(1, 90)] + [i + 7] * rng.randint(0, 9)
            seq = Sequence(
                GenerateParams(
                    f"r{i}",
                    tuple(ids),
                    SamplingConfig(temperature=0.0),
                    rng.randint(1, 20),
                    frozenset(),
                    i % 4 != 0,
                    0 if i % 4 == 0 else 8,
                ),
                page_size=pool.page_size,
            )
            sched.submit(seq)
            seqs.append(seq)
            if i % 5 == 4:
                sched.abort(f"r{i - 2}")
        for seq in seqs:
            event = None
            while event is None or not event.finish_reason:
                event = seq.events.get(timeout=120)
                assert not event.error, event.error
        assert sched.running_count == 0
        sched.check_accounting()
        assert sched.cache.cached_slots > 0 and pool.num_used == sched.cache.cached_slots
        sched.cache.evict(pool.num_slots)
        assert pool.num_free == pool.num_slots and pool.num_free_pages == pool.num_pages
    finally:
        sched.stop()
        drafter.stop(0)


@pytest.mark.parametrize("page_size", [1, 4])
def test_allocation_takes_the_lowest_free_pages(page_size):
    """Pages in use stay packed at the low end of the pool whatever the order of frees (the fragmentation
    fix: a LIFO free list scattered long contexts across the pool)."""
    pool = _pool(page_size=page_size, slots=16 * page_size)
    first = pool.alloc(6)
    assert first.tolist() == [0, 1, 2, 3, 4, 5]
    pool.free(torch.tensor([4, 1]))
    pool.free(torch.tensor([3]))
    assert pool.alloc(4).tolist() == [1, 3, 4, 6]
    pool.free(torch.arange(0, 7))
    assert pool.alloc(16).tolist() == list(range(16)) and pool.num_free == 0
    pool.check()

"""Drafting one group while verifying the other (draft_overlap.py): the policy, and the tokens it yields."""

from __future__ import annotations

import pytest
import torch

from ddtree.config import DrafterConfig, VerifierConfig
from ddtree.contract.sampling_params import SamplingConfig
from ddtree.drafter.factory import make_engine
from ddtree.drafter.server import serve_engine
from ddtree.models.loader import load_target
from ddtree.verifier.draft_overlap import overlapping, split_drafts
from ddtree.verifier.drafter_pool import DrafterPool
from ddtree.verifier.kv_pool import LatentKVPool
from ddtree.verifier.scheduler import Scheduler
from ddtree.verifier.sequence import GenerateParams, Sequence


def _split(needing, with_tree):
    waited = {rid: float(i) for i, rid in enumerate(needing)}  # listed from the longest-waiting
    return split_drafts(list(reversed(needing)), with_tree, waited)


def test_nothing_drafted_yet_drafts_half():
    now, wait = _split(["a", "b", "c", "d", "e", "f", "g", "h"], 0)
    assert now == ["a", "b", "c", "d"] and wait == ["e", "f", "g", "h"]
    now, wait = _split(["a", "b", "c"], 0)
    assert now == ["a", "b"] and wait == ["c"]
    assert _split(["a"], 0) == (["a"], [])


def test_balanced_groups_swap():
    assert _split(["a", "b", "c", "d"], 4) == (["a", "b", "c", "d"], [])


def test_unbalanced_groups_even_out():
    # 3 hold trees, 5 need one: draft 4 (half of 8), the newest waits; next step 4 and 4.
    now, wait = _split(["a", "b", "c", "d", "e"], 3)
    assert now == ["a", "b", "c", "d"] and wait == ["e"]
    # A large verify group lets every waiting sequence draft (no one idles behind a small group).
    assert _split(["a", "b"], 6) == (["a", "b"], [])


def test_overlapping_threshold():
    assert not overlapping(8, 0)
    assert not overlapping(3, 4)
    assert overlapping(4, 4)


@pytest.fixture(scope="module")
def demo(default_ckpt):
    # The oracle drafter (the target's own continuation with noise): the random default pair accepts
    # nothing, the oracle accepts several tokens per step, so overlapped trees are really used.
    dcfg = DrafterConfig(port=0, grace_s=0.0, engine="oracle", oracle_seed=7)
    engine = make_engine(dcfg, str(default_ckpt.drafter), str(default_ckpt.target))
    server = serve_engine(engine, dcfg)
    model = load_target(default_ckpt.target).eval()
    yield model, f"127.0.0.1:{server.port}", engine
    server.stop(0)


def _generate(model, drafter_address, prompts, tokens, **config) -> tuple[list[list[int]], Scheduler]:
    vcfg = VerifierConfig(kv_tokens=4000, max_batch=8, prefill_chunk=64, debug_checks=True, max_context=1024, **config)
    pool = LatentKVPool(
        model.config.num_hidden_layers, vcfg.kv_tokens, model.config.kv_cache_width, torch.float32, "cpu"
    )
    drafter = DrafterPool(drafter_address, 30) if drafter_address else None
    sched = Scheduler(model, pool, vcfg, drafter)
    sched.start()
    try:
        seqs = [
            Sequence(
                GenerateParams(
                    f"{'ov' if drafter else 'ar'}-{i}",
                    tuple(p),
                    SamplingConfig(temperature=0.0),
                    tokens,
                    frozenset(),
                    True,
                    12 if drafter else 0,
                )
            )
            for i, p in enumerate(prompts)
        ]
        for seq in seqs:
            sched.submit(seq)
        for seq in seqs:
            while not seq.events.get(timeout=300).finish_reason:
                pass
            assert seq.finish_reason == "length", seq.finish_reason
        return [s.generated for s in seqs], sched
    finally:
        sched.stop()
        if drafter is not None:
            drafter.close()


def test_overlapped_drafting_yields_the_autoregressive_tokens(demo):
    model, address, engine = demo
    prompts = [[(13 * i + 7 * j) % 3000 + 20 for j in range(10 + 17 * i)] for i in range(5)]
    want, _ = _generate(model, None, prompts, 40)
    got, sched = _generate(model, address, prompts, 40, overlap_draft_min_batch=2, max_tree_tokens=40)
    assert got == want
    assert sched.drafted_ahead > 0, "no draft overlapped a verify"
    assert sched.total_tokens > sched.total_steps, "the drafts were never accepted"
    assert sched.pool.num_used == sched.kv_cached  # every sequence's KV went back (or to the prefix cache)

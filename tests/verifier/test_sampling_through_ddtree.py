"""Exact sampling: at temperature 1 the tokens produced through DDTree steps follow the target's own
distribution (chi-square against probabilities computed by plain forwards), with fixed seeds.

In-process verifier engine + a real gRPC drafter (the oracle engine, on port 0) + the tiny target of
tests/support/tiny_target.py (the `tiny_target` fixture): an 8-token vocabulary whose logits are sharpened
so that drafted tokens are often accepted: the second and third tokens then come from the
sample-at-every-node walk, not only from root samples.
"""

from __future__ import annotations

import pytest
import torch

from ddtree.config import VerifierConfig
from ddtree.contract.sampling_params import SamplingConfig
from ddtree.verifier.sampling.sampling import sampling_probs
from ddtree.verifier.sequence import GenerateParams, Sequence
from tests.support.engines import engine_with_drafter
from tests.support.oracle_engine import OracleDraftEngine
from tests.support.tiny_target import PROMPT, VOCAB, chi2_pvalue, last_logits

SAMPLES = 1500


def _probs(model, ids, cfg: SamplingConfig) -> torch.Tensor:
    return sampling_probs(last_logits(model, ids), cfg)[0].double()


def _expected(model, cfg):
    """Exact joint law of the first three generated tokens: P(a) P(b|a) P(c|a,b)."""
    p1 = _probs(model, PROMPT, cfg)
    joint = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    for a in range(VOCAB):
        if p1[a] == 0:
            continue
        p2 = _probs(model, PROMPT + (a,), cfg)
        for b in range(VOCAB):
            if p2[b] == 0:
                continue
            joint[a, b] = p1[a] * p2[b] * _probs(model, PROMPT + (a, b), cfg)
    return joint


def _sample_through_ddtree(model, cfg: SamplingConfig):
    oracle = OracleDraftEngine(model, depth=4, default_budget=12, max_budget=64, seed=11)
    vcfg = VerifierConfig(max_batch=64, max_queue=SAMPLES, kv_tokens=64 * 40, prefill_chunk=64)
    with engine_with_drafter(model, vcfg, oracle) as engine:
        sched, pool = engine.scheduler, engine.pool
        sched.start()
        seqs = []
        for seed in range(SAMPLES):
            sampling = SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, seed=seed)
            seq = Sequence(GenerateParams(f"s{seed}", PROMPT, sampling, 3, frozenset(), True, 12))
            sched.submit(seq)
            seqs.append(seq)
        for seq in seqs:
            while True:
                if seq.events.get(timeout=120).finish_reason:
                    break
        sched.check_accounting()  # free + held + prefix-cached == total
        sched.cache.evict(pool.num_slots)  # no request pins anything now
        assert pool.num_free == pool.num_slots, "KV slots leaked"
    return seqs


@pytest.mark.parametrize(
    "cfg",
    [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=3, top_p=0.9)],
    ids=["t1", "t0.7-topk3-topp0.9"],
)
def test_ddtree_samples_follow_the_target_distribution(tiny_target, cfg):
    joint = _expected(tiny_target, cfg)
    seqs = _sample_through_ddtree(tiny_target, cfg)
    counts = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    multi = 0
    for seq in seqs:
        a, b, c = seq.generated
        counts[a, b, c] += 1
        multi += seq.accept_lengths[0] >= 2
    # The walk must really be exercised: many first steps commit 2+ tokens in one verify.
    assert multi > SAMPLES * 0.2, f"only {multi} of {SAMPLES} first steps accepted a drafted token"
    p_b = chi2_pvalue(counts.sum((0, 2)), joint.sum((0, 2)))
    p_c = chi2_pvalue(counts.sum((0, 1)), joint.sum((0, 1)))
    p_bc = chi2_pvalue(counts.sum(0).flatten(), joint.sum(0).flatten())
    assert min(p_b, p_c, p_bc) > 1e-3, f"p-values {p_b:.2e} {p_c:.2e} {p_bc:.2e}"


def test_the_chi_square_check_detects_greedy_bias(tiny_target):
    """Sanity of the method: always taking the drafted (greedy) token would fail the test."""
    joint = _expected(tiny_target, SamplingConfig(temperature=1.0))
    greedy = torch.zeros(VOCAB, dtype=torch.float64)
    greedy[int(joint.sum((0, 2)).argmax())] = SAMPLES
    assert chi2_pvalue(greedy, joint.sum((0, 2))) < 1e-6

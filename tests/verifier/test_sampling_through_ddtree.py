"""Exact sampling: at temperature 1 the tokens produced through DDTree steps follow the target's own
distribution (chi-square against probabilities computed by plain forwards), with fixed seeds.

In-process scheduler + a real gRPC drafter (the oracle engine, on port 0) + a tiny target with an
8-token vocabulary whose logits are sharpened so that drafted tokens are often accepted: the second
and third tokens then come from the sample-at-every-node walk, not only from root samples.
"""

from __future__ import annotations

import pytest
import torch

from ddtree.config import DrafterConfig, VerifierConfig
from ddtree.contract.sampling_params import SamplingConfig
from ddtree.drafter.server import serve_engine
from ddtree.models.attention import AttentionMetadata, SeqAttention
from ddtree.models.loader import load_target
from ddtree.models.random_checkpoint import DEFAULT_TARGET_CONFIG, write_random_target
from ddtree.verifier.drafter_client import DrafterClient
from ddtree.verifier.kv_pool import LatentKVPool
from ddtree.verifier.sampling import sampling_probs
from ddtree.verifier.scheduler import Scheduler
from ddtree.verifier.sequence import GenerateParams, Sequence
from ddtree.verifier.target import LocalTarget
from tests.support.oracle_engine import OracleDraftEngine

VOCAB = 8
PROMPT = (1, 5, 2)
SAMPLES = 1500


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    cfg = {
        **DEFAULT_TARGET_CONFIG,
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    path = write_random_target(tmp_path_factory.mktemp("tiny"), cfg, seed=3)
    model = load_target(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)  # sharpen: top token ~0.5-0.8, far from uniform and from greedy
    return model


def _probs(model, ids, cfg: SamplingConfig) -> torch.Tensor:
    n = len(ids)
    cache = model.new_kv_cache(n)
    meta = AttentionMetadata(seqs=(SeqAttention(0, n, torch.empty(0, dtype=torch.int64), torch.arange(n), None),))
    with torch.inference_mode():
        out = model.forward(torch.tensor(ids), torch.arange(n), meta, cache, logits_rows=torch.tensor([n - 1]))
    return sampling_probs(out.logits, cfg)[0].double()


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


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square; cells with expected count < 5 are pooled into one."""
    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    ex = torch.cat([exp[big], exp[~big].sum().reshape(1)])
    keep = ex > 0
    obs, ex = obs[keep], ex[keep]
    stat = ((obs - ex) ** 2 / ex).sum()
    dof = obs.numel() - 1
    assert ((counts > 0) & (probs == 0)).sum() == 0, "a token with probability 0 was sampled"
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def _sample_through_ddtree(model, cfg: SamplingConfig):
    engine = OracleDraftEngine(model, depth=4, default_budget=12, max_budget=64, seed=11)
    drafter = serve_engine(engine, DrafterConfig(port=0, grace_s=0.0))
    client = DrafterClient(f"127.0.0.1:{drafter.port}", timeout_s=30)
    vcfg = VerifierConfig(max_batch=64, max_queue=SAMPLES, kv_tokens=64 * 40, prefill_chunk=64)
    pool = LatentKVPool(
        model.config.num_hidden_layers, vcfg.kv_tokens, model.config.kv_cache_width, torch.float32, "cpu"
    )
    sched = Scheduler(LocalTarget(model), pool, vcfg, client)
    sched.start()
    try:
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
    finally:
        sched.stop()
        drafter.stop(0)
        client.close()
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
    p_b = _chi2_pvalue(counts.sum((0, 2)), joint.sum((0, 2)))
    p_c = _chi2_pvalue(counts.sum((0, 1)), joint.sum((0, 1)))
    p_bc = _chi2_pvalue(counts.sum(0).flatten(), joint.sum(0).flatten())
    assert min(p_b, p_c, p_bc) > 1e-3, f"p-values {p_b:.2e} {p_c:.2e} {p_bc:.2e}"


def test_the_chi_square_check_detects_greedy_bias(tiny_target):
    """Sanity of the method: always taking the drafted (greedy) token would fail the test."""
    joint = _expected(tiny_target, SamplingConfig(temperature=1.0))
    greedy = torch.zeros(VOCAB, dtype=torch.float64)
    greedy[int(joint.sum((0, 2)).argmax())] = SAMPLES
    assert _chi2_pvalue(greedy, joint.sum((0, 2))) < 1e-6

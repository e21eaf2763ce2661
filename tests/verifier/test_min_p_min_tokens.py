"""min_p and min_tokens in the verifier's sampler: exact through DDTree.

- min_p against a brute-force filter (the one vLLM applies: p >= min_p * max p, after temperature,
  before top_k / top_p).
- min_tokens masks the request's stop ids in the rows whose choice is an output token before
  min_tokens, by depth: greedy DDTree output equals masked greedy AR decoding computed by plain
  forwards, and at temperature 1 (with min_p) the first three tokens follow the masked, filtered
  target distribution (chi-square), with the tree walk exercised.

In-process verifier engine + the oracle drafter (real gRPC) + the tiny sharpened target of
tests/support/tiny_target.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ddtree.config import VerifierConfig
from ddtree.contract.sampling_params import SamplingConfig
from ddtree.verifier.sampling.sampling import mask_stop_tokens, sampling_probs, stop_mask_rows, target_choices
from ddtree.verifier.sequence import GenerateParams, Sequence
from tests.support.engines import engine_with_drafter
from tests.support.oracle_engine import OracleDraftEngine
from tests.support.tiny_target import PROMPT, VOCAB, chi2_pvalue, masked_probs

SAMPLES = 1000


def test_min_p_matches_brute_force():
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    for t, min_p, top_k, top_p in [(1.0, 0.1, 0, 1.0), (0.7, 0.3, 5, 0.9), (1.5, 0.05, 0, 0.5), (1.0, 1.0, 0, 1.0)]:
        probs = sampling_probs(logits, SamplingConfig(temperature=t, min_p=min_p, top_k=top_k, top_p=top_p))
        for row in range(logits.shape[0]):
            p = torch.softmax(logits[row].double() / t, -1)
            keep = p >= min_p * p.max() - 1e-12  # min_p first (vLLM's order) ...
            if top_k:
                keep &= p >= p[keep].topk(min(top_k, int(keep.sum()))).values[-1]
            q = torch.where(keep, p, 0)
            q = q / q.sum()
            if top_p < 1:  # ... then top_p on what is left
                order = q.argsort(descending=True)
                before = q[order].cumsum(0) - q[order]
                keep_p = torch.zeros_like(keep)
                keep_p[order] = before < top_p
                q = torch.where(keep_p, q, 0)
                q = q / q.sum()
            assert torch.allclose(probs[row].double(), q, atol=1e-6), (t, min_p, top_k, top_p, row)
    # min_p never changes the argmax, and min_p 1 keeps only the most likely token.
    one = sampling_probs(logits, SamplingConfig(temperature=1.0, min_p=1.0))
    assert torch.equal(one.argmax(-1), logits.argmax(-1)) and torch.all(one.max(-1).values == 1.0)
    with pytest.raises(ValueError, match="min_p must be in"):
        SamplingConfig(min_p=1.5).validate()
    with pytest.raises(ValueError, match="min_tokens must be"):
        SamplingConfig(min_tokens=-1).validate()


def test_stop_mask_rows_by_depth():
    # generated = 2 tokens so far, min_tokens 4: rows at depth 0 and 1 choose output tokens 2 and 3.
    assert stop_mask_rows(4, 2, (0, 1, 1, 2, 3)) == [0, 1, 2]
    assert stop_mask_rows(2, 2, (0, 1)) == []
    logits = torch.zeros(3, 6)
    logits[:, 4] = 5.0  # the stop id is everyone's argmax
    masked = mask_stop_tokens(logits, [0, 2], {4, 99})
    assert target_choices(masked, SamplingConfig()).tolist()[1] == 4  # row 1 is not masked
    assert masked[0, 4] == masked[2, 4] == float("-inf") and logits[0, 4] == 5.0  # the input is untouched


def _run(model, configs: list[SamplingConfig], stops: frozenset[int], max_new: int) -> list[Sequence]:
    oracle = OracleDraftEngine(model, depth=4, default_budget=12, max_budget=64, seed=11)
    vcfg = VerifierConfig(max_batch=64, max_queue=len(configs), kv_tokens=64 * 40, prefill_chunk=64)
    with engine_with_drafter(model, vcfg, oracle) as engine:
        engine.start()
        seqs = []
        for i, cfg in enumerate(configs):
            seq = Sequence(GenerateParams(f"s{i}", PROMPT, cfg, max_new, stops, True, 12))
            engine.scheduler.submit(seq)
            seqs.append(seq)
        for seq in seqs:
            while not seq.events.get(timeout=120).finish_reason:
                pass
    return seqs


def test_min_tokens_greedy_equals_masked_ar(tiny_target):
    model = tiny_target
    plain = SamplingConfig()
    # Greedy AR without min_tokens, for the stop id: the token greedy decoding emits second.
    ar = list(PROMPT)
    for _ in range(2):
        ar.append(int(masked_probs(model, ar, plain, frozenset(), 0).argmax()))
    stop = frozenset({ar[len(PROMPT) + 1]})
    cfg = SamplingConfig(min_tokens=6)
    ref, ids = [], list(PROMPT)
    for position in range(8):  # masked greedy AR: the stop id cannot come before 6 tokens
        tok = int(masked_probs(model, ids, cfg, stop, position).argmax())
        if tok in stop:
            break
        ref.append(tok)
        ids.append(tok)
    without, with_min = _run(model, [plain, cfg], stop, 8)
    assert without.finish_reason == "stop" and len(without.generated) == 1  # the stop id ends it at once
    assert with_min.generated == ref and len(ref) >= 6
    assert max(with_min.accept_lengths) >= 2  # drafted tokens were accepted: the tree path is exercised


def test_min_tokens_and_min_p_sampled_follow_the_masked_distribution(tiny_target):
    model = tiny_target
    cfg = SamplingConfig(temperature=1.0, min_p=0.05, min_tokens=3)
    p1 = masked_probs(model, PROMPT, cfg, frozenset(), 0)
    stop = frozenset({int(p1.argmax())})  # the most likely first token is a stop id
    joint = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    p1 = masked_probs(model, PROMPT, cfg, stop, 0)
    for a in range(VOCAB):
        if p1[a] == 0:
            continue
        p2 = masked_probs(model, PROMPT + (a,), cfg, stop, 1)
        for b in range(VOCAB):
            if p2[b] > 0:
                joint[a, b] = p1[a] * p2[b] * masked_probs(model, PROMPT + (a, b), cfg, stop, 2)
    seqs = _run(model, [dataclasses.replace(cfg, seed=s) for s in range(SAMPLES)], stop, 3)
    counts = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    for seq in seqs:
        assert len(seq.generated) == 3 and not stop & set(seq.generated)
        counts[tuple(seq.generated)] += 1
    assert sum(s.accept_lengths[0] >= 2 for s in seqs) > SAMPLES * 0.2  # the walk is exercised
    p_a = chi2_pvalue(counts.sum((1, 2)), joint.sum((1, 2)))
    p_bc = chi2_pvalue(counts.sum(0).flatten(), joint.sum(0).flatten())
    assert min(p_a, p_bc) > 1e-3, f"p-values {p_a:.2e} {p_bc:.2e}"

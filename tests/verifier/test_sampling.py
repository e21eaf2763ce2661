"""Target choices (services/verifier/sampling/sampling.py) and the exactness of sample-and-walk."""

from __future__ import annotations

import math

import pytest
import torch

from ddtree.contract.sampling_params import SamplingConfig
from ddtree.contract.token_tree import TokenTree
from ddtree.verifier.sampling.accept import accept
from ddtree.verifier.sampling.sampling import make_generator, sampling_probs, target_choices


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit over the categories with probs > 0.

    Samples in a zero-probability category give p = 0. p-value = Q(dof/2, stat/2), the regularized
    upper incomplete gamma function (torch.special.gammaincc)."""
    counts, probs = counts.double(), probs.double()
    if counts[probs == 0].sum() > 0:
        return 0.0
    support = probs > 0
    expected = probs[support] * counts.sum()
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize(
    "cfg, msg",
    [
        (SamplingConfig(temperature=-0.1), "temperature must be"),
        (SamplingConfig(temperature=float("nan")), "temperature must be"),
        (SamplingConfig(temperature=float("inf")), "temperature must be"),
        (SamplingConfig(top_p=0.0), "top_p must be in \\(0, 1\\]"),
        (SamplingConfig(top_p=1.5), "top_p must be in \\(0, 1\\]"),
        (SamplingConfig(top_p=float("nan")), "top_p must be in \\(0, 1\\]"),
        (SamplingConfig(top_k=-1), "top_k must be an integer >= 0"),
        (SamplingConfig(top_k=2.5), "top_k must be an integer >= 0"),
        (SamplingConfig(seed="x"), "seed must be"),
    ],
)
def test_validate(cfg: SamplingConfig, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        cfg.validate()
    with pytest.raises(ValueError, match=msg):
        target_choices(torch.zeros(2, 3), cfg)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(20, 50, generator=torch.Generator().manual_seed(0))
    for cfg in (SamplingConfig(), SamplingConfig(top_k=3, top_p=0.2)):
        assert torch.equal(target_choices(logits, cfg), logits.argmax(-1))
    with pytest.raises(ValueError, match="must be \\[N, V\\]"):
        target_choices(logits[0], SamplingConfig())


def brute_probs(row: list[float], t: float, top_k: int, top_p: float) -> list[float]:
    v = len(row)
    scores = [x / t for x in row]
    keep = set(range(v))
    if 0 < top_k < v:
        kth = sorted(scores, reverse=True)[top_k - 1]
        keep = {i for i in range(v) if scores[i] >= kth}
    z = sum(math.exp(scores[i]) for i in keep)
    p = [math.exp(scores[i]) / z if i in keep else 0.0 for i in range(v)]
    if top_p < 1:
        order = sorted(range(v), key=lambda i: -p[i])
        nucleus, mass = set(), 0.0
        for i in order:
            nucleus.add(i)
            mass += p[i]
            if mass >= top_p:
                break
        z = sum(p[i] for i in nucleus)
        p = [p[i] / z if i in nucleus else 0.0 for i in range(v)]
    return p


@pytest.mark.parametrize(
    "t, top_k, top_p",
    [
        (1.0, 0, 1.0),
        (0.7, 3, 1.0),
        (1.3, 0, 0.5),
        (1.0, 5, 0.8),
        (2.0, 1, 1.0),
        (1.0, 0, 0.01),
        (0.5, 100, 0.9),
    ],
)
def test_sampling_probs_vs_brute_force(t: float, top_k: int, top_p: float) -> None:
    logits = torch.randn(6, 17, generator=torch.Generator().manual_seed(1)) * 2
    cfg = SamplingConfig(temperature=t, top_k=top_k, top_p=top_p)
    probs = sampling_probs(logits, cfg)
    ref = torch.tensor([brute_probs(r, t, top_k, top_p) for r in logits.double().tolist()], dtype=torch.float64)
    torch.testing.assert_close(probs.double(), ref, atol=1e-6, rtol=0)
    assert torch.equal(probs > 0, ref > 0)
    if top_k:
        assert ((probs > 0).sum(-1) <= top_k).all()


def test_top_k_keeps_boundary_ties() -> None:
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0]])
    probs = sampling_probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert (probs[0] > 0).tolist() == [True, True, True, False]


def test_determinism_with_seed() -> None:
    logits = torch.randn(64, 30, generator=torch.Generator().manual_seed(2))
    cfg = SamplingConfig(temperature=1.0, seed=123)
    a = target_choices(logits, cfg, make_generator(cfg))
    b = target_choices(logits, cfg, make_generator(cfg))
    assert torch.equal(a, b)
    c = target_choices(logits, cfg, make_generator(SamplingConfig(temperature=1.0, seed=124)))
    assert not torch.equal(a, c)
    gen = make_generator(cfg)  # one generator per request: consecutive steps draw fresh samples
    assert not torch.equal(target_choices(logits, cfg, gen), target_choices(logits, cfg, gen))
    assert make_generator(SamplingConfig()) is None


@pytest.mark.parametrize("t, top_k, top_p", [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.0, 4, 1.0), (1.2, 0, 0.7)])
def test_chi_square_vs_softmax(t: float, top_k: int, top_p: float) -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.3, 0.0, -0.5, -1.0, -3.0])
    cfg = SamplingConfig(temperature=t, top_k=top_k, top_p=top_p, seed=7)
    n = 40_000
    draws = target_choices(logits.expand(n, -1), cfg, make_generator(cfg))  # independent per row
    counts = torch.bincount(draws, minlength=8)
    probs = torch.tensor(brute_probs(logits.tolist(), t, top_k, top_p))
    assert chi_square_pvalue(counts, probs) > 1e-3
    # the test has power: the untempered / unfiltered softmax is rejected
    unfiltered = (top_k, top_p) == (0, 1.0)
    wrong = torch.softmax(logits.double() * (0.9 / t if unfiltered else 1.0), -1)
    assert chi_square_pvalue(counts, wrong) < 1e-6


def test_sample_and_walk_is_exact() -> None:
    """Emitted tokens of one round follow the target's conditionals, whatever the draft tree."""
    vocab, rounds = 3, 30_000
    g = torch.Generator().manual_seed(0)
    table = {
        (): torch.randn(vocab, generator=g),
        (0,): torch.randn(vocab, generator=g),
        (1,): torch.randn(vocab, generator=g),
        (2,): torch.randn(vocab, generator=g),
    }
    # children of root: tokens 0 and 1 (not 2); node 1 (token 0) has child token 2
    tree = TokenTree(token_ids=(0, 1, 2), parents=(0, 0, 1), depths=(1, 1, 2))
    paths = [(), (0,), (1,), (0, 2)]
    table[(0, 2)] = torch.randn(vocab, generator=g)
    node_logits = torch.stack([table[p] for p in paths])  # [n+1, V]
    cfg = SamplingConfig(temperature=1.0, seed=3)
    draws = target_choices(node_logits.repeat(rounds, 1), cfg, make_generator(cfg)).view(rounds, -1)
    first, second = [], {0: [], 1: []}
    for row in draws.tolist():
        v = accept(tree, 9, row)
        emitted = v.accepted_tokens[1:] + (v.next_root,)
        first.append(emitted[0])
        if len(emitted) > 1:
            second[emitted[0]].append(emitted[1])
    p_first = torch.softmax(table[()].double(), -1)
    assert chi_square_pvalue(torch.bincount(torch.tensor(first), minlength=vocab), p_first) > 1e-3
    for tok in (0, 1):  # given x1 = tok was accepted, x2 ~ p(. | tok)
        p = torch.softmax(table[(tok,)].double(), -1)
        assert chi_square_pvalue(torch.bincount(torch.tensor(second[tok]), minlength=vocab), p) > 1e-3

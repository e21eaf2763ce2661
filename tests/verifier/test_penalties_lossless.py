"""Penalties and logit masks on DDTree trees are lossless (services/verifier/constraints/penalties.py).

How equivalence is shown, against a reference written here independently of the verifier's code (vLLM's
formulas applied to one row at a time, in float64, with a Counter of the tokens before it):
- per row: on random trees, every row's adjusted logits equal the reference applied to that row's own
  context (output + its path), for each parameter alone and all together;
- greedy: 20 prompts x 3 settings, DDTree output == the reference's penalised greedy AR decoding (plain
  forwards over the whole context, no cache) == the engine's own AR decoding (no drafter), token for token.
  The drafter is the oracle drafter made to propose the *penalised* continuation (with the oracle's noise:
  broken chains, the right token as a later sibling, wrong siblings), so long paths are accepted and the
  path part of the counts decides the choices;
- sampled: at temperature 1 the first three tokens of 1000 seeded requests follow the exact penalised
  joint law (chi-square), computed by plain forwards and the reference; the second and third tokens mostly
  come from tree rows below the root (the walk), where the path counts apply.

In-process verifier engine + the oracle drafter over real gRPC + the tiny target of tests/support/tiny_target.py.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import random
import types

import grpc
import pytest
import torch

from ddtree.config import VerifierConfig
from ddtree.contract.sampling_params import SamplingConfig
from ddtree.contract.token_tree import TokenTree
from ddtree.protocol.ddtree.v1 import common_pb2, verifier_pb2
from ddtree.verifier.constraints.penalties import PenaltyCounts, adjust_logits
from ddtree.verifier.rpc.server import VerifierServicer
from ddtree.verifier.sequence import GenerateParams, Sequence
from tests.support.engines import engine_with_drafter
from tests.support.oracle_engine import OracleDraftEngine
from tests.support.tiny_target import VOCAB, chi2_pvalue, last_logits

PROMPT_LEN = 4
PROMPTS = [tuple(random.Random(i).choices(range(VOCAB), k=PROMPT_LEN)) for i in range(20)]
MAX_NEW = 12
SETTINGS = {
    "repetition-1.3": SamplingConfig(repetition_penalty=1.3),
    "presence-0.8-frequency-0.5": SamplingConfig(presence_penalty=0.8, frequency_penalty=0.5),
    "bias-bad-words-allowed": SamplingConfig(
        logit_bias=((3, 2.5), (6, -1.5)), bad_words=((2, 4), (5, 5, 0), (7,)), allowed_token_ids=tuple(range(7))
    ),
}
SAMPLES = 1000


def reference_row(logits: torch.Tensor, cfg: SamplingConfig, prompt, output) -> torch.Tensor:
    """vLLM's order and formulas for one row, float64: allowed_token_ids, bad_words (output only), logit_bias,
    repetition_penalty (prompt or output), frequency_penalty and presence_penalty (output)."""
    x = logits.double().clone()
    counts = collections.Counter(output)
    if cfg.allowed_token_ids:
        for v in range(x.numel()):
            if v not in cfg.allowed_token_ids:
                x[v] = -math.inf
    for word in cfg.bad_words:
        if len(word) > len(output) + 1:
            continue
        prefix = list(word[:-1])
        if not prefix or list(output[len(output) - len(prefix) :]) == prefix:
            x[word[-1]] = -math.inf
    for token, bias in cfg.logit_bias:
        x[token] += bias
    for v in range(x.numel()):
        if counts[v] or v in prompt:
            x[v] = x[v] / cfg.repetition_penalty if x[v] > 0 else x[v] * cfg.repetition_penalty
        x[v] -= cfg.frequency_penalty * counts[v] + cfg.presence_penalty * (counts[v] > 0)
    return x


def _random_tree(rng: random.Random, n: int, vocab: int) -> TokenTree:
    tokens, parents, depths, children = [], [], [], collections.defaultdict(set)
    for i in range(1, n + 1):
        parent = rng.choice([j for j in range(i) if len(children[j]) < vocab])
        free = [t for t in range(vocab) if t not in children[parent]]
        tok = rng.choice(free)
        children[parent].add(tok)
        tokens.append(tok)
        parents.append(parent)
        depths.append(0 if parent == 0 else depths[parent - 1])
        depths[-1] += 1
    return TokenTree(tuple(tokens), tuple(parents), tuple(depths))


def _path(tree: TokenTree, node: int) -> list[int]:
    out = []
    while node:
        out.append(tree.token_ids[node - 1])
        node = tree.parents[node - 1]
    return out[::-1]


@pytest.mark.parametrize(
    "cfg",
    [
        *SETTINGS.values(),
        SamplingConfig(repetition_penalty=0.7, presence_penalty=-0.4, frequency_penalty=1.1),
        SamplingConfig(
            repetition_penalty=1.5,
            presence_penalty=0.3,
            frequency_penalty=0.2,
            logit_bias=((0, 100.0), (9, -100.0)),
            allowed_token_ids=(0, 2, 3, 5, 9, 11),
            bad_words=((3, 3), (1, 2, 5), (11,)),
        ),
    ],
)
def test_every_tree_row_equals_the_reference_on_its_own_context(cfg):
    rng = random.Random(5)
    vocab = 12
    for trial in range(30):
        prompt = tuple(rng.choices(range(vocab), k=5))
        generated = rng.choices(range(4), k=rng.randrange(0, 6))  # few distinct tokens: repeats on paths
        tree = _random_tree(rng, rng.randrange(0, 25), 4) if trial % 5 else None
        rows = 1 + (tree.n if tree is not None else 0)
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(trial)) * 3
        counts = PenaltyCounts(cfg, prompt)
        half = len(generated) // 2  # built from the first half, then counted incrementally (apply.py's way)
        counts.tensors(generated[:half], logits.device, vocab)
        counts.add(generated[half:])
        got = adjust_logits(logits, cfg, counts, generated, tree)
        for r in range(rows):
            path = _path(tree, r) if tree is not None else []
            want = reference_row(logits[r], cfg, prompt, generated + path)
            assert torch.equal(torch.isneginf(got[r]), torch.isneginf(want)), (trial, r)
            finite = torch.isfinite(want)
            assert torch.allclose(got[r].double()[finite], want[finite], rtol=1e-6, atol=1e-5), (trial, r)


def _penalised_logits(model, prompt, output, cfg) -> torch.Tensor:
    return reference_row(last_logits(model, list(prompt) + list(output))[0], cfg, prompt, output)


class PenalisedOracle(OracleDraftEngine):
    """The oracle drafter proposing the penalised greedy continuation (the reference's)."""

    def __init__(self, model, cfg: SamplingConfig, **kw):
        super().__init__(model, **kw)
        self.cfg = cfg

    @torch.inference_mode()
    def _greedy(self, context: list[int], steps: int) -> list[int]:
        prompt, output = tuple(context[:PROMPT_LEN]), list(context[PROMPT_LEN:])
        out = []
        for _ in range(steps):
            tok = int(_penalised_logits(self.target, prompt, output + out, self.cfg).argmax())
            out.append(tok)
        return out


def _run(model, cfg: SamplingConfig, params: list[GenerateParams], last_events: list | None = None) -> list[Sequence]:
    """The sequences run to their end (each one's last event appended to last_events when given)."""
    oracle = PenalisedOracle(model, cfg, depth=4, default_budget=12, max_budget=64, seed=11)
    vcfg = VerifierConfig(max_batch=64, max_queue=len(params), kv_tokens=64 * 40, prefill_chunk=64)
    with engine_with_drafter(model, vcfg, oracle) as engine:
        engine.start()
        seqs = [Sequence(p) for p in params]
        for seq in seqs:
            engine.scheduler.submit(seq)
        for seq in seqs:
            while not (event := seq.events.get(timeout=300)).finish_reason:
                pass
            if last_events is not None:
                last_events.append(event)
    return seqs


@pytest.mark.parametrize("name", list(SETTINGS))
def test_greedy_ddtree_equals_penalised_ar(tiny_target, name):
    model, cfg = tiny_target, SETTINGS[name]
    reference, changed = [], 0
    for prompt in PROMPTS:
        out: list[int] = []
        for _ in range(MAX_NEW):
            out.append(int(_penalised_logits(model, prompt, out, cfg).argmax()))
            changed += out[-1] != int(last_logits(model, list(prompt) + out[:-1])[0].argmax())
        reference.append(out)
    assert changed >= 5  # the setting changes greedy choices (of 240)
    params = [GenerateParams(f"s{i}", p, cfg, MAX_NEW, frozenset(), True, 12) for i, p in enumerate(PROMPTS)]
    ar_params = [dataclasses.replace(p, request_id=f"ar{i}", use_spec=False, budget=0) for i, p in enumerate(params)]
    seqs = _run(model, cfg, params + ar_params)
    ddtree, ar = seqs[: len(PROMPTS)], seqs[len(PROMPTS) :]
    for i, (seq, ar_seq) in enumerate(zip(ddtree, ar, strict=True)):
        assert seq.generated == reference[i], f"prompt {i}: DDTree differs from penalised AR"
        assert ar_seq.generated == reference[i], f"prompt {i}: the engine's AR differs from the reference"
    lengths = [n for seq in ddtree for n in seq.accept_lengths]
    assert max(lengths) >= 4 and sum(n >= 3 for n in lengths) > len(lengths) // 4  # paths decide choices


def test_sampled_tokens_follow_the_penalised_distribution(tiny_target):
    model = tiny_target
    prompt = PROMPTS[0]
    cfg = SamplingConfig(
        temperature=1.0,
        repetition_penalty=1.3,
        presence_penalty=0.8,
        frequency_penalty=0.5,
        logit_bias=((4, 1.0),),
        bad_words=((2, 2), (6, 3, 0)),
    )

    def probs(output):
        return torch.softmax(_penalised_logits(model, prompt, output, cfg), -1)

    joint = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    p1 = probs([])
    for a in range(VOCAB):
        p2 = probs([a])
        for b in range(VOCAB):
            joint[a, b] = p1[a] * p2[b] * probs([a, b])
    params = [
        GenerateParams(f"s{s}", prompt, dataclasses.replace(cfg, seed=s), 3, frozenset(), True, 12)
        for s in range(SAMPLES)
    ]
    seqs = _run(model, dataclasses.replace(cfg, temperature=0.0), params)
    counts = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    for seq in seqs:
        assert len(seq.generated) == 3
        counts[tuple(seq.generated)] += 1
    assert sum(s.accept_lengths[0] >= 2 for s in seqs) > SAMPLES * 0.3  # the walk below the root is exercised
    p_a = chi2_pvalue(counts.sum((1, 2)), joint.sum((1, 2)))
    p_bc = chi2_pvalue(counts.sum(0).flatten(), joint.sum(0).flatten())
    p_abc = chi2_pvalue(counts.flatten(), joint.flatten())
    assert min(p_a, p_bc, p_abc) > 1e-3, f"p-values {p_a:.2e} {p_bc:.2e} {p_abc:.2e}"


def _servicer(vocab: int) -> VerifierServicer:
    """The servicer's request validation alone (no scheduler is reached but for its drafter)."""
    servicer = VerifierServicer.__new__(VerifierServicer)
    servicer.config = VerifierConfig()
    servicer.vocab_size = vocab
    servicer.eos_token_ids = (1,)
    servicer.scheduler = types.SimpleNamespace(drafter=None)
    return servicer


@pytest.mark.parametrize(
    "sampling, fragment",
    [
        (dict(repetition_penalty=-1.0), "repetition_penalty must be a finite number > 0"),
        (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
        (dict(frequency_penalty=float("nan")), "must be numbers, got NaN"),
        (dict(logit_bias={8: 1.0}), "logit_bias has a token id outside [0, 8): 8"),
        (dict(logit_bias={3: -101.0}), "logit_bias values must be in [-100, 100]"),
        (dict(allowed_token_ids=[2, -1]), "allowed_token_ids has a token id outside [0, 8): -1"),
        (dict(bad_words=[common_pb2.TokenIds(ids=[2, 9])]), "bad_words has a token id outside [0, 8): 9"),
        (dict(bad_words=[common_pb2.TokenIds()]), "bad_words entries must be non-empty"),
    ],
)
def test_the_verifier_refuses_bad_penalties(sampling, fragment):
    req = verifier_pb2.GenerateRequest(
        input_ids=[1, 2], max_new_tokens=4, sampling=common_pb2.SamplingParams(**sampling)
    )
    with pytest.raises(ValueError) as err:
        _servicer(VOCAB)._params(req)
    assert fragment in str(err.value)


def test_the_verifier_reads_penalties():
    sampling = common_pb2.SamplingParams(
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        logit_bias={6: -2.0, 3: 1.5},
        allowed_token_ids=[4, 2, 4],
        bad_words=[common_pb2.TokenIds(ids=[2, 5]), common_pb2.TokenIds(ids=[7])],
    )
    cfg = (
        _servicer(VOCAB)
        ._params(verifier_pb2.GenerateRequest(input_ids=[1], max_new_tokens=4, sampling=sampling))
        .sampling
    )
    assert (round(cfg.repetition_penalty, 6), cfg.presence_penalty, cfg.frequency_penalty) == (1.3, 0.5, -0.25)
    assert cfg.logit_bias == ((3, 1.5), (6, -2.0)) and cfg.allowed_token_ids == (2, 4)
    assert cfg.bad_words == ((2, 5), (7,)) and cfg.adjusts_logits
    plain = _servicer(VOCAB)._params(verifier_pb2.GenerateRequest(input_ids=[1], max_new_tokens=4)).sampling
    assert plain.repetition_penalty == 1.0 and not plain.adjusts_logits  # 0 = unset = off


def test_a_row_every_mask_excludes_ends_the_request_with_an_error(tiny_target):
    """allowed_token_ids {3} and the bad word (3, 3): after the first 3 no token is left. Through DDTree and
    AR alike the request ends there with an INVALID_ARGUMENT error, its one token emitted."""
    cfg = SamplingConfig(allowed_token_ids=(3,), bad_words=((3, 3),))
    params = [
        GenerateParams("tree", PROMPTS[0], cfg, MAX_NEW, frozenset(), True, 12),
        GenerateParams("ar", PROMPTS[0], cfg, MAX_NEW, frozenset(), False, 0),
    ]
    last: list = []
    for seq, event in zip(_run(tiny_target, cfg, params, last), last, strict=True):
        assert seq.generated == [3] and event.finish_reason == "error"
        assert "no token is allowed" in event.error and event.error_status == grpc.StatusCode.INVALID_ARGUMENT

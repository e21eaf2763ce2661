"""A causal draft head (JetSpec layout: causal_head, draft_shift, a sliding-window layer) through the services
is lossless: greedy DDTree equals AR, and at temperature 1 the first tokens follow the target's own law
(chi-square against plain forwards), with a random head served over gRPC to an in-process verifier.

The tiny sharpened target of tests/support/tiny_target.py (8 tokens): a random head's trees cover most of
the vocabulary at depth 1, so drafted tokens are accepted and the sample-at-every-node walk is exercised.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ddtree.config import VerifierConfig
from ddtree.contract.sampling_params import SamplingConfig
from ddtree.drafter.engine import DraftEngine
from ddtree.models.dflash.checkpoint import load_drafter, write_random_drafter
from ddtree.verifier.sampling.sampling import sampling_probs
from ddtree.verifier.sequence import GenerateParams, Sequence
from tests.support.engines import engine_with_drafter
from tests.support.tiny_target import PROMPT, VOCAB, chi2_pvalue, last_logits

HEAD = {
    "causal_head": True,
    "draft_shift": True,
    "layer_types": ("sliding_attention", "full_attention"),
    "sliding_window": 3,
}
SAMPLES = 800
PROMPTS = ((1, 5, 2), (3, 3, 0, 6, 2, 4), (7,))
MAX_NEW = 24


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one thread is faster, and much faster on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _causal_engine(model, tmp_path) -> DraftEngine:
    cfg = model.config
    target = {"hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers, "vocab_size": VOCAB}
    ckpt = write_random_drafter(tmp_path, target, seed=9, block_size=6, num_layers=2, attention=HEAD)
    head = load_drafter(ckpt)
    assert head.config.causal_head and head.config.draft_shift and head.config.layer_window(0) == 3
    return DraftEngine(
        head, model.model.embed_tokens.weight.detach(), model.lm_head.weight.detach(), default_budget=12, max_budget=64
    )


def _run(model, tmp_path, params: list[GenerateParams]) -> list[Sequence]:
    vcfg = VerifierConfig(max_batch=64, max_queue=len(params), kv_tokens=64 * 48, prefill_chunk=64)
    with engine_with_drafter(model, vcfg, _causal_engine(model, tmp_path)) as engine:
        engine.scheduler.start()
        seqs = [Sequence(p) for p in params]
        for seq in seqs:
            engine.scheduler.submit(seq)
        for seq in seqs:
            while not seq.events.get(timeout=120).finish_reason:
                pass
    return seqs


def test_greedy_ddtree_with_a_causal_head_equals_ar(tiny_target, tmp_path):
    reference = []
    for prompt in PROMPTS:
        out: list[int] = []
        for _ in range(MAX_NEW):
            out.append(int(last_logits(tiny_target, list(prompt) + out)[0].argmax()))
        reference.append(out)
    params = [
        GenerateParams(f"s{i}", p, SamplingConfig(), MAX_NEW, frozenset(), True, 12) for i, p in enumerate(PROMPTS)
    ]
    seqs = _run(tiny_target, tmp_path, params)
    for i, seq in enumerate(seqs):
        assert list(seq.generated) == reference[i], f"prompt {i}: DDTree with a causal head differs from AR"
    assert max(n for seq in seqs for n in seq.accept_lengths) >= 2  # drafted tokens were accepted


def _probs(model, ids) -> torch.Tensor:
    return sampling_probs(last_logits(model, ids), SamplingConfig(temperature=1.0))[0].double()


def test_sampled_tokens_with_a_causal_head_follow_the_target(tiny_target, tmp_path):
    p1 = _probs(tiny_target, PROMPT)
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)  # P(a) P(b | a)
    for a in range(VOCAB):
        if p1[a] > 0:
            joint[a] = p1[a] * _probs(tiny_target, PROMPT + (a,))
    params = [
        GenerateParams(f"s{seed}", PROMPT, SamplingConfig(temperature=1.0, seed=seed), 2, frozenset(), True, 12)
        for seed in range(SAMPLES)
    ]
    seqs = _run(tiny_target, tmp_path, params)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    multi = 0
    for seq in seqs:
        a, b = seq.generated[:2]
        counts[a, b] += 1
        multi += seq.accept_lengths[0] >= 2
    assert multi > SAMPLES * 0.2, f"only {multi} of {SAMPLES} first steps accepted a drafted token"
    p_a = chi2_pvalue(counts.sum(1), joint.sum(1))
    p_b = chi2_pvalue(counts.sum(0), joint.sum(0))
    p_ab = chi2_pvalue(counts.flatten(), joint.flatten())
    assert min(p_a, p_b, p_ab) > 1e-3, f"p-values {p_a:.2e} {p_b:.2e} {p_ab:.2e}"


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c["dflash_config"].update(draft_shift=2), "dflash_config.draft_shift must be true or false, got 2"),
    ],
)
def test_the_drafter_refuses_a_head_it_cannot_honour(tmp_path, edit, message):
    """`ddtree drafter` on a config it cannot honour: exit 2 and one line naming the field, before serving
    (the other refusals' messages: tests/drafter/test_dflash.py::test_config_errors)."""
    target = {"hidden_size": 32, "num_hidden_layers": 6, "vocab_size": 64}
    ckpt = write_random_drafter(tmp_path / "head", target, seed=1)
    cfg = json.loads((ckpt / "config.json").read_text())
    edit(cfg)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    cmd = [sys.executable, "-m", "ddtree.cli", "drafter", "--model", str(ckpt), "--target", str(ckpt), "--port", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    err = [line for line in done.stderr.splitlines() if not line.startswith("{")]  # structlog JSON lines aside
    assert done.returncode == 2 and len(err) == 1, done.stderr
    assert err[0].startswith("ddtree drafter: error: config.json: ") and message in err[0], err

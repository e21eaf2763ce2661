"""The tiny sharpened target of the exact-sampling tests, and the references they compare DDTree with.

An 8-token vocabulary (token 1 is the eos) and logits scaled so that the top token has about half to most
of the mass: drafted tokens are often accepted, so the second and third tokens come from the
sample-at-every-node walk, not only from root samples. References are plain forwards over the whole
context (no cache reuse), and a Pearson chi-square for comparing sample counts with a law.
"""

from __future__ import annotations

import pathlib

import torch

from ddtree.contract.sampling_params import SamplingConfig
from ddtree.models.checkpoint.loader import load_target
from ddtree.models.checkpoint.random import DEFAULT_TARGET_CONFIG, write_random_target
from ddtree.models.layers.attention import AttentionMetadata, SeqAttention
from ddtree.verifier.sampling.sampling import mask_stop_tokens, sampling_probs

VOCAB = 8
PROMPT = (1, 5, 2)
# A grammar over the vocabulary read as the letters "a".."h" (tests.support.letter_vocab, eos "h"): three
# tokens, each from a different allowed set.
REGEX = "[a-e][b-g][a-f]"
ALLOWED = (range(0, 5), range(1, 7), range(0, 6))


def build_tiny_target(directory: pathlib.Path):
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
    path = write_random_target(directory, cfg, seed=3)
    model = load_target(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)  # sharpen: top token ~0.5-0.8, far from uniform and from greedy
    return model


def last_logits(model, ids) -> torch.Tensor:
    """[1, vocab] logits of the last position of one plain forward over `ids`."""
    n = len(ids)
    cache = model.new_kv_cache(n)
    meta = AttentionMetadata(seqs=(SeqAttention(0, n, torch.empty(0, dtype=torch.int64), torch.arange(n), None),))
    with torch.inference_mode():
        out = model.forward(torch.tensor(ids), torch.arange(n), meta, cache, logits_rows=torch.tensor([n - 1]))
    return out.logits


def masked_probs(model, ids, cfg: SamplingConfig, stops: frozenset[int], position: int) -> torch.Tensor:
    """Plain forward over `ids`: the logits (greedy) or the filtered distribution (sampled) of output
    token `position`, stop ids masked while position < min_tokens (what AR decoding with vLLM's
    min_tokens uses)."""
    logits = last_logits(model, ids)
    logits = mask_stop_tokens(logits, [0], stops) if position < cfg.min_tokens else logits
    return logits[0] if cfg.greedy else sampling_probs(logits, cfg)[0].double()


def regex_masked(model, ids, cfg: SamplingConfig, position: int) -> torch.Tensor:
    """masked_probs with REGEX's allowed set at `position` instead of stop ids."""
    logits = masked_probs(model, ids, SamplingConfig(), frozenset(), 0).clone()  # raw logits
    keep = torch.zeros(VOCAB, dtype=torch.bool)
    keep[list(ALLOWED[position])] = True
    logits[~keep] = float("-inf")
    return logits if cfg.greedy else sampling_probs(logits[None], cfg)[0].double()


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
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

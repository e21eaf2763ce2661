"""Chunked prefill packs several prompts into one forward, up to prefill_chunk prompt tokens per step, and
every prompt still gets exactly the first tokens it gets when prefilled alone in one piece."""

from __future__ import annotations

import torch

from ddtree.config import VerifierConfig
from ddtree.contract.sampling_params import SamplingConfig
from ddtree.models.checkpoint.loader import load_target
from ddtree.verifier.engine import build_engine
from ddtree.verifier.sequence import GenerateParams, Sequence


def _run(model, prompts, prefill_chunk, max_new):
    vcfg = VerifierConfig(
        kv_tokens=4096, max_batch=8, prefill_chunk=prefill_chunk, debug_checks=True, prefix_cache=False
    )
    engine = build_engine(vcfg, model=model)
    sched, pool = engine.scheduler, engine.pool
    calls = []
    forward = model.forward

    def counting(input_ids, *args, **kwargs):
        calls.append(int(input_ids.shape[0]))
        return forward(input_ids, *args, **kwargs)

    model.forward = counting
    seqs = [
        Sequence(GenerateParams(f"r{i}", tuple(p), SamplingConfig(temperature=0.0), max_new, frozenset(), False, 0))
        for i, p in enumerate(prompts)
    ]
    try:
        for seq in seqs:  # all queued before the loop starts: they are admitted together
            sched.submit(seq)
        sched.start()
        for seq in seqs:
            while not seq.events.get(timeout=120).finish_reason:
                pass
    finally:
        sched.stop()
        del model.forward
    assert pool.num_used == 0
    return [list(s.generated) for s in seqs], calls


def test_short_prompts_share_a_prefill_step(default_ckpt):
    model = load_target(default_ckpt.target).eval()
    g = torch.Generator().manual_seed(0)
    lengths = [100, 100, 100, 700]
    prompts = [torch.randint(20, 4000, (n,), generator=g).tolist() for n in lengths]
    alone = [_run(model, [p], 4096, 1)[0][0] for p in prompts]
    packed, calls = _run(model, prompts, 256, 1)
    assert packed == alone
    # 256 prompt tokens per forward: [100 + 100 + 56], [44 + 212], [256], [232]; one prompt per step would
    # take 3 + 3 forwards.
    assert calls == [256, 256, 256, 232], calls
    # with decoding in between, the streams match their solo runs too
    decoded, _ = _run(model, prompts, 128, 6)
    assert decoded == [_run(model, [p], 4096, 6)[0][0] for p in prompts]

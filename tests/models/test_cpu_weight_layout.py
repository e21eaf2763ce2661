"""Column-major CPU weights (models/runtime/cpu/weight_layout.py): the layout changes, the model does not.

The reference is the same checkpoint with the loader's row-major weights: the values must be equal, and a
verifier built from the checkpoint directory (which applies the layout on the CPU) must decode the same
greedy tokens as one built from the row-major model.
"""

from __future__ import annotations

import torch
from torch import nn

from ddtree.config import VerifierConfig
from ddtree.contract.sampling_params import SamplingConfig
from ddtree.models.checkpoint.loader import load_target
from ddtree.models.checkpoint.random import write_random_target
from ddtree.models.deepseek_v3.moe_experts import StackedProjection
from ddtree.models.runtime.cpu.weight_layout import VIEWED_WEIGHTS, is_column_major, use_column_major_weights
from ddtree.verifier.engine import build_engine
from ddtree.verifier.sequence import GenerateParams, Sequence


def _weighted(model: nn.Module) -> dict[str, nn.Module]:
    """The modules whose weight the layout may change: linears and stacked expert projections."""
    return {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, StackedProjection))}


def test_every_linear_and_expert_weight_but_the_viewed_ones_becomes_column_major(tmp_path):
    model = load_target(write_random_target(tmp_path / "target")).eval()
    before = {n: m.weight.detach().clone() for n, m in _weighted(model).items()}
    params = {n: m.weight for n, m in _weighted(model).items()}
    assert not any(is_column_major(w) for w in before.values())  # the loader's layout is row-major
    changed = use_column_major_weights(model)
    viewed = [n for n in before if n.rsplit(".", 1)[-1] in VIEWED_WEIGHTS]
    experts = [n for n, m in _weighted(model).items() if isinstance(m, StackedProjection)]
    assert viewed and experts and changed == len(before) - len(viewed)
    for name, module in _weighted(model).items():
        assert module.weight is params[name]  # the same Parameter, new storage
        assert torch.equal(module.weight, before[name])  # the same values
        assert is_column_major(module.weight) == (name not in viewed), name
    for name in experts:  # the grouped matmul's operand, weight [E, N, K] -> [E, K, N], is now contiguous
        assert params[name].transpose(1, 2).is_contiguous(), name
    assert use_column_major_weights(model) == 0  # idempotent


def _greedy(engine, prompt: list[int], n: int) -> list[int]:
    seq = Sequence(GenerateParams("r", tuple(prompt), SamplingConfig(temperature=0.0), n, frozenset(), True, 0))
    engine.scheduler.submit(seq)
    engine.start()
    try:
        while not seq.events.get(timeout=120).finish_reason:
            pass
    finally:
        engine.stop()
    return list(seq.generated)


def test_the_cpu_verifier_serves_column_major_weights_and_decodes_the_same_tokens(default_ckpt):
    """The shipped target in fp32, as the verifier serves it: 64 greedy tokens from a 40-token prompt are
    the same from the engine built from the directory (column-major) as from the row-major model."""
    cfg = VerifierConfig(kv_tokens=512, prefix_cache=False)
    served = build_engine(cfg, str(default_ckpt.target))
    lm_head = served.target.model.lm_head.weight
    assert is_column_major(lm_head) and not lm_head.is_contiguous()
    row_major = load_target(default_ckpt.target, dtype=torch.float32).eval()
    assert row_major.lm_head.weight.is_contiguous()
    vocab = row_major.config.vocab_size
    prompt = torch.randint(0, vocab, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    assert _greedy(served, prompt, 64) == _greedy(build_engine(cfg, model=row_major), prompt, 64)

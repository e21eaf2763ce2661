"""Column-major CPU linear and expert weights (services/models/cpu_weight_layout.py): the layout changes, the
model does not.

Against transformers (independent reference) on a random HF checkpoint, and against the same model with
row-major weights on the shipped demo target (greedy tokens identical over a long decode).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddtree.models.cpu_weight_layout import (
    VIEWED_WEIGHTS,
    is_column_major,
    resolve_layout,
    use_column_major_weights,
)
from ddtree.models.loader import load_target
from ddtree.models.moe_experts import StackedProjection
from tests.models.test_target_parity import BASE, ancestor_mask, hf_logits, prefill, root_path, run, save_hf_checkpoint
from tests.support.compare import assert_close

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3ForCausalLM as HFModel  # noqa: E402

DEMO_TARGET = "checkpoints/demo/target"


def _weighted(model: nn.Module) -> dict[str, nn.Module]:
    """The modules whose weight the layout may change: linears and stacked expert projections."""
    return {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, StackedProjection))}


def test_resolve_layout():
    assert resolve_layout("auto", "cpu") == "column"
    assert resolve_layout("auto", "cuda:3") == "row"
    assert resolve_layout("row", "cpu") == "row"
    assert resolve_layout("column", "cpu") == "column"
    with pytest.raises(ValueError, match="cpu_linear_layout must be one of auto, row, column"):
        resolve_layout("transposed", "cpu")
    # the verifier's flag is checked when its config is validated (load_config does), before any model loads
    from ddtree.config import VerifierConfig

    VerifierConfig(cpu_linear_layout="row").validate()
    with pytest.raises(ValueError, match="cpu_linear_layout must be auto, row or column, got 'transposed'"):
        VerifierConfig(cpu_linear_layout="transposed").validate()


def test_every_linear_and_expert_weight_but_the_viewed_ones_becomes_column_major(tmp_path):
    path = save_hf_checkpoint({**BASE, "rms_norm_eps": 1e-5}, tmp_path / "hf")
    hf = HFModel.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    ours = load_target(path).eval()
    before = {n: m.weight.detach().clone() for n, m in _weighted(ours).items()}
    params = {n: m.weight for n, m in _weighted(ours).items()}
    assert not any(is_column_major(w) for w in before.values())  # the loader's layout is row-major
    changed = use_column_major_weights(ours)
    viewed = [n for n in before if n.rsplit(".", 1)[-1] in VIEWED_WEIGHTS]
    experts = [n for n, m in _weighted(ours).items() if isinstance(m, StackedProjection)]
    assert viewed and experts and changed == len(before) - len(viewed)
    for name, module in _weighted(ours).items():
        assert module.weight is params[name]  # the same Parameter, new storage
        assert torch.equal(module.weight, before[name])  # same values
        assert is_column_major(module.weight) == (name not in viewed), name
    for name in experts:  # the grouped matmul's operand, weight [E, N, K] -> [E, K, N], is now contiguous
        assert params[name].transpose(1, 2).is_contiguous(), name
    assert use_column_major_weights(ours) == 0  # idempotent

    # the model still matches transformers: prefill, then a tree verify over the prefix
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 512, (11,), generator=g).tolist()
    kv, slots = ours.new_kv_cache(40), torch.randperm(40)
    with torch.no_grad():
        assert_close("prefill logits", prefill(ours, kv, ids, slots[:11]).logits, hf_logits(hf, ids))
        parents = [-1, 0, 0, 1, 2]
        tokens = torch.randint(0, 512, (len(parents),), generator=g).tolist()
        depth = [0, 1, 1, 2, 2]
        out = run(ours, kv, [(tokens, [11 + d for d in depth], slots[:11], slots[11:16], ancestor_mask(parents))])
    for i in range(len(parents)):
        assert_close(f"tree node {i}", out.logits[i], hf_logits(hf, ids + root_path(tokens, parents, i))[-1])


@torch.no_grad()
def _greedy(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the last step's logits, one token per step over a latent cache."""
    kv = model.new_kv_cache(len(prompt) + n)
    slots = torch.arange(len(prompt) + n)
    logits = prefill(model, kv, prompt, slots[: len(prompt)], logits_rows=torch.tensor([len(prompt) - 1])).logits
    out = []
    for t in range(len(prompt), len(prompt) + n):
        out.append(int(logits[-1].argmax()))
        logits = run(model, kv, [([out[-1]], [t], slots[:t], slots[t : t + 1], None)]).logits
    return out, logits[-1]


def test_demo_target_greedy_tokens_identical():
    """The shipped target in fp32 (as the verifier serves it), 64 greedy tokens from a 40-token prompt: the
    same tokens with either layout, and the last logits within fp32 tolerance (the products may block
    differently, never differ more)."""
    row = load_target(DEMO_TARGET, dtype=torch.float32).eval()
    col = load_target(DEMO_TARGET, dtype=torch.float32).eval()
    assert use_column_major_weights(col) > 0
    prompt = torch.randint(0, row.config.vocab_size, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    tokens_row, last_row = _greedy(row, prompt, 64)
    tokens_col, last_col = _greedy(col, prompt, 64)
    assert tokens_col == tokens_row
    assert_close("last logits", last_col, last_row)


def test_bench_cpu_layout_script_runs_and_saves(tmp_path):
    """scripts/bench/bench_cpu_layout.py (the measurement behind the flag's default) runs at tiny shapes and saves
    one result per (context, rows), both layouts timed."""
    import json

    from scripts.bench.bench_cpu_layout import main

    out = tmp_path / "layout.json"
    assert main(["--contexts", "8", "20", "--rows", "1", "3", "--repeats", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["weights_changed"] > 0
    assert [(r["context"], r["rows"]) for r in data["results"]] == [(8, 1), (8, 3), (20, 1), (20, 3)]
    assert all(r["row_ms"] > 0 and r["column_ms"] > 0 for r in data["results"])

"""The verifier's compiled CPU step (`--cpu-compile on`, services/verifier/cpu_compile.py).

The spliced static forward (the cache only read, this step's rows returned) gives the in-place forward's
numbers bit for bit and the rows it would have written. Compiled with inductor, a step agrees with the
eager model forward (allclose, the same argmax: the build reorders floating-point sums, so not bit for
bit), writes the same cache rows, and a greedy generation through it gives the eager tokens. The flag is
refused where it cannot run.
"""

from __future__ import annotations

import json

import pytest
import torch

from ddtree.config import VerifierConfig
from ddtree.models.aot_compile import compiler_missing
from ddtree.models.loader import load_target
from ddtree.models.static_forward import static_forward
from ddtree.verifier import static_step
from ddtree.verifier.static_step import StaticStep, StepBuffers, make_buckets, plan_static_step
from tests.verifier.test_static_step import EDGES, TAPS, _generate, _meta

BUCKETS = make_buckets((1, 3), (1, 8), (32, 64))


@pytest.fixture(scope="module")
def model(default_ckpt):
    return load_target(default_ckpt.target).eval()


def _cache(model, slots: int, seed: int) -> torch.Tensor:
    c = model.config
    return torch.randn(c.num_hidden_layers, slots + 1, c.kv_cache_width, generator=torch.Generator().manual_seed(seed))


def test_the_spliced_forward_gives_the_in_place_numbers_and_rows(model):
    S = 600
    kv = _cache(model, S, 1)
    step = StaticStep(model, kv, S, BUCKETS, TAPS, graphs=False)
    for k, shapes in enumerate(EDGES):
        ids, pos, meta = _meta(shapes, S, seed=k)
        buf = StepBuffers(step.bucket_for(meta), S, kv.device)
        where = buf.fill(ids, pos, meta)
        with torch.inference_mode():
            kv_in_place = kv.clone()
            want_h, want_t = buf.forward(model, kv_in_place, TAPS)
            kv_spliced = kv.clone()
            got_h, got_t, rows = static_forward(model, *buf.step_inputs(kv_spliced), TAPS, key_cols=buf.key_cols)
            assert torch.equal(kv_spliced, kv), "the spliced forward must not write the cache"
            kv_spliced.index_copy_(1, buf.write_slots, rows)
        assert torch.equal(got_h.index_select(0, where), want_h.index_select(0, where)), f"{shapes}"
        assert torch.equal(got_t.index_select(0, where), want_t.index_select(0, where)), f"{shapes}"
        assert torch.equal(kv_spliced[:, :S], kv_in_place[:, :S]), f"{shapes}: other cache rows"


def test_one_cpu_row_runs_its_top_k_experts_with_the_dense_bits(model, monkeypatch):
    """static_forward's MoE on one row computes only the row's top-k experts (counted), and gives the sum
    over every expert, written out here (the skipped ones weigh 0), bit for bit."""
    from torch.nn import functional

    from ddtree.models.moe import DeepseekV3MoE
    from ddtree.models.static_forward import _dense_moe

    moes = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, DeepseekV3MoE)]
    g = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for t in range(40):
            x = torch.randn(1, model.config.hidden_size, generator=g) * (1 + t % 4)
            for moe in moes:
                weights, idx = moe.gate(x)
                gate, up, down = (p.weight for p in moe.experts.projections())
                want = torch.zeros(1, down.shape[1])
                for e in range(gate.shape[0]):  # every expert, ascending; weight 0 off the top-k
                    w = weights[0][idx[0] == e].sum()
                    want = want + functional.linear(functional.silu(x @ gate[e].T) * (x @ up[e].T), down[e]) * w
                assert torch.equal(_dense_moe(moe, x), want + moe.shared_experts(x))
    moe, real, seen = moes[0], functional.linear, []

    def counting(inp, w, *args):
        seen.append(w.data_ptr())
        return real(inp, w, *args)

    monkeypatch.setattr(functional, "linear", counting)
    gate_weights = {moe.experts.gate_proj.weight[e].data_ptr() for e in range(moe.experts.num_local)}
    with torch.inference_mode():
        for rows, experts in ((1, model.config.num_experts_per_tok), (2, moe.experts.num_local)):
            seen.clear()
            _dense_moe(moe, torch.randn(rows, model.config.hidden_size, generator=g))
            assert len(gate_weights & set(seen)) == experts, f"{rows} row(s)"


needs_compiler = pytest.mark.skipif(compiler_missing() is not None, reason=f"{compiler_missing()}")
ONE_SEQUENCE = make_buckets((1,), (1, 8), (64,))  # two builds


@needs_compiler
def test_the_compiled_step_agrees_with_the_eager_forward(model):
    S = 300
    kv = _cache(model, S, 2)
    step = StaticStep(model, kv, S, ONE_SEQUENCE, TAPS, graphs=False, compiled=True)
    assert step.capture() > 0
    for k, shapes in enumerate([[(0, 1)], [(40, 8)], [(63, 1)], [(20, 5)], [(56, 8)]]):
        ids, pos, meta = _meta(shapes, S, seed=10 + k)
        kv_eager = kv.clone()
        with torch.inference_mode():
            got_h, got_t = step.run(ids, pos, meta, TAPS)
            out = model.forward(ids, pos, meta, kv_eager, tap_layer_ids=TAPS, hidden_only=True)
        torch.testing.assert_close(got_h, out.hidden, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got_t, out.taps, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(kv[:, :S], kv_eager[:, :S], atol=1e-5, rtol=1e-5)
        assert torch.equal(model.compute_logits(got_h).argmax(-1), model.compute_logits(out.hidden).argmax(-1))
    assert step.replays == 5 and step.fallbacks == 0


@needs_compiler
def test_a_generation_through_the_compiled_step_gives_the_eager_tokens(model):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(20, 4000, (30,), generator=g).tolist()]
    eager = _generate(model, False, prompts, 12)
    # contexts grow past 64 keys: the later steps run eagerly
    assert _generate(model, True, prompts, 12, buckets=ONE_SEQUENCE, compiled=True) == eager


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"cpu_compile": "yes"}, "cpu_compile must be on or off"),
        ({"cpu_compile": "on", "device": "cuda"}, "--cpu-compile on is for --device cpu"),
        ({"cpu_compile": "on", "tp": 2}, "not supported with --tp 2"),
        ({"cpu_compile": "on", "cuda_graphs": "off"}, "--cuda-graphs off turns off"),
    ],
)
def test_the_flag_is_refused_where_it_cannot_run(flags, message):
    with pytest.raises(ValueError, match=message):
        VerifierConfig(**flags).validate()


def test_on_without_a_compiler_is_a_start_up_error(model, monkeypatch):
    monkeypatch.setattr(static_step, "compiler_missing", lambda: "inductor's C++ compiler 'g++' is not on PATH")
    with pytest.raises(ValueError, match="--cpu-compile on: inductor's C\\+\\+ compiler 'g\\+\\+' is not on PATH"):
        plan_static_step(VerifierConfig(cpu_compile="on"), model)


def test_the_plan_has_one_sequence_two_row_sizes_and_doubling_keys(model):
    plan = plan_static_step(VerifierConfig(cpu_compile="on", max_context=3000, default_budget=16), model)
    assert plan.compiled and not plan.graphs
    assert {(b.batch, b.rows) for b in plan.buckets} == {(1, 1), (1, 17)}
    assert sorted(b.keys for b in plan.buckets if b.rows == 1) == [512, 1024, 2048, 3000]
    assert sorted(b.keys for b in plan.buckets if b.rows == 17) == [512, 1024, 2048, 3017]
    longer = plan_static_step(VerifierConfig(cpu_compile="on", max_context=6000, default_budget=16), model)
    assert sorted(b.keys for b in longer.buckets if b.rows == 1) == [512, 1024, 2048, 4096, 6000]
    assert max(b.keys for b in longer.buckets if b.rows == 17) == static_step.COMPILED_TREE_KEYS == 4096


@needs_compiler
def test_the_bench_script_runs_and_saves_its_table(tmp_path):
    from scripts.bench import bench_cpu_compile

    out = tmp_path / "bench.json"
    assert bench_cpu_compile.main(["--contexts", "16", "--rows", "3", "--repeats", "20", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert (row["context"], row["rows"]) == (16, 3) and row["same_argmax"] and row["max_logit_diff"] < 1e-3
    assert row["eager_ms"] > 0 and row["compiled_ms"] > 0 and row["build_s"] > 0

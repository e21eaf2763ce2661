"""The target's forward reads nothing back to the host (issue 40): 0 host syncs inside
DeepseekV3ForCausalLM.forward on the CPU path (torch attention, grouped torch MoE, packed INT4 experts),
counted with `ddtree bench step`'s dispatch-mode counter over the verifier's own step (batch.py prepares
the attention's buffers before the forward). A verify step of 17 rows (a tree) at 1024 tokens of context
and an AR decode step, for the demo-like random target (fp32: the torch backend's in-place prefix runs)
a Kimi-shaped INT4 checkpoint (64 routed experts, 3 layers) in bf16, and the demo-like target as an FP8
block checkpoint. The forward's logits with the
metadata prepared equal those of a forward that prepares nothing (the lazy path) bit for bit."""

from __future__ import annotations

import collections

import pytest
import torch

from ddtree.models.checkpoint.loader import load_target
from ddtree.models.checkpoint.random import DEFAULT_TARGET_CONFIG, write_random_target
from ddtree.models.layers.attention import AttentionMetadata, SeqAttention, prepare_attention
from ddtree.tools.step_cost.collectives import count_collectives
from ddtree.tools.step_cost.step_measure import step_bench
from ddtree.tools.step_cost.step_model import ModelSpec
from ddtree.verifier.step.target import ShardedTarget
from tests.support.forward_syncs import sync_report, verifier_step_counts, write_kimi_int4
from tests.support.quantized_checkpoints import quantize_checkpoint

STEPS = [(17, 1024), (1, 1024)]  # (rows, context): a tree verify and an AR decode


@pytest.fixture(scope="module")
def demo_target(tmp_path_factory):
    path = write_random_target(tmp_path_factory.mktemp("demo_target"), DEFAULT_TARGET_CONFIG, seed=0)
    return load_target(path).eval()


@pytest.fixture(scope="module")
def kimi_int4_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("kimi_int4")
    return write_kimi_int4(
        out, layers=3, experts=64, hidden=256, vocab=1024, heads=4, lora=128, width=128, dense_width=512
    )


@pytest.fixture(scope="module")
def kimi_int4_target(kimi_int4_dir):
    model = load_target(kimi_int4_dir).eval()
    assert model.model.layers[1].mlp.experts.gate_proj.kind == "int4"
    return model


@pytest.fixture(scope="module")
def fp8_target(tmp_path_factory):
    """The demo-like target with every projection FP8 (block scales, ragged edge blocks): packed Fp8Linear
    layers and FP8 routed experts."""
    src = write_random_target(tmp_path_factory.mktemp("fp32_src"), DEFAULT_TARGET_CONFIG, seed=0)
    model = load_target(quantize_checkpoint(src, tmp_path_factory.mktemp("fp8"), "fp8")).eval()
    assert model.model.layers[1].mlp.experts.gate_proj.kind == "fp8"
    return model


@pytest.mark.parametrize("rows, context", STEPS, ids=["verify17", "decode"])
@pytest.mark.parametrize("which", ["demo_target", "kimi_int4_target", "fp8_target"])
def test_no_host_sync_inside_the_forward(which, rows, context, request):
    model = request.getfixturevalue(which)
    counter = verifier_step_counts(model, rows, context)
    assert counter.total().launches > 0, "the forward was not counted"
    assert counter.total().host_syncs == 0, sync_report(counter)


def _tree_step(context: int, rows: int):
    g = torch.Generator().manual_seed(rows)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, rows)]
    mask = torch.eye(rows, dtype=torch.bool)
    depth = [0] * rows
    for i in range(1, rows):
        mask[i] |= mask[parents[i]]
        depth[i] = depth[parents[i]] + 1
    prefix = torch.cat([torch.arange(0, 300), torch.arange(400, 400 + context - 300)])  # two runs
    new = torch.arange(2000, 2000 + rows)
    meta = AttentionMetadata((SeqAttention(0, rows, prefix, new, mask),))
    return torch.tensor(depth) + context, meta


def test_prepared_forward_equals_the_lazy_one(demo_target):
    model, rows, context = demo_target, 9, 700
    positions, meta = _tree_step(context, rows)
    ids = torch.randint(0, model.config.vocab_size, (rows,), generator=torch.Generator().manual_seed(1))
    cache = model.new_kv_cache(2100)
    cache.normal_(generator=torch.Generator().manual_seed(2))
    start = cache.clone()
    lazy = model(ids, positions, meta, cache).logits
    assert set(meta.prepared) >= {"torch", "write_slots"}  # prepared at its first use
    cache.copy_(start)
    _, again = _tree_step(context, rows)
    prepared = model(ids, positions, prepare_attention(model, again, cache), cache).logits
    assert torch.equal(lazy, prepared)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2_ep"])
def test_no_host_sync_inside_the_tensor_parallel_forward(kimi_int4_dir, expert_parallel):
    """Rank 0 of TP 2 (emulated: its shard in a one-rank group, as `ddtree bench step --emulate-tp 2`):
    TensorParallelModel.forward (the step message's one broadcast, the shard's forward, the argmax
    gather) reads nothing back; ShardedTarget.prepare packed the message and the attention buffers."""
    spec = ModelSpec(str(kimi_int4_dir), random_weights=False, device="cpu", emulate_tp=2,
                     expert_parallel=expert_parallel)  # fmt: skip
    calls: collections.Counter = collections.Counter()
    with step_bench(spec) as bench, count_collectives(calls):
        assert isinstance(bench.target, ShardedTarget)
        counter = verifier_step_counts(bench.model, 17, 1024, target=bench.target, counted=bench.target.model)
    assert calls["broadcast_cpu"] == 1, "the step's inputs go to the other ranks in one broadcast"
    assert counter.total().launches > 0
    assert counter.total().host_syncs == 0, sync_report(counter)


@pytest.mark.parametrize("rows", [17, 1])
def test_no_host_sync_inside_the_static_step_forward(kimi_int4_target, rows):
    """The verifier's static step (verifier/step/static_step.py) runs the same forward over its bucket's buffers:
    0 host syncs inside it too, INT4 experts included (what a CUDA graph of it needs)."""
    from ddtree.tools.step_cost.op_count import OpCounter
    from ddtree.tools.step_cost.step_batch import StepShape, make_step_work
    from ddtree.verifier.step.static_step import StaticStep, make_buckets
    from ddtree.verifier.step.target import LocalTarget
    from tests.support.forward_syncs import counting_forward

    model = kimi_int4_target
    work = make_step_work(model.config, StepShape(rows=rows, context=1024), model.device, model.dtype)
    step = StaticStep(
        model, work.pool.cache, work.pool.pad_slot, make_buckets((1,), (rows,), (1088,)), work.taps, False
    )
    counter = OpCounter(model.device.type)
    with counting_forward(model, counter):
        work.run(LocalTarget(model, static=step))
    assert step.replays == 1 and step.fallbacks == 0
    assert counter.total().launches > 0, "the forward was not counted"
    assert counter.total().host_syncs == 0, sync_report(counter)

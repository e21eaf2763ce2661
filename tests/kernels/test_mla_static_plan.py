"""The MLA kernels over a bucket's static plan (kernels/mla/static_plan.py) equal the torch reference.

Ragged batches (decode rows, tree verifies with their masks, empty prefixes, fewer sequences than the
bucket) are packed into one bucket's fixed buffers, twice over the same buffers in both orders (stale
contents would show); the real rows of the kernels' output equal TorchMLAAttention's eager attention on
the same cache, every padding row is finite, and the plan's shapes are the bucket's whatever the step.
The whole model forward over a static batch equals the eager one with the triton backend too.
"""

from __future__ import annotations

import random

import pytest
import torch

from ddtree.kernels.mla.backend import TritonMLAAttention
from ddtree.kernels.mla.plan import MLAKernelConfig
from ddtree.models.checkpoint.random import DEFAULT_TARGET_CONFIG, random_target_state_dict
from ddtree.models.deepseek_v3.config import DeepseekV3Config
from ddtree.models.deepseek_v3.model import DeepseekV3ForCausalLM
from ddtree.models.layers.attention import AttentionMetadata, SeqAttention, TorchMLAAttention
from ddtree.models.runtime.static_batch import Bucket, StaticBatch
from ddtree.tools.selftest.compare import assert_close
from tests.support.triton_env import DEVICE, triton_interpret_env  # noqa: F401,I001  (before kernels are imported)

SPLITTY = MLAKernelConfig(block_m=16, block_n=16, min_split=16, target_programs=64)  # several splits per tile
H, R, DR, S = 4, 32, 16, 400  # heads, latent, rope dims, cache slots (the last one is the pad slot)


def _tree_mask(n: int, rng: random.Random) -> torch.Tensor:
    """A random tree of n rows in topological order: each row sees itself and its ancestors."""
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        if i:
            mask[i] = mask[rng.randrange(i)]
        mask[i, i] = True
    return mask


def _meta(shapes, seed: int) -> AttentionMetadata:
    """(prefix, rows, tree?) per sequence, on distinct random slots below the pad slot."""
    rng = random.Random(seed)
    free = torch.randperm(S - 1, generator=torch.Generator().manual_seed(seed))
    seqs, row, used = [], 0, 0
    for P, n, tree in shapes:
        prefix, new = free[used : used + P].clone(), free[used + P : used + P + n].clone()
        used += P + n
        seqs.append(SeqAttention(row, n, prefix, new, _tree_mask(n, rng) if tree else None))
        row += n
    return AttentionMetadata(tuple(seqs))


STEPS = [
    [(0, 1, False)],
    [(37, 1, False), (5, 6, True)],
    [(60, 6, True), (0, 6, True), (20, 1, False)],
    [(1, 3, False)],  # causal rows (a prefill chunk)
    [(59, 1, False), (59, 1, False), (59, 1, False)],
]


@pytest.mark.parametrize("config", [MLAKernelConfig(), SPLITTY], ids=["one-split", "splits"])
def test_static_plan_attention_equals_the_torch_reference(config):
    bucket = Bucket(3, 6, 66)
    triton = TritonMLAAttention(config)
    batch = StaticBatch(bucket, S - 1, triton, H, S, DEVICE)
    plan = batch.meta.prepared["triton"][1]
    shapes = (plan.seqs.shape, plan.tiles.shape, plan.items.shape, plan.num_merge_tiles)
    assert (plan.num_merge_tiles > 0) == (config is SPLITTY)
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(S, R + DR, generator=g).to(DEVICE)
    T = bucket.tokens
    for k, shapes_k in enumerate(STEPS + STEPS[::-1]):
        meta = _meta(shapes_k, seed=k)
        ids = torch.zeros(meta.num_tokens, dtype=torch.int64)
        where = batch.fill(ids, ids, meta)
        q_lat, q_pe = torch.randn(T, H, R, generator=g).to(DEVICE), torch.randn(T, H, DR, generator=g).to(DEVICE)
        got = triton.attend(q_lat, q_pe, kv, batch.meta, 0.2)
        want = TorchMLAAttention().attend(q_lat[where].cpu(), q_pe[where].cpu(), kv.cpu(), meta, 0.2)
        assert_close(f"step {k} real rows", got[where].cpu(), want)
        assert torch.isfinite(got).all(), f"step {k}: a padding row is not finite"
        now = (plan.seqs.shape, plan.tiles.shape, plan.items.shape, plan.num_merge_tiles)
        assert now == shapes  # the launch sizes are the bucket's, whatever the step


def test_a_step_that_does_not_fit_its_bucket_is_refused():
    batch = StaticBatch(Bucket(1, 2, 8), S - 1, TritonMLAAttention(), H, S, DEVICE)
    ids = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="does not fit bucket"):
        batch.fill(ids, ids, _meta([(8, 1, False)], 0))


def test_the_model_forward_over_a_static_batch_equals_the_eager_forward_on_the_triton_backend():
    config = DeepseekV3Config.from_dict(DEFAULT_TARGET_CONFIG)
    model = DeepseekV3ForCausalLM(config)
    model.load_state_dict(random_target_state_dict(config, seed=3))
    model = model.eval().to(DEVICE)
    model.attn_backend = TritonMLAAttention(SPLITTY)
    c = model.config
    kv0 = torch.randn(c.num_hidden_layers, S, c.kv_cache_width, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    batch = StaticBatch(Bucket(2, 6, 40), S - 1, model.attn_backend, c.num_attention_heads, S, DEVICE)
    meta = _meta([(30, 6, True), (12, 1, False)], seed=9)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(20, 500, (meta.num_tokens,), generator=g)
    pos = torch.cat([torch.arange(30, 36), torch.tensor([12])])
    kv_static, kv_eager = kv0.clone(), kv0.clone()
    with torch.inference_mode():
        where = batch.fill(ids, pos, meta)
        hidden, taps = batch.forward(model, kv_static, (1,))
        out = model.forward(ids.to(DEVICE), pos.to(DEVICE), meta, kv_eager, tap_layer_ids=(1,), hidden_only=True)
    assert_close("hidden", hidden[where], out.hidden)
    assert_close("taps", taps[where], out.taps)
    assert_close("cache", kv_static[:, : S - 1], kv_eager[:, : S - 1])


@pytest.mark.parametrize("bucket", [Bucket(1, 1, 64), Bucket(3, 6, 66), Bucket(4, 17, 2048), Bucket(16, 17, 32768)])
def test_the_graph_pool_bounds_hold_for_the_triton_layout(bucket):
    """verifier/kv/graph_pool.py counts the Triton plan exactly (its counts follow the bucket and the heads, not
    the device): the real batch's buffers and its split kernel's partials are what it counts."""
    from ddtree.verifier.kv.graph_pool import _triton_plan, static_buffer_bytes

    heads, hidden = 8, 64
    batch = StaticBatch(bucket, S - 1, TritonMLAAttention(), heads, 1 << 20, DEVICE)
    real = sum(t.nbytes for t in batch.device_tensors())
    bound = static_buffer_bytes(bucket.batch, bucket.rows, bucket.keys, hidden, 0, 2, "triton", heads)
    assert real == bound - bucket.tokens * hidden * 2  # the bound adds the [T, d] output
    plan = batch.meta.prepared["triton"][1]
    bound_plan = _triton_plan(bucket.batch, bucket.rows, bucket.keys, heads)
    assert plan.num_items == bound_plan.items and plan.num_merge_tiles == bound_plan.merge_tiles
    assert plan.block_m == bound_plan.block_m

"""The static-shape step (services/verifier/step/static_step.py) on the CPU, fp32.

At every bucket edge (batch 1 and max, rows 1 and max, keys at the bucket boundaries) the step through
the reused buffers equals, bit for bit, the model's forward over a fresh static batch at that bucket
(what a CUDA graph replay must reproduce), and agrees with the eager model forward (allclose, the same
argmax). A step outside every bucket runs eagerly, and a generation gives the same tokens with the
static step on and off, also for a Kimi-shaped model with 64 INT4 experts.
"""

from __future__ import annotations

import copy
import random
import weakref

import pytest
import torch
from structlog.testing import capture_logs
from torch.utils._python_dispatch import TorchDispatchMode

from ddtree.config import VerifierConfig
from ddtree.contract.sampling_params import SamplingConfig
from ddtree.contract.token_tree import EMPTY_TREE, TokenTree
from ddtree.models.checkpoint.loader import load_target
from ddtree.models.layers.attention import AttentionMetadata, SeqAttention
from ddtree.models.runtime.static_batch import StaticBatch
from ddtree.verifier.kv.graph_pool import forward_peak_bytes, static_buffer_bytes
from ddtree.verifier.kv.kv_pool import LatentKVPool
from ddtree.verifier.kv.page_table import PageTable
from ddtree.verifier.sequence import GenerateParams, Phase, Sequence
from ddtree.verifier.step.apply import apply_outcome
from ddtree.verifier.step.batch import run_batch
from ddtree.verifier.step.static_step import Bucket, StaticStep, make_buckets, make_static_step, plan_static_step
from ddtree.verifier.step.target import LocalTarget
from ddtree.verifier.step.tree_mask import tree_mask
from ddtree.verifier.step.work_items import PrefillItem, VerifyItem

TAPS = (1, 2)
BUCKETS = make_buckets((1, 3), (1, 8), (32, 64))


@pytest.fixture(scope="module")
def model(default_ckpt):
    return load_target(default_ckpt.target).eval()


def _tree(n: int, seed: int) -> TokenTree:
    g = random.Random(seed)
    parents, depths, toks = [], [], []
    for i in range(1, n + 1):
        par = i - 1 if i <= n // 2 + 1 else g.randrange(0, i)
        used = {t for t, p in zip(toks, parents) if p == par}
        tok = g.choice([t for t in range(20, 60) if t not in used])
        parents.append(par)
        depths.append(0 if par == 0 else depths[par - 1])
        depths[-1] += 1
        toks.append(tok)
    return TokenTree(tuple(toks), tuple(parents), tuple(depths))


def _meta(shapes, pool_slots: int, seed: int):
    """shapes: (prefix length, new rows) per sequence -> ids, positions, meta on distinct random slots."""
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(pool_slots, generator=g)
    ids, pos, seqs, row, used = [], [], [], 0, 0
    for i, (P, n) in enumerate(shapes):
        prefix, new = free[used : used + P], free[used + P : used + P + n]
        used += P + n
        mask = tree_mask(_tree(n - 1, seed + i)) if n > 1 else None
        seqs.append(SeqAttention(row, n, prefix.clone(), new.clone(), mask))
        ids.append(torch.randint(20, 4000, (n,), generator=g))
        pos.append(torch.arange(P, P + n) if mask is None else P + mask.sum(1) - 1)
        row += n
    return torch.cat(ids), torch.cat(pos), AttentionMetadata(tuple(seqs))


def _fresh_batch(model, bucket: Bucket, pad_slot: int, cache_slots: int) -> StaticBatch:
    heads = model.model.layers[0].self_attn.num_heads
    return StaticBatch(bucket, pad_slot, model.attn_backend, heads, cache_slots, "cpu")


def _fresh(model, kv, bucket: Bucket, ids, pos, meta, pad_slot):
    """The model's forward over a freshly built static batch at `bucket` (no reuse)."""
    batch = _fresh_batch(model, bucket, pad_slot, kv.shape[1])
    where = batch.fill(ids, pos, meta)
    hidden, taps = batch.forward(model, kv, TAPS)
    return hidden.index_select(0, where), taps.index_select(0, where)


EDGES = [  # (prefix, rows) per sequence: batch 1 and max, rows 1 and max, keys at the boundaries
    [(0, 1)],
    [(31, 1)],
    [(24, 8)],
    [(25, 8)],  # 33 keys: the next key bucket
    [(56, 8)],  # exactly the largest
    [(63, 1), (10, 8), (0, 1)],
    [(5, 8), (56, 8), (40, 1)],
    [(1, 1), (2, 1)],
]


def test_every_bucket_edge_equals_the_eager_forward(model):
    c = model.config
    S = 600
    kv0 = torch.randn(c.num_hidden_layers, S + 1, c.kv_cache_width, generator=torch.Generator().manual_seed(1))
    kv_static = kv0.clone()
    step = StaticStep(model, kv_static, S, BUCKETS, TAPS, graphs=False)
    for k, shapes in enumerate(EDGES + EDGES[::-1]):  # twice, in both orders: stale buffer contents would show
        ids, pos, meta = _meta(shapes, S, seed=k)
        bucket = step.bucket_for(meta)
        assert bucket is not None
        with torch.inference_mode():
            got_h, got_t = step.run(ids, pos, meta, TAPS)
            kv_fresh = kv_static.clone()
            want_h, want_t = _fresh(model, kv_fresh, bucket, ids, pos, meta, S)
            kv_eager = kv_static.clone()
            out = model.forward(ids, pos, meta, kv_eager, tap_layer_ids=TAPS, hidden_only=True)
        assert torch.equal(got_h, want_h) and torch.equal(got_t, want_t), f"{shapes}: not bit for bit"
        assert torch.equal(kv_static[:, :S], kv_fresh[:, :S])
        torch.testing.assert_close(got_h, out.hidden, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(got_t, out.taps, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(kv_static[:, :S], kv_eager[:, :S], atol=1e-5, rtol=1e-5)
        assert torch.equal(model.compute_logits(got_h).argmax(-1), model.compute_logits(out.hidden).argmax(-1))
    assert step.replays == 2 * len(EDGES) and step.fallbacks == 0


def test_outside_every_bucket_is_left_to_the_eager_forward(model):
    c = model.config
    kv = torch.zeros(c.num_hidden_layers, 201, c.kv_cache_width)
    step = StaticStep(model, kv, 200, BUCKETS, TAPS, graphs=False)
    for shapes in ([(60, 8)], [(0, 9)], [(0, 1)] * 4):  # 68 keys, 9 rows, 4 sequences
        ids, pos, meta = _meta(shapes, 200, seed=0)
        assert step.bucket_for(meta) is None and step.run(ids, pos, meta, TAPS) is None
    ids, pos, meta = _meta([(3, 1)], 200, seed=0)
    assert step.run(ids, pos, meta, (1,)) is None  # other tap layers than captured
    assert step.fallbacks == 4


def _generate(model, static: bool, prompts, steps: int, buckets=BUCKETS) -> list[list[int]]:
    c = model.config
    pool = LatentKVPool(c.num_hidden_layers, 2048, c.kv_cache_width, torch.float32, "cpu")
    target = LocalTarget(model)
    if static:
        target.static = StaticStep(model, pool.cache, pool.pad_slot, buckets, TAPS, graphs=False)
    seqs = []
    for i, prompt in enumerate(prompts):
        s = Sequence(GenerateParams(f"r{i}", tuple(prompt), SamplingConfig(), 1000, frozenset(), True, 8))
        s.table, s.phase = PageTable(1), Phase.PREFILL
        item = PrefillItem(s, 0, len(prompt))
        apply_outcome(s, item.commit(run_batch(target, pool, [item], TAPS)[0], 0), pool)
        seqs.append(s)
    for k in range(steps):  # AR and tree steps, mixed in one batch; contexts grow past the largest bucket
        items = [VerifyItem(s, EMPTY_TREE if (k + i) % 3 == 0 else _tree(7, k * 10 + i)) for i, s in enumerate(seqs)]
        for item, out in zip(items, run_batch(target, pool, items, TAPS)):
            apply_outcome(item.seq, item.commit(out, 0), pool)
    if static:
        assert target.static.replays > 0 and target.static.fallbacks > 0
    return [s.generated for s in seqs]


def test_tokens_are_the_same_with_and_without_the_static_step(model):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(20, 4000, (n,), generator=g).tolist() for n in (5, 30, 44)]
    assert _generate(model, True, prompts, 12) == _generate(model, False, prompts, 12)


def test_prefix_runs_read_in_place_equal_the_gather(monkeypatch):
    """Long runs of consecutive prefix slots are read as views of the cache (attention.RUN_MIN); the
    result equals the one-gather path, with runs, fragments and a tree mask in one batch."""
    from ddtree.models.layers import attention

    g = torch.Generator().manual_seed(5)
    kv = torch.randn(3000, 80, generator=g)
    frag = torch.randperm(3000, generator=g)[:40]  # scattered slots, then runs around them
    prefixes = [
        torch.arange(100, 400),  # one run
        torch.cat([torch.arange(500, 700), frag[:10], torch.arange(900, 1200), frag[10:20]]),  # runs + fragments
        frag[20:40],  # short: gathered
    ]
    seqs, row = [], 0
    for i, (prefix, n) in enumerate(zip(prefixes, (1, 8, 8))):
        new = torch.arange(2000 + 10 * i, 2000 + 10 * i + n)
        mask = tree_mask(_tree(n - 1, i)) if n > 1 else None
        seqs.append(SeqAttention(row, n, prefix, new, mask))
        row += n
    meta = AttentionMetadata(tuple(seqs))
    assert [len(s.prefix_runs[0]) for s in seqs] == [1, 2, 0]
    q_lat, q_pe = torch.randn(row, 4, 64, generator=g), torch.randn(row, 4, 16, generator=g)
    backend = attention.TorchMLAAttention()
    got = backend.attend(q_lat, q_pe, kv, meta, 0.1)
    monkeypatch.setattr(attention, "RUN_MIN", 10**9)
    want = backend.attend(
        q_lat,
        q_pe,
        kv,
        AttentionMetadata(
            tuple(SeqAttention(s.q_start, s.q_len, s.prefix_slots, s.new_slots, s.new_mask) for s in seqs)
        ),
        0.1,
    )
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_cuda_graphs_flag(model):
    """auto is off on the CPU, on builds the static step (no graphs on the CPU); bad values are refused."""
    c = model.config
    pool = LatentKVPool(c.num_hidden_layers, 256, c.kv_cache_width, torch.float32, "cpu")
    with capture_logs() as logs:
        assert plan_static_step(VerifierConfig(), model) is None
        assert plan_static_step(VerifierConfig(cuda_graphs="off"), model) is None
    assert [e["reason"] for e in logs if e["event"] == "static_step_off"] == [
        "--cuda-graphs auto on device cpu: CUDA graphs are for CUDA devices",
        "--cuda-graphs off",
    ]
    plan = plan_static_step(VerifierConfig(cuda_graphs="on", max_batch=2, max_context=300), model)
    step = make_static_step(plan, model, pool.cache, pool.pad_slot, TAPS)
    assert not plan.graphs and not step.graphs and step.capture() == 0.0
    assert max(b.keys for b in step.buckets) >= 300 + 17 and {b.rows for b in step.buckets} == {1, 17}
    with pytest.raises(ValueError, match="cuda_graphs"):
        VerifierConfig(cuda_graphs="yes").validate()


def test_a_kimi_shaped_int4_model_runs_the_static_step_with_the_tokens_of_the_eager_one(tmp_path):
    """Packed experts and many of them (64 INT4 experts, group 32): the static step runs them through the
    same MoE as the eager step (no dense fallback, no refusal), and the tokens are the eager ones."""
    from tests.support.forward_syncs import write_kimi_int4

    kimi_dir = write_kimi_int4(
        tmp_path, layers=3, experts=64, hidden=256, vocab=1024, heads=4, lora=128, width=128, dense_width=512
    )
    kimi = load_target(kimi_dir).eval()
    assert kimi.model.layers[1].mlp.experts.gate_proj.kind == "int4"
    with capture_logs() as logs:
        plan = plan_static_step(VerifierConfig(cuda_graphs="auto", device="cuda"), kimi)
    assert plan is not None and plan.graphs and not [e for e in logs if e["event"] == "static_step_off"]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(20, 1000, (n,), generator=g).tolist() for n in (7, 30)]
    buckets = make_buckets((1, 2), (1, 8), (64, 128))
    assert _generate(kimi, True, prompts, 6, buckets) == _generate(kimi, False, prompts, 6)


def test_tp_above_1_plans_the_same_static_step_as_tp_1(model):
    """Every rank plans its buckets from the config alone: at --tp 2 auto on CUDA captures, on is accepted."""
    VerifierConfig(tp=2, cuda_graphs="on").validate()
    one = plan_static_step(VerifierConfig(device="cuda"), model)
    two = plan_static_step(VerifierConfig(tp=2, device="cuda"), model)
    assert two is not None and two == one and two.graphs


def test_the_help_says_what_on_requires():
    import dataclasses

    help_text = {f.name: f.metadata["help"] for f in dataclasses.fields(VerifierConfig)}["cuda_graphs"]
    assert "every rank captures" in help_text and "unquantized" not in help_text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_position_rope_gives_the_bits_of_the_rotary_embedding(model, dtype):
    """cos/sin once per forward, applied as one complex multiply: the numbers of RotaryEmbedding."""
    from ddtree.models.layers.rope import PositionRope

    rope = model.model.rotary_emb
    g = torch.Generator().manual_seed(0)
    for T in (1, 17, 300):
        pos = torch.randint(0, 8000, (T,), generator=g)
        cached = PositionRope(rope, pos)
        q = torch.randn(T, 4, 48, generator=g).to(dtype)[..., 32:]  # a split view, as q_pe
        k = torch.randn(T, 80, generator=g).to(dtype)[:, 64:]  # as k_pe of kv_a_proj's output
        for x in (q, k):
            assert torch.equal(cached(x, pos), rope(x, pos))


class LivePeak(TorchDispatchMode):
    """The most bytes of tensors made inside the mode alive at once (storages of tensors that existed before,
    the weights, the cache and the buffers, not counted): a brute-force measure of a forward's activations."""

    def __init__(self, existing: list[torch.Tensor]):
        super().__init__()
        self.external = {t.untyped_storage().data_ptr() for t in existing}
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, tensors referring to it]
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ptr = t.untyped_storage().data_ptr()
                if ptr in self.external or ptr == 0:
                    continue
                if ptr not in self.live:
                    self.live[ptr] = [t.untyped_storage().nbytes(), 0]
                    self.now += self.live[ptr][0]
                    self.peak = max(self.peak, self.now)
                self.live[ptr][1] += 1
                weakref.finalize(t, self._drop, ptr)
        return out

    def _drop(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[ptr]


def _fill_buffers(model, b: Bucket, pad_slot: int, seed: int) -> StaticBatch:
    """A bucket's buffers holding a step that fills it (every sequence: a full prefix and all rows)."""
    ids, pos, meta = _meta([(b.keys - b.rows, b.rows)] * b.batch, pad_slot, seed)
    batch = _fresh_batch(model, b, pad_slot, pad_slot + 1)
    batch.fill(ids, pos, meta)
    return batch


def test_graph_pool_estimate_against_the_buffers_and_the_measured_forward(model):
    """kv_sizing's estimate of the graphs' pool: the static buffers equal the bytes of the real StaticBatch
    and outputs, and the activation bound is at least the live peak measured in the model's forward over it
    (fp32 and bf16) and no more than twice it."""
    c = model.config
    buckets = (Bucket(1, 1, 32), Bucket(3, 8, 64), Bucket(2, 17, 256), Bucket(4, 1, 512), Bucket(2, 17, 1536))
    for dtype in (torch.float32, torch.bfloat16):
        m = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
        s = torch.empty(0, dtype=dtype).element_size()
        S = 4096  # distinct slots for every bucket's keys
        kv = torch.randn(c.num_hidden_layers, S + 1, c.kv_cache_width, generator=torch.Generator().manual_seed(2))
        kv = kv.to(dtype)
        for k, b in enumerate(buckets):
            buf = _fill_buffers(m, b, S, seed=k)
            inputs = buf.device_tensors()
            existing = [*m.parameters(), *m.buffers(), kv, *inputs]
            with torch.inference_mode(), LivePeak(existing) as meter:
                hidden, taps = buf.forward(m, kv, TAPS)
            outputs = hidden.nbytes + taps.nbytes
            assert (
                static_buffer_bytes(b.batch, b.rows, b.keys, c.hidden_size, len(TAPS), s)
                == sum(t.nbytes for t in inputs) + outputs
            )
            bound = forward_peak_bytes(c, b.batch, b.rows, b.keys, len(TAPS), s)
            assert meter.peak <= bound <= 2 * meter.peak, (dtype, b, meter.peak, bound)

"""Row invariance of the static (CUDA-graph bucket) MLA plan (kernels/mla/static_plan.py), interpreted on the CPU.

Every real row of a step packed into a bucket's fixed buffers (StaticBatch, as the static step fills it)
must give bit for bit the output of its AR twin: the same query decoded alone at batch 1 through the eager
plan (plan_mla, one token, no mask) over the committed prefix and then copies of its ancestors' latents in
their own slots. Trees of 9 and 17 rows, a decode row and a prefill chunk (its rows' twins: each token
decoded after the earlier ones), at batch 1, 2 and 3 in one bucket of 3 sequences of 17 rows (padding rows
and sequences beside them), the steps packed over the same buffers in turn (stale contents would show).
Contexts cross the split edges: min_split 32 and at most 4 splits a row, so a row of 29..37 keys has one
split (written directly) or two (merged), one of 61..77 keys two or three, one of 120..136 splits by 32 or
by 48, a decode row of 200 keys by 64; every tile owns 4 items, the ones past its row's splits idle. bf16 (batch 3, then batch 1) and
fp32 (batch 3, then the chunk): the interpreter computes bf16 in fp32 and rounds the output
(checks.kernel_dims), which hides most fp32 differences, so only fp32 shows a different reduction order
reliably.

The negative control (fp32) packs the batch-3 step with every row split as the bucket's longest row is (a
split chosen from the bucket, not the row): rows differ, so the test can fail. A host-only test checks the
tables themselves against plan_mla's at Kimi's shapes (64 and 8 heads, 8k and 128k contexts), another a
bucket's items per tile against every context's splits.
"""

from __future__ import annotations

import random

import pytest
import torch

from ddtree.kernels.mla import static_plan
from ddtree.kernels.mla.attention import mla_attention
from ddtree.kernels.mla.backend import TritonMLAAttention
from ddtree.kernels.mla.plan import MLAKernelConfig, MLASeq, plan_mla, row_split_len, row_splits
from ddtree.models.layers.attention import AttentionMetadata, SeqAttention
from ddtree.models.runtime.static_batch import Bucket, StaticBatch
from ddtree.tools.selftest.invariance import Tree, random_tree
from tests.support.triton_env import DEVICE, triton_interpret_env  # noqa: F401,I001  (before kernels are imported)

CONFIG = MLAKernelConfig(block_m=32, block_n=16, min_split=32, max_splits=4, target_programs=64)
HEADS, R, DR, SCALE = 4, 64, 16, 0.125
BUCKET = Bucket(3, 17, 224)
SLOTS = 2048  # the last one is the pad slot
# (kind, rows, committed prefix) per sequence of a step
STEPS = {
    "batch 3": [("tree", 9, 29), ("decode", 1, 200), ("tree", 17, 120)],
    "batch 1": [("tree", 17, 61)],
    "chunk": [("chunk", 5, 31), ("decode", 1, 33)],
}


def _tree(kind: str, rows: int, rng: random.Random) -> Tree:
    if kind == "chunk":  # causal: each token after the earlier ones (a chain)
        return Tree(tuple(range(rows)), tuple(range(-1, rows - 1)))
    return random_tree(rows, 10, rng)


def _step(name: str, seed: int, dtype: torch.dtype):
    """(AttentionMetadata, trees, kv cache [SLOTS, R + DR], free slots) of a step on distinct random slots."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    free = torch.randperm(SLOTS - 1, generator=gen)
    seqs, trees, row, used = [], [], 0, 0
    for kind, n, P in STEPS[name]:
        tree = _tree(kind, n, rng)
        prefix, new = free[used : used + P].clone(), free[used + P : used + P + n].clone()
        used += P + n
        mask = tree.mask() if kind == "tree" else None  # a decode row and a chunk: causal
        seqs.append(SeqAttention(row, n, prefix, new, mask))
        trees.append(tree)
        row += n
    kv = torch.randn(SLOTS, R + DR, generator=gen).to(dtype)
    return AttentionMetadata(tuple(seqs)), trees, kv, free[used:]


def _twins(q_lat, q_pe, kv, seq: SeqAttention, tree: Tree, free: torch.Tensor) -> torch.Tensor:
    """[n, H, r]: each row decoded alone (eager plan, batch 1) over the prefix then copies of its ancestors."""
    kv = kv.clone()
    outs = []
    for i in range(seq.q_len):
        anc = tree.ancestors(i)
        copies = free[: len(anc) + 1]
        kv[copies] = kv[seq.new_slots[[*anc, i]]]  # the twin's own slots, written with the same latents
        table = torch.cat([seq.prefix_slots, copies[:-1]])
        plan = plan_mla([MLASeq(1, table.numel(), table, copies[-1:])], HEADS, device=DEVICE, config=CONFIG)
        outs.append(mla_attention(q_lat[i : i + 1], q_pe[i : i + 1], kv.to(DEVICE), plan, SCALE)[0].cpu())
    return torch.stack(outs)


def _differing_rows(batch: StaticBatch, name: str, seed: int, dtype: torch.dtype) -> tuple[int, int]:
    """(rows compared, rows differing from their AR twins) of step `name` packed into `batch`."""
    meta, trees, kv, free = _step(name, seed, dtype)
    ids = torch.zeros(meta.num_tokens, dtype=torch.int64)
    where = batch.fill(ids, ids, meta)
    gen = torch.Generator().manual_seed(seed + 1)
    T = BUCKET.tokens
    q_lat = torch.randn(T, HEADS, R, generator=gen).to(dtype)
    q_pe = torch.randn(T, HEADS, DR, generator=gen).to(dtype)
    out = TritonMLAAttention(CONFIG).attend(q_lat.to(DEVICE), q_pe.to(DEVICE), kv.to(DEVICE), batch.meta, SCALE).cpu()
    assert torch.isfinite(out.float()).all(), "a padding row is not finite"
    compared = differing = 0
    for s, tree in zip(meta.seqs, trees, strict=True):
        rows = where[s.q_start : s.q_start + s.q_len]
        twins = _twins(q_lat[rows], q_pe[rows], kv, s, tree, free)
        compared += s.q_len
        differing += sum(not torch.equal(out[r], twins[i]) for i, r in enumerate(rows.tolist()))
    return compared, differing


@pytest.mark.parametrize(("dtype", "steps"), [(torch.bfloat16, ("batch 3", "batch 1")), (torch.float32, ("batch 3", "chunk"))],
                         ids=["bf16", "fp32"])  # fmt: skip
def test_static_bucket_rows_equal_their_ar_twins(dtype, steps):
    batch = StaticBatch(BUCKET, SLOTS - 1, TritonMLAAttention(CONFIG), HEADS, SLOTS, DEVICE)
    plan = batch.meta.prepared["triton"][1]
    assert (plan.block_m, plan.num_items) == (16, 3 * 17 * 4)  # block_m from the 4 heads; 4 items a tile
    for k, name in enumerate(steps):
        compared, differing = _differing_rows(batch, name, seed=k, dtype=dtype)
        want = sum(n for _, n, _ in STEPS[name])
        assert compared == want and differing == 0, f"{name}: {differing} of {compared} rows differ from their twins"


def test_negative_control_a_split_from_the_bucket_differs(monkeypatch):
    """The same buffers with every row split as the bucket's longest row (64 keys, where its own rule cuts a
    row shorter than 129 keys by 32): the rows of short contexts differ from their twins."""
    batch = StaticBatch(BUCKET, SLOTS - 1, TritonMLAAttention(CONFIG), HEADS, SLOTS, DEVICE)
    split = row_split_len(BUCKET.keys - 1, CONFIG)
    monkeypatch.setattr(static_plan, "row_split_len", lambda context, config: context * 0 + split)
    monkeypatch.setattr(static_plan, "row_splits", lambda context, config: (-(-context // split)).clamp(min=1))
    compared, differing = _differing_rows(batch, "batch 3", seed=0, dtype=torch.float32)
    assert differing > 0, f"all {compared} rows equal their twins with the bucket's split: the test cannot fail"


def _rows_of(plan) -> list[tuple]:
    """(row, first head, slots of its prefix, its live items' (has_new, kv_start, kv_end)) of every tile."""
    seqs, tiles, items = plan.seqs.tolist(), plan.tiles.tolist(), plan.items.tolist()
    table = plan.table.tolist()
    out = []
    for seq, head0, part0, n in tiles:
        if n == 0:
            continue  # the static plan's no-op tile
        q_start, _, P, off, _, _, _, shared, tail = seqs[seq]
        slots = [table[off + p] if p < shared else table[tail + p - shared] for p in range(P)]
        out.append((q_start, head0, slots, [tuple(it[1:]) for it in items[part0 : part0 + n]]))
    return out


@pytest.mark.parametrize(("heads", "contexts"), [(64, (8192, 8190)), (8, (131072, 300))], ids=["tp1-8k", "tp8-128k"])
def test_static_tables_plan_each_row_as_plan_mla_does(heads, contexts):
    """Host only, at the default config (Kimi's: block_m 32, min_split 256, max_splits 32): each real row of a
    17-row tree and of a decode row has plan_mla's block_m, tiles, slots in key order and items, and no item of
    a row's tiles past its splits does any work."""
    config = MLAKernelConfig()
    rng = random.Random(heads)
    tree = random_tree(17, 10, rng)
    P_tree, P_dec = contexts
    bucket = Bucket(3, 17, max(contexts) + 17)
    prefix_t, new_t = torch.arange(P_tree), torch.arange(17) + 200_000
    prefix_d, new_d = torch.arange(P_dec) + 300_000, torch.tensor([400_000])
    meta = AttentionMetadata(
        (SeqAttention(0, 17, prefix_t, new_t, tree.mask()), SeqAttention(17, 1, prefix_d, new_d, None))
    )
    layout = static_plan.MLAStaticLayout(bucket, heads, 1 << 20, torch.device("cpu"), config)
    ints = torch.zeros(layout.int_words, dtype=torch.int32)
    layout.pack(ints, meta.seqs, pad_slot=(1 << 20) - 1)
    plan = layout.bind(ints)["triton"][1]
    got = {(r, h): (slots, items) for r, h, slots, items in _rows_of(plan)}
    eager = plan_mla([MLASeq(17, P_tree, prefix_t, new_t, tree.mask()), MLASeq(1, P_dec, prefix_d, new_d)], heads,
                     config=config)  # fmt: skip
    assert plan.block_m == eager.block_m
    rows = _rows_of(eager)  # eager row r (the tree's 17, then the decode) is bucket row r here: Q = 17
    assert len(rows) == 18 * -(-heads // eager.block_m)
    for row, head0, slots, items in rows:
        assert got[(row, head0)] == (slots, items), f"row {row} head {head0}"
    idle = [it for it in plan.items.tolist() if it[1] == 0 and it[2] == it[3]]
    live = sum(len(items) for _, items in got.values())
    assert len(idle) + live == plan.num_items  # the rest of each tile's items are idle


@pytest.mark.parametrize(
    "config",
    [MLAKernelConfig(), CONFIG, MLAKernelConfig(block_n=32, min_split=48, max_splits=3)],
    ids=["default", "test", "min_split-not-a-block-multiple"],
)
def test_a_bucket_has_items_for_its_longest_splitting_row(config):
    """max_row_splits(K) (a bucket's items per tile) is at least every context's row_splits below K, exactly the
    most when min_split is a multiple of block_n."""
    contexts = torch.arange(20_000)
    most = row_splits(contexts, config).cummax(0).values  # most[K - 1]: the most splits below K
    for K in [1, 2, *range(3, 20_000, 7)]:
        bound = static_plan.max_row_splits(K, config)
        assert bound >= int(most[K - 1]), K
        if config.min_split % config.block_n == 0:
            assert bound == int(most[K - 1]), K

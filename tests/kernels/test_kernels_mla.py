"""MLA attention kernels (kernels/mla_*.py) against their torch references, interpreted on the CPU.

Cases are a grid of named sequences batches: prefix lengths 0 .. 4k, page sizes 1 and 16, trees empty /
chain / wide / random (64 nodes, and 1024 = the drafter's max_budget) / non-topological, decode, prefill
and extend, heads 1 .. 16, fp32 / bf16 / fp16, and the Kimi K2 TP8 shape (8 heads, 512 + 64). Interpreted
kernels are slow, so the latent width is 64 + 16 except where the real shape is the point, and the 4k
prefixes and the 1024-node tree are marked slow. The split and merge kernels are also checked one at a
time against the reference's partials.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ddtree.kernels.checks import is_interpreted
from ddtree.kernels.mla.attention import mla_attention
from ddtree.kernels.mla.checks import kernel_dims
from ddtree.kernels.mla.merge import mla_merge
from ddtree.kernels.mla.plan import MLAKernelConfig, MLASeq, pack_mask_bits, plan_mla
from ddtree.kernels.mla.split import _mla_split_kernel, mla_split_attention
from ddtree.kernels.reference import mla_attention_ref, mla_split_partials_ref
from ddtree.tools.selftest.compare import assert_close
from tests.support.triton_env import DEVICE, triton_interpret_env  # noqa: F401,I001  (before kernels are imported)

SMALL_SPLITS = MLAKernelConfig(block_m=16, min_split=32, target_programs=64)  # many splits at small prefixes


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    seqs: tuple[tuple[int, str, int], ...]  # per sequence: (prefix length, kind, nodes); kinds in new_tokens()
    heads: int = 4
    page_size: int = 1
    dtype: torch.dtype = torch.float32
    r: int = 64
    dr: int = 16
    config: MLAKernelConfig = MLAKernelConfig()

    def __str__(self) -> str:
        return self.name


def new_tokens(kind: str, n: int, gen: torch.Generator) -> tuple[int, torch.Tensor | None]:
    """(q_len, new_mask) of one sequence's new tokens; trees are [root, n nodes] with parent(i) < i."""
    if kind == "decode":  # AR decode: one token, causal (mask None)
        return 1, None
    if kind == "prefill":  # a prefill / extend chunk of n tokens, causal
        return n, None
    if kind == "none":  # a sequence with no new token in this forward
        return 0, None
    if kind == "empty":  # an empty tree: the root alone, through the tree-mask path
        parents = []
    elif kind == "chain":
        parents = list(range(n))
    elif kind == "wide":
        parents = [0] * n
    elif kind in ("tree", "shuffled"):
        parents = [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n + 1)]
    else:
        raise ValueError(kind)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[0, 0] = True
    for i, p in enumerate(parents, start=1):
        mask[i] = mask[p]
        mask[i, i] = True
    if kind == "shuffled":  # node order no longer topological: visibility above the diagonal
        perm = torch.cat([torch.tensor([0]), 1 + torch.randperm(n, generator=gen)])
        mask = mask[perm][:, perm]
    return n + 1, mask


def build(case: Case, seed: int = 0):
    """Random cache, queries and slot / page tables for a case: (q_lat, q_pe, kv, seqs, scale)."""
    gen = torch.Generator().manual_seed(seed)
    ps = case.page_size
    specs = [(p, *new_tokens(kind, n, gen)) for p, kind, n in case.seqs]
    pages_needed = sum(-(-p // ps) for p, _, _ in specs)
    n_new = sum(q for _, q, _ in specs)
    num_pages = pages_needed + -(-n_new // ps) + 3
    S = num_pages * ps
    page_perm = torch.randperm(num_pages, generator=gen)
    used = page_perm[:pages_needed]
    # new tokens go to scattered slots outside the prefix pages
    free = (page_perm[pages_needed:, None] * ps + torch.arange(ps)).flatten()
    free = free[torch.randperm(free.numel(), generator=gen)]
    seqs, po, no = [], 0, 0
    for p, q, mask in specs:
        k = -(-p // ps)
        seqs.append(MLASeq(q, p, used[po : po + k], free[no : no + q], mask))
        po, no = po + k, no + q
    T, H = n_new, case.heads
    kv = torch.randn(S, case.r + case.dr, generator=gen).to(case.dtype)
    q_lat = torch.randn(T, H, case.r, generator=gen).to(case.dtype)
    q_pe = torch.randn(T, H, case.dr, generator=gen).to(case.dtype)
    scale = 2.0 / (case.r + case.dr) ** 0.5  # peaky softmax: the merge has to get the maxima right
    return q_lat.to(DEVICE), q_pe.to(DEVICE), kv.to(DEVICE), seqs, scale


def make_plan(case: Case, seqs, kv):
    return plan_mla(seqs, case.heads, page_size=case.page_size, num_cache_slots=kv.shape[0], device=DEVICE,
                    config=case.config)  # fmt: skip


KIMI = dict(heads=8, r=512, dr=64, dtype=torch.bfloat16)
CASES = [
    # decode (q_len 1 per sequence; the same kernels as a one-node tree)
    Case("decode_prefix1", ((1, "decode", 0),), heads=8),
    Case(
        "decode_batch_ragged", ((1, "decode", 0), (300, "decode", 0), (1000, "decode", 0), (37, "decode", 0)), heads=8
    ),
    Case("decode_split_edges", ((256, "decode", 0), (257, "decode", 0), (512, "decode", 0), (255, "decode", 0))),
    # tree verify
    Case("empty_tree_no_prefix", ((0, "empty", 0),)),
    Case("empty_tree_prefix", ((129, "empty", 0),)),
    Case("chain_16", ((500, "chain", 16),)),
    Case("wide_16", ((200, "wide", 16),)),
    Case("budget_tree_64", ((300, "tree", 64),), heads=2),
    Case("shuffled_tree", ((100, "shuffled", 20),), config=SMALL_SPLITS),
    Case("shuffled_tree_short_prefix", ((10, "shuffled", 12),)),
    Case("trees_many_splits", ((1000, "tree", 16), (90, "chain", 5)), config=SMALL_SPLITS),
    # prefill / extend (causal among the new tokens)
    Case("prefill_no_prefix", ((0, "prefill", 40),)),
    Case("extend_cached_prefix", ((260, "prefill", 33),), config=SMALL_SPLITS),
    # mixed batches, a sequence with no new token, heads 1 .. 16, odd widths
    Case(
        "mixed_batch",
        ((0, "prefill", 20), (700, "tree", 16), (50, "decode", 0), (1, "empty", 0), (10, "none", 0), (33, "wide", 7)),
    ),
    Case("heads_1", ((100, "decode", 0), (64, "tree", 10))),
    Case("heads_3", ((100, "chain", 4), (0, "prefill", 9)), heads=3),
    Case("heads_16", ((300, "tree", 16),), heads=16),
    Case("width_48_8", ((70, "tree", 6), (5, "decode", 0)), r=48, dr=8),
    # paged cache, page_size 16 (partial last pages)
    Case("page16_decode", ((1, "decode", 0), (17, "decode", 0), (300, "decode", 0)), page_size=16),
    Case("page16_tree", ((333, "tree", 16),), page_size=16, config=SMALL_SPLITS),
    Case("page16_extend", ((16, "prefill", 12), (100, "wide", 9)), page_size=16),
    # dtypes
    Case("bf16_mixed", ((0, "prefill", 10), (400, "tree", 16), (3, "decode", 0)), dtype=torch.bfloat16),
    Case("fp16_mixed", ((0, "prefill", 10), (400, "tree", 16), (3, "decode", 0)), dtype=torch.float16),
    Case("kimi_tp8_tree16", ((300, "tree", 16),), **KIMI),
    Case("kimi_tp8_decode_page16", ((300, "decode", 0), (40, "decode", 0)), page_size=16, **KIMI),
]
SLOW_CASES = [
    Case("prefix_4k_tree16_page16", ((4096, "tree", 16),), heads=8, page_size=16),
    Case("prefix_4k_decode_batch", ((4096, "decode", 0), (3000, "decode", 0)), heads=16),
    Case("max_budget_tree_1024", ((40, "tree", 1024),), heads=1),  # the drafter's max_budget: 33 mask words a row
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES], ids=str)
def test_mla_attention_matches_reference(case):
    q_lat, q_pe, kv, seqs, scale = build(case)
    plan = make_plan(case, seqs, kv)
    got = mla_attention(q_lat, q_pe, kv, plan, scale)
    assert_close(case.name, got, mla_attention_ref(q_lat, q_pe, kv, seqs, scale, case.page_size))


PART_CASES = [c for c in CASES if c.name in ("trees_many_splits", "page16_tree", "bf16_mixed", "decode_batch_ragged",
                                              "shuffled_tree", "mixed_batch")]  # fmt: skip


def _merged_rows(plan, H: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [NI, BLOCK_M]: partial rows the split kernel writes; bool [T, H]: output rows the merge writes."""
    seqs, tiles = plan.seqs.cpu().tolist(), plan.tiles.cpu().tolist()
    parts = torch.zeros(plan.num_items, plan.block_m, dtype=torch.bool)
    out = torch.zeros(plan.num_tokens * H, dtype=torch.bool)
    for b, row0, start, n in tiles:
        if n > 1:
            q_start, q_len = seqs[b][:2]
            valid = min(plan.block_m, q_len * H - row0)
            parts[start : start + n, :valid] = True
            out[q_start * H + row0 : q_start * H + row0 + valid] = True
    return parts, out.view(plan.num_tokens, H)


@pytest.mark.parametrize("case", PART_CASES, ids=str)
def test_split_partials_match_reference(case):
    q_lat, q_pe, kv, seqs, scale = build(case, seed=1)
    plan = make_plan(case, seqs, kv)
    dims = kernel_dims(q_lat, q_pe, plan, is_interpreted(_mla_split_kernel))
    out = torch.zeros(q_lat.shape, dtype=torch.float32 if dims.bf16_via_fp32 else q_lat.dtype, device=DEVICE)
    part_o, part_lse = mla_split_attention(q_lat, q_pe, kv, plan, scale, out, dims)
    ref_o, ref_lse = mla_split_partials_ref(q_lat, q_pe, kv, seqs, plan, scale, dims.block_r, case.page_size)
    written, _ = _merged_rows(plan, case.heads)
    assert plan.num_merge_tiles > 0 and written.any()
    assert_close("part_lse", part_lse.cpu()[written], ref_lse[written], **_fp32_tol(case.dtype))
    assert_close("part_o", part_o.cpu()[written], ref_o[written], **_fp32_tol(case.dtype))


@pytest.mark.parametrize("case", PART_CASES, ids=str)
def test_merge_of_reference_partials(case):
    """The merge kernel alone, fed the reference's partials: the rows it writes equal the reference output."""
    q_lat, q_pe, kv, seqs, scale = build(case, seed=2)
    plan = make_plan(case, seqs, kv)
    dims = kernel_dims(q_lat, q_pe, plan, is_interpreted(_mla_split_kernel))
    ref_o, ref_lse = mla_split_partials_ref(q_lat, q_pe, kv, seqs, plan, scale, dims.block_r, case.page_size)
    out = torch.full(q_lat.shape, float("nan"), device=DEVICE)
    mla_merge(plan, ref_o.to(DEVICE), ref_lse.to(DEVICE), out, dims)
    _, rows = _merged_rows(plan, case.heads)
    expected = mla_attention_ref(q_lat.float(), q_pe.float(), kv.float(), seqs, scale, case.page_size)
    assert_close(case.name, out.cpu()[rows], expected.cpu()[rows])
    assert out.cpu()[~rows].isnan().all(), "the merge wrote rows of tiles it does not own"


def _fp32_tol(dtype: torch.dtype) -> dict:
    """Partials are fp32 computed from `dtype` inputs; fp16 rounds P before P·V, so its tolerance applies."""
    return {} if dtype != torch.float16 else dict(abs_tol=None, rel_tol=2.01 / 1024, cos_tol=1e-5)


# ---- the plan ---------------------------------------------------------------------------------------


def test_plan_splits_cover_each_prefix_once():
    case = Case("plan", ((1000, "tree", 16), (0, "prefill", 5), (257, "decode", 0), (40, "none", 0)), heads=8)
    _, _, kv, seqs, _ = build(case)
    # the throughput plan (one split length for the step; the row-invariant plan's splits follow each row:
    # tests/kernels/test_row_invariance_mla.py)
    cfg = MLAKernelConfig(block_n=32, min_split=64, target_programs=16, row_invariant=False)
    plan = plan_mla(seqs, 8, num_cache_slots=kv.shape[0], config=cfg)
    assert plan.split_len % 32 == 0 and plan.split_len >= 64
    tiles, items = plan.tiles.cpu().tolist(), plan.items.cpu().tolist()
    assert len(tiles) == sum(-(-s.q_len * 8 // plan.block_m) for s in seqs)
    assert len(items) == sum(n for *_, n in tiles)
    for t, (b, _row0, part0, n) in enumerate(tiles):
        mine = items[part0 : part0 + n]
        assert [it[:2] for it in mine] == [[t, 1]] + [[t, 0]] * (n - 1)  # the first item has the new tokens
        covered = [p for _, _, k0, k1 in mine for p in range(k0, k1)]
        assert covered == list(range(seqs[b].prefix_len))
        assert all(k1 - k0 <= plan.split_len for _, _, k0, k1 in mine)
    merged = [t for t, tile in enumerate(tiles) if tile[3] > 1]
    assert plan.merge_tiles.cpu().tolist()[: plan.num_merge_tiles] == merged
    # the long prefix is cut into several splits, the short ones are not
    assert max(n for *_, n in tiles) > 2 and min(n for *_, n in tiles) == 1


def test_mask_bits_round_trip():
    gen = torch.Generator().manual_seed(3)
    for q in (1, 31, 32, 33, 65):
        mask = torch.rand(q, q, generator=gen) < 0.5
        bits = pack_mask_bits(mask)  # [q, ceil(q/32)] int32
        assert bits.shape == (q, -(-q // 32)) and bits.dtype == torch.int32
        j = torch.arange(q)
        back = ((bits[:, j // 32].long() >> (j % 32)) & 1).bool()
        assert torch.equal(back, mask)


# ---- wrapper errors -----------------------------------------------------------------------------------


def _small():
    case = Case("err", ((20, "tree", 4), (5, "decode", 0)))
    q_lat, q_pe, kv, seqs, scale = build(case)
    return case, q_lat, q_pe, kv, seqs, scale, make_plan(case, seqs, kv)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: a.update(q_lat=a["q_lat"][:-1]), r"q_lat must be \[T=6, H=4, r\]"),
        (lambda a: a.update(q_pe=a["q_pe"].transpose(0, 1)), "q_pe must be"),
        (lambda a: a.update(q_lat=a["q_lat"].transpose(1, 2).contiguous().transpose(1, 2)), "contiguous in its last"),
        (lambda a: a.update(kv=a["kv"][:, :-1]), r"kv must be \[S, r \+ dr = 80\]"),
        (lambda a: a.update(kv=a["kv"].to(torch.float16)), "dtypes differ"),
        (lambda a: a.update(q_lat=a["q_lat"].to(torch.int32)), "dtype torch.int32 not supported"),
        (lambda a: a.update(kv=a["kv"][:10]), r"addresses slot \d+, the cache has 10 slots"),
    ],
    ids=["T", "q_pe_shape", "stride", "kv_width", "dtype_mismatch", "int_dtype", "short_cache"],
)
def test_attention_wrapper_rejects_bad_inputs(mutate, match):
    _, q_lat, q_pe, kv, _, scale, plan = _small()
    args = dict(q_lat=q_lat, q_pe=q_pe, kv=kv)
    mutate(args)
    with pytest.raises(ValueError, match=match):
        mla_attention(args["q_lat"], args["q_pe"], args["kv"], plan, scale)


def test_plan_rejects_bad_metadata():
    case, _, _, kv, seqs, _, _ = _small()
    S = kv.shape[0]
    s0 = seqs[0]
    bad = [
        (dataclasses.replace(s0, prefix_table=s0.prefix_table[:-1]), "prefix_table has 19 entries, expected 20"),
        (dataclasses.replace(s0, prefix_table=s0.prefix_table.float()), "prefix_table must be an int64"),
        (dataclasses.replace(s0, new_slots=torch.tensor([0, 1, 2, 3, S])), f"slot {S} is out of range"),
        (dataclasses.replace(s0, new_slots=torch.tensor([0, 1, 2, 3, -1])), "negative entry"),
        (dataclasses.replace(s0, new_mask=torch.zeros(5, 5, dtype=torch.bool)), "diagonal all True"),
        (dataclasses.replace(s0, new_mask=torch.ones(5, 4, dtype=torch.bool)), r"new_mask must be bool \[5, 5\]"),
    ]
    for s, match in bad:
        with pytest.raises(ValueError, match=match):
            plan_mla([s, seqs[1]], 4, num_cache_slots=S)
    with pytest.raises(ValueError, match="page .* out of range"):
        plan_mla([dataclasses.replace(s0, prefix_table=torch.arange(2) + S // 16)], 4, page_size=16,
                 num_cache_slots=S)  # fmt: skip
    with pytest.raises(ValueError, match="power of two"):
        MLAKernelConfig(block_m=24)

"""Row invariance of the MLA split + merge kernels (kernels/mla/plan.py `row_invariant`), interpreted on the CPU.

Every row of a verify tree, planned beside other sequences, must give bit for bit the output of its AR twin:
the same query decoded alone (batch 1, one token, no mask) over the committed prefix and then its
ancestors, whose latents the twin reads from its own slots (copies, as AR decoding writes them). So must
every row of a prefill chunk (its ancestors: the chunk's earlier tokens), whatever the chunk's length. Trees of
9 and 17 rows, batches of 1, 3 and 8 (the others mixed in: trees, decode rows, a prefill chunk), prefixes
that cross split boundaries (min_split 32, at most 4 splits a row, so a 200-key prefix splits by 64). The
negative control plans the same step with `row_invariant=False` (splits from the step's work, block_m from
its largest sequence) and must see rows differ: the test can fail.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from ddtree.kernels.mla.attention import mla_attention
from ddtree.kernels.mla.plan import MLAKernelConfig, MLASeq, plan_mla
from ddtree.tools.selftest.invariance import random_tree
from tests.support.triton_env import DEVICE, triton_interpret_env  # noqa: F401,I001  (before kernels are imported)

CONFIG = MLAKernelConfig(block_m=32, block_n=16, min_split=32, max_splits=4, target_programs=64)
HEADS, R, DR = 4, 64, 16
SCALE = 0.125


def _twin_outputs(q_lat, q_pe, kv, prefix, new_slots, ancestors: list, free: int, config) -> torch.Tensor:
    """[n, H, r]: each row decoded alone over the prefix then copies of its ancestors' latents."""
    outs = []
    for i, anc in enumerate(ancestors):
        copies = torch.arange(free, free + len(anc) + 1, dtype=torch.int64)
        kv[copies] = kv[new_slots[[*anc, i]]]  # the twin's own slots, written with the same latents
        table = torch.cat([prefix, copies[:-1]])
        plan = plan_mla([MLASeq(1, table.numel(), table, copies[-1:])], HEADS, device=DEVICE, config=config)
        outs.append(mla_attention(q_lat[i : i + 1], q_pe[i : i + 1], kv, plan, SCALE)[0])
    return torch.stack(outs)


def _step(batch: int, rows: int, seed: int, config: MLAKernelConfig, dtype=torch.float32,
          prefill_first: bool = False) -> tuple[int, int]:  # fmt: skip
    """(rows compared, rows differing) of the first two trees' rows (with prefill_first: of the first
    sequence, a prefill chunk, and the tree after it) against their twins (the other sequences are there to be
    mixed in; comparing them too costs interpreter time only)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    prefixes = [200, 45, 31, 97, 64, 130, 3, 17][:batch]  # across the 32-key splits and the 64-key ones
    kinds = ["tree", "decode", "tree", "prefill", "other", "decode", "other", "other"][:batch]
    if prefill_first:  # a chunk of 40 over 97 keys: its rows' contexts cross 128 (split 32 -> 48)
        kinds = ["prefill", *kinds[1:]]
        prefixes = [97, *prefixes[1:]]
    seqs, trees, next_slot = [], [], 0
    for P, kind in zip(prefixes, kinds, strict=True):
        table = torch.randperm(P + 400, generator=gen)[:P] + next_slot
        next_slot += P + 400
        if kind in ("tree", "other"):
            tree = random_tree(rows, 10, rng)
            n, mask = rows, tree.mask()
            tree = [tree.ancestors(i) for i in range(n)] if kind == "tree" else None
        elif kind == "prefill" and prefill_first and not seqs:
            n, mask = 40, None
            tree = [list(range(i)) for i in range(n)]  # a chunk's row sees the chunk's earlier tokens
        else:
            tree, n, mask = None, 1 if kind == "decode" else 7, None
        new = torch.arange(next_slot, next_slot + n, dtype=torch.int64)
        next_slot += n
        seqs.append(MLASeq(n, P, table, new, mask))
        trees.append(tree)
    T = sum(s.q_len for s in seqs)
    kv = torch.randn(next_slot + 64 * rows, R + DR, generator=gen).to(dtype)
    q_lat = torch.randn(T, HEADS, R, generator=gen).to(dtype)
    q_pe = torch.randn(T, HEADS, DR, generator=gen).to(dtype)
    plan = plan_mla(seqs, HEADS, device=DEVICE, config=config)
    out = mla_attention(q_lat.to(DEVICE), q_pe.to(DEVICE), kv.to(DEVICE), plan, SCALE).cpu()
    compared = differing = 0
    start, free = 0, next_slot
    for s, tree in zip(seqs, trees, strict=True):
        if tree is not None:
            rows_q = slice(start, start + s.q_len)
            twins = _twin_outputs(q_lat[rows_q], q_pe[rows_q], kv, s.prefix_table, s.new_slots, tree, free, CONFIG)
            compared += s.q_len
            differing += sum(not torch.equal(out[start + i], twins[i]) for i in range(s.q_len))
        start += s.q_len
    return compared, differing


@pytest.mark.parametrize(
    ("batch", "rows", "dtype"),
    [(1, 17, torch.float32), (3, 9, torch.bfloat16), (8, 9, torch.bfloat16)],  # fmt: skip
)
def test_tree_rows_equal_their_ar_twins(batch, rows, dtype):
    compared, differing = _step(batch, rows, seed=batch * 100 + rows, config=CONFIG, dtype=dtype)
    assert compared >= rows and differing == 0, f"{differing} of {compared} rows differ from their AR twin"


def test_negative_control_throughput_plan_differs():
    """The same step planned without row invariance: the tree is one multi-row sequence, its splits come
    from the step's work; rows differ from their twins (which stay planned as AR decodes). fp32: a bf16
    output rounds most fp32 differences away."""
    compared, differing = _step(3, 17, seed=317, config=dataclasses.replace(CONFIG, row_invariant=False))
    assert differing > 0, f"all {compared} rows equal their twins without row invariance: the test cannot fail"


def test_split_boundaries_follow_the_row_alone():
    """A row's splits depend on its own prefix length only, never on the batch or the device's programs."""
    table = torch.arange(200, dtype=torch.int64)
    alone = plan_mla([MLASeq(1, 200, table, torch.tensor([300]))], HEADS, config=CONFIG)
    other = MLASeq(17, 5, torch.arange(5) + 400, torch.arange(17) + 410)
    many = plan_mla([MLASeq(1, 200, table, torch.tensor([300])), other], 64 // 16 * 1, config=CONFIG)
    assert alone.items[:, 2:].tolist() == many.items[: alone.num_items, 2:].tolist()
    assert alone.block_m == many.block_m == 16


def test_prefill_chunk_rows_equal_their_ar_twins():
    """A prefill chunk of 40 tokens over 97 keys (contexts 97..136 cross the 128-key point where a row's
    splits grow from 32 to 48 keys), beside two trees and a decode: each chunk row equals the token decoded
    alone, so a prompt's KV does not depend on how it was cut into chunks (or taken from the prefix cache)."""
    compared, differing = _step(
        3, 9, seed=409, config=CONFIG, prefill_first=True
    )  # fp32: no rounding hides a difference
    assert compared >= 40 + 9 and differing == 0, f"{differing} of {compared} rows differ from their AR twin"


def test_negative_control_prefill_chunk_as_one_sequence_differs():
    """The throughput plan tiles the chunk's rows together over one split length: its rows differ from their
    twins (fp32), so the test above can fail."""
    config = dataclasses.replace(CONFIG, row_invariant=False)
    compared, differing = _step(3, 9, seed=409, config=config, prefill_first=True)
    assert differing > 0, f"all {compared} rows equal their twins without row invariance: the test cannot fail"

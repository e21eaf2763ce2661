"""The MLA kernels' plan (mla/plan.py) at a static shape: a bucket's plan in fixed device buffers, row invariant.

For a bucket (B sequences, Q rows, K keys each) every count the kernels launch with is fixed, and every
real row is planned as plan_mla's row-invariant plan plans it: as a decode row (one token, all its heads)
over its context, the sequence's committed prefix and then the new tokens its mask shows (a tree's
ancestors, a prefill chunk's earlier tokens), in row order. So each row has
- ceil(H / block_m) row tiles, block_m from the head count (row_block_m), as plan_mla cuts a decode row;
- the prefix splits of its own context length P_row = P + depth (row_split_len / row_splits: the rule
  plan_mla applies), the tile's first item also attending to the row's own token;
- its partials merged in split order (num_parts = the row's own splits), or its output written directly
  when it has one split,
so it reads its AR twin's keys in the same order, blocks and splits and merges them in the same order,
whatever the bucket and the other rows hold (tests/kernels/test_static_plan_invariance.py).

The grid is fixed per bucket: every tile owns `splits` items, the most splits a context shorter than K
can have (max_row_splits). Items past a row's own splits are idle (kv_start = kv_end, no new token: the split
kernel loads and stores nothing for them, and num_parts does not count them); the merge list is padded
with a tile of no parts (the merge skips it).

Every row of the bucket is a sequence of the plan (B·Q of them, q_len 1): plan sequence r = i·Q + j is
row j of step sequence i, token r of the bucket. Its prefix positions below P_i read sequence i's shared
table, later ones its own tail (the seqs fields shared_len and tail_off, mla/plan.py), so each committed
prefix is written once. A padding row (past a sequence's rows, or of a padding sequence) has prefix 0
and sees its own new slot alone: the pool's pad slot, which no real row sees. So every row sees at least
one key and every value is finite.

Table layout (int32, `int_words` entries, in the step's packed buffer), R = B·Q, NT = R·tiles_per_row:
seqs [R, 9], tiles [NT + 1, 4] (the last: the no-op tile), items [NT·splits, 4] (tile t's at t·splits),
merge_tiles [max(NT, 1)], table [B·K + R·(Q - 1)] (sequence i's prefix at i·K, then row r's tail at
B·K + r·(Q - 1)), new_slots [R], mask_bits [1] (no masks: a row's new part is its own token). Field
meanings are mla/plan.py's.
"""

from __future__ import annotations

import dataclasses

import torch

from ddtree.kernels.mla.plan import (
    ITEM_FIELDS,
    SEQ_FIELDS,
    TILE_FIELDS,
    MLAKernelConfig,
    MLAPlan,
    row_block_m,
    row_split_len,
    row_splits,
)


@dataclasses.dataclass(frozen=True)
class StaticPlanShape:
    """The counts a bucket's static plan launches with, all fixed by the bucket, the head count and the config
    (never by the device or the step)."""

    batch: int
    rows: int
    keys: int
    block_m: int  # rows (heads of one token) per tile: row_block_m of the head count
    tiles_per_row: int  # ceil(H / block_m)
    splits: int  # items per tile: max_row_splits(keys) (idle past a row's own splits)

    @property
    def row_seqs(self) -> int:
        return self.batch * self.rows

    @property
    def tiles(self) -> int:
        return self.row_seqs * self.tiles_per_row

    @property
    def items(self) -> int:
        return self.tiles * self.splits

    @property
    def merge_tiles(self) -> int:
        return self.tiles if self.splits > 1 else 0

    @property
    def tail_len(self) -> int:
        """Table entries of a row's own tail: the other new tokens it may see."""
        return self.rows - 1

    def table_sizes(self) -> dict[str, int]:
        """int32 entries of each table, in the packed order (the module docstring's layout)."""
        return {
            "seqs": self.row_seqs * SEQ_FIELDS,
            "tiles": (self.tiles + 1) * TILE_FIELDS,
            "items": self.items * ITEM_FIELDS,
            "merge_tiles": max(self.merge_tiles, 1),
            "table": self.batch * self.keys + self.row_seqs * self.tail_len,
            "new_slots": self.row_seqs,
            "mask_bits": 1,
        }


def max_row_splits(keys: int, config: MLAKernelConfig) -> int:
    """A bucket's items per tile: at least row_splits(P) for every context P < keys. A row has at most
    max_splits splits (past max_splits · min_split its splits grow) and at most ceil(P / min_split) (none is
    shorter than min_split), both growing with P; the bound is the most splits when min_split is a multiple
    of block_n (the defaults: then P = min(keys - 1, max_splits · min_split) has it; the test checks both)."""
    return max(1, min(config.max_splits, -(-(keys - 1) // config.min_split)))


def static_plan_shape(batch: int, rows: int, keys: int, heads: int, config: MLAKernelConfig) -> StaticPlanShape:
    """The StaticPlanShape of a bucket (batch, rows, keys) at `heads` heads."""
    block_m = row_block_m(heads, config)
    return StaticPlanShape(batch, rows, keys, block_m, -(-heads // block_m), max_row_splits(keys, config))


class MLAStaticLayout:
    """The Triton backend's part of a static batch (models/runtime/static_batch.py)."""

    def __init__(self, bucket, num_heads: int, cache_slots: int, device: torch.device, config: MLAKernelConfig):
        self.bucket, self.num_heads, self.cache_slots, self.device, self.config = (
            bucket, num_heads, cache_slots, device, config
        )  # fmt: skip
        self.shape = sh = static_plan_shape(bucket.batch, bucket.rows, bucket.keys, num_heads, config)
        self._offsets, at = {}, 0
        for name, n in sh.table_sizes().items():
            self._offsets[name] = (at, at + n)
            at += n
        self.int_words = at
        # What never changes: each tile's row (its plan sequence) and first head, each item's tile and split.
        tile = torch.arange(sh.tiles, dtype=torch.int64)
        self._tile_row = tile // sh.tiles_per_row  # [NT]
        self._tile_head0 = tile % sh.tiles_per_row * sh.block_m  # [NT]
        self._item_tile = tile.repeat_interleave(sh.splits)  # [NI]
        self._item_row = self._tile_row.repeat_interleave(sh.splits)  # [NI]
        self._item_split = torch.arange(sh.splits, dtype=torch.int64).repeat(sh.tiles)  # [NI]

    def _view(self, ints: torch.Tensor, name: str) -> torch.Tensor:
        lo, hi = self._offsets[name]
        return ints[lo:hi]

    def bind(self, ints: torch.Tensor) -> dict:
        """The prepared entries over the device tables `ints` (int32 [int_words]): the Triton backend's
        (key, plan) and the write slots."""
        v = lambda name: self._view(ints, name)  # noqa: E731
        sh = self.shape
        plan = MLAPlan(
            v("seqs").view(-1, SEQ_FIELDS), v("tiles").view(-1, TILE_FIELDS), v("items").view(-1, ITEM_FIELDS),
            v("merge_tiles"), v("table"), v("new_slots"), v("mask_bits"),
            num_tokens=self.bucket.tokens, num_heads=self.num_heads, page_size=1, min_cache_slots=self.cache_slots,
            split_len=row_split_len(max(sh.keys - 1, 0), self.config),  # the longest split a row can have
            block_m=sh.block_m, num_merge_tiles=sh.merge_tiles, config=self.config,
        )  # fmt: skip
        key = (self.num_heads, self.device, self.cache_slots, self.config)  # TritonMLAAttention.prepare's key
        return {"triton": (key, plan), "write_slots": v("new_slots")}

    def pack(self, ints: torch.Tensor, seqs, pad_slot: int) -> None:
        """Write the tables of `seqs` (SeqAttention, at most B) into the host `ints`."""
        sh = self.shape
        B, Q, K, R, L = sh.batch, sh.rows, sh.keys, sh.row_seqs, sh.tail_len
        if len(seqs) > B:
            raise ValueError(f"{len(seqs)} sequences do not fit bucket {self.bucket}")
        table = self._view(ints, "table")
        table.zero_()
        new = torch.full((R,), pad_slot, dtype=torch.int64)
        prefix = torch.zeros(B, dtype=torch.int64)
        q_len = torch.zeros(B, dtype=torch.int64)
        sees = torch.zeros(B, Q, Q, dtype=torch.bool)  # [i, j, c]: row j of sequence i sees new token c != j
        for i, s in enumerate(seqs):
            P, n = s.prefix_slots.numel(), s.q_len
            if n > Q or P + n > K:
                raise ValueError(f"sequence {i} ({P} prefix keys, {n} rows) does not fit bucket {self.bucket}")
            prefix[i], q_len[i] = P, n
            table[i * K : i * K + P] = s.prefix_slots
            new[i * Q : i * Q + n] = s.new_slots
            sees[i, :n, :n] = s.visible_new().cpu() & ~torch.eye(n, dtype=torch.bool)
        # Each row's tail: the new tokens it sees, in row order (nonzero is row-major: a row's columns ascend).
        depth = sees.sum(-1).view(R)  # [R]
        i_, j_, c_ = sees.nonzero(as_tuple=True)  # [E] one entry per (row, seen token)
        row = i_ * Q + j_
        rank = torch.arange(row.numel()) - (depth.cumsum(0) - depth)[row]  # the entry's place in its row's tail
        tail_off = B * K + torch.arange(R) * L  # [R]
        table[tail_off[row] + rank] = new[i_ * Q + c_].to(torch.int32)
        self._view(ints, "new_slots").copy_(new)
        real = (torch.arange(Q) < q_len[:, None]).view(R)  # [R]
        shared = torch.where(real, prefix.repeat_interleave(Q), 0)  # [R] committed prefix
        context = shared + depth  # [R] the row's prefix: committed, then its tail (padding rows: 0)
        split = row_split_len(context, self.config)  # [R] the row's own split length (plan_mla's rule)
        n_splits = row_splits(context, self.config)  # [R] <= sh.splits: context <= K - 1
        rows = torch.arange(R)
        seq_rows = torch.zeros(R, SEQ_FIELDS, dtype=torch.int64)
        seq_rows[:, 0] = rows  # q_start: the row's token in the bucket
        seq_rows[:, 1] = 1  # q_len: one token (all its heads)
        seq_rows[:, 2] = context
        seq_rows[:, 3] = rows // Q * K  # table_off: the sequence's shared prefix
        seq_rows[:, 4] = -1  # mask_off: causal (the row's own token)
        seq_rows[:, 5] = 1  # key_bound
        seq_rows[:, 7] = shared
        seq_rows[:, 8] = tail_off
        self._view(ints, "seqs").copy_(seq_rows.flatten())
        NT = sh.tiles
        tiles = torch.zeros(NT + 1, TILE_FIELDS, dtype=torch.int64)  # tiles[NT]: no parts (the merge's no-op)
        tiles[:NT, 0] = self._tile_row
        tiles[:NT, 1] = self._tile_head0
        tiles[:NT, 2] = torch.arange(NT) * sh.splits  # part_start: the tile's first item
        tiles[:NT, 3] = n_splits[self._tile_row]  # num_parts: the row's own splits, not the idle items
        self._view(ints, "tiles").copy_(tiles.flatten())
        merge = torch.full((max(sh.merge_tiles, 1),), NT, dtype=torch.int64)
        merged = torch.nonzero(tiles[:NT, 3] > 1).flatten()
        merge[: merged.numel()] = merged
        self._view(ints, "merge_tiles").copy_(merge)
        # Item = (tile, has_new, kv_start, kv_end): split s of row r covers [s·split_r, min((s + 1)·split_r,
        # context_r)) while s < n_splits_r, as plan_mla cuts it; past that the item is idle, [0, 0) with no new.
        r, s = self._item_row, self._item_split
        live = s < n_splits[r]
        start = torch.where(live, s * split[r], 0)
        end = torch.where(live, torch.minimum((s + 1) * split[r], context[r]), 0)
        items = torch.stack([self._item_tile, (s == 0).to(torch.int64), start, end], dim=1)
        self._view(ints, "items").copy_(items.flatten())
        self._view(ints, "mask_bits").zero_()

    def upload(self) -> None:
        """Nothing of its own: its tables travel in the step's packed buffer."""

    def device_tensors(self) -> list[torch.Tensor]:
        return []

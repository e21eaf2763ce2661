"""The MLA kernels' plan (mla/plan.py) at a static shape: a bucket's plan in fixed device buffers.

For a bucket (B sequences, Q rows, K keys each) every count the kernels launch with is fixed: each
sequence has q_len = Q (its rows past the step's q_b are padding), ceil(Q·H / block_m) row tiles, and
every tile the same number of prefix splits, ceil((K - 1) / split_len) (at least one), with split_len
chosen for a full bucket as plan_mla chooses it. Per step only values change: a split past a sequence's
real prefix is empty (kv_start = kv_end; its partial has lse -inf and weighs 0 in the merge), a padding
sequence has prefix 0. Each sequence carries an explicit mask: its real rows' causal or tree mask, and
for each padding row itself alone; a padding row's new slot is the pool's pad slot. So every row sees at
least one key, every value is finite, and no real row sees the pad slot.

Table layout (int32, `int_words` entries, in the step's packed buffer): seqs [B, 8], tiles [NT, 4],
items [NI, 4], merge_tiles [max(NM, 1)], table [B·K] (sequence i's prefix at i·K), new_slots [B·Q],
mask_bits [B·Q·W] (W = ceil(Q / 32); sequence i's rows at i·Q·W). Field meanings are mla/plan.py's.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ddtree.kernels.mla.plan import (
    ITEM_FIELDS,
    SEQ_FIELDS,
    TILE_FIELDS,
    MLAKernelConfig,
    MLAPlan,
    num_sms,
    pack_mask_bits,
)


@dataclasses.dataclass(frozen=True)
class StaticPlanShape:
    """The counts a bucket's static plan launches with, all fixed by the bucket and the device's programs."""

    batch: int
    rows: int
    keys: int
    block_m: int  # rows (token, head) per tile
    tiles_per_seq: int
    split_len: int  # prefix keys per split
    splits: int  # splits per tile (empty ones past a sequence's prefix)

    @property
    def tiles(self) -> int:
        return self.batch * self.tiles_per_seq

    @property
    def items(self) -> int:
        return self.tiles * self.splits

    @property
    def merge_tiles(self) -> int:
        return self.tiles if self.splits > 1 else 0

    @property
    def words_per_row(self) -> int:
        return -(-self.rows // 32)

    def table_sizes(self) -> dict[str, int]:
        """int32 entries of each table, in the packed order (the module docstring's layout)."""
        B, Q = self.batch, self.rows
        return {
            "seqs": B * SEQ_FIELDS,
            "tiles": self.tiles * TILE_FIELDS,
            "items": self.items * ITEM_FIELDS,
            "merge_tiles": max(self.merge_tiles, 1),
            "table": B * self.keys,
            "new_slots": B * Q,
            "mask_bits": B * Q * self.words_per_row,
        }


def static_plan_shape(batch: int, rows: int, keys: int, heads: int, programs: int, config: MLAKernelConfig):
    """The StaticPlanShape of a bucket on a device that runs `programs` prefix programs at once (its SMs):
    split_len as plan_mla chooses it for a full bucket; a prefix is at most keys - 1 long."""
    block_m = min(config.block_m, max(16, 1 << (rows * heads - 1).bit_length()))
    per_seq = -(-rows * heads // block_m)
    work = batch * keys * per_seq  # a full bucket's prefix work, as plan_mla counts it
    bn = config.block_n
    split_len = max(config.min_split, -(-math.ceil(work / max(1, programs)) // bn) * bn)
    return StaticPlanShape(batch, rows, keys, block_m, per_seq, split_len, max(1, -(-(keys - 1) // split_len)))


class MLAStaticLayout:
    """The Triton backend's part of a static batch (models/runtime/static_batch.py)."""

    def __init__(self, bucket, num_heads: int, cache_slots: int, device: torch.device, config: MLAKernelConfig):
        self.bucket, self.num_heads, self.cache_slots, self.device, self.config = (
            bucket, num_heads, cache_slots, device, config
        )  # fmt: skip
        programs = config.target_programs or num_sms(device)
        shape = static_plan_shape(bucket.batch, bucket.rows, bucket.keys, num_heads, programs, config)
        self.block_m, self.tiles_per_seq = shape.block_m, shape.tiles_per_seq
        self.split_len, self.splits = shape.split_len, shape.splits
        self.num_merge_tiles, self.words_per_row = shape.merge_tiles, shape.words_per_row
        NT = shape.tiles
        sizes = shape.table_sizes()
        self._offsets, at = {}, 0
        for name, n in sizes.items():
            self._offsets[name] = (at, at + n)
            at += n
        self.int_words = at
        # The tiles, merge list and items' (tile, has_new) never change: packed once, copied by every pack.
        tiles = [[b, r0, t * self.splits, self.splits] for t, (b, r0) in enumerate(self._tile_rows())]
        self._tiles = torch.tensor(tiles, dtype=torch.int32).view(-1, TILE_FIELDS)
        self._merge = torch.arange(max(self.num_merge_tiles, 1), dtype=torch.int32) * (self.num_merge_tiles > 0)
        split = torch.arange(self.splits, dtype=torch.int32)
        self._item_tile = torch.arange(NT, dtype=torch.int32).repeat_interleave(self.splits)  # [NI]
        self._item_first = (split == 0).to(torch.int32).repeat(NT)  # [NI]
        self._item_split = split.repeat(NT)  # [NI] the item's split within its tile

    def _tile_rows(self):
        Q, H = self.bucket.rows, self.num_heads
        return [(b, r0) for b in range(self.bucket.batch) for r0 in range(0, Q * H, self.block_m)]

    def _view(self, ints: torch.Tensor, name: str) -> torch.Tensor:
        lo, hi = self._offsets[name]
        return ints[lo:hi]

    def bind(self, ints: torch.Tensor) -> dict:
        """The prepared entries over the device tables `ints` (int32 [int_words]): the Triton backend's
        (key, plan) and the write slots."""
        v = lambda name: self._view(ints, name)  # noqa: E731
        plan = MLAPlan(
            v("seqs").view(-1, SEQ_FIELDS), v("tiles").view(-1, TILE_FIELDS), v("items").view(-1, ITEM_FIELDS),
            v("merge_tiles"), v("table"), v("new_slots"), v("mask_bits"),
            num_tokens=self.bucket.tokens, num_heads=self.num_heads, page_size=1, min_cache_slots=self.cache_slots,
            split_len=self.split_len, block_m=self.block_m, num_merge_tiles=self.num_merge_tiles, config=self.config,
        )  # fmt: skip
        key = (self.num_heads, self.device, self.cache_slots, self.config)  # TritonMLAAttention.prepare's key
        return {"triton": (key, plan), "write_slots": v("new_slots")}

    def pack(self, ints: torch.Tensor, seqs, pad_slot: int) -> None:
        """Write the tables of `seqs` (SeqAttention, at most B) into the host `ints`."""
        B, Q, K = self.bucket.batch, self.bucket.rows, self.bucket.keys
        W = self.words_per_row
        seq_rows = torch.zeros(B, SEQ_FIELDS, dtype=torch.int32)
        table, new = self._view(ints, "table"), self._view(ints, "new_slots")
        masks = self._view(ints, "mask_bits").view(B, Q, W)
        table.zero_()
        new.fill_(pad_slot)
        prefix = torch.zeros(B, dtype=torch.int32)
        padding_mask = torch.eye(Q, dtype=torch.bool)
        padding_bits = pack_mask_bits(padding_mask)
        masks.copy_(padding_bits.expand(B, Q, W))
        key_bound = torch.ones(B, dtype=torch.int32)
        for i, s in enumerate(seqs):
            P, n = s.prefix_slots.numel(), s.q_len
            if P > K - 1 or n > Q:
                raise ValueError(f"sequence {i} ({P} prefix keys, {n} rows) does not fit bucket {self.bucket}")
            prefix[i] = P
            table[i * K : i * K + P] = s.prefix_slots
            new[i * Q : i * Q + n] = s.new_slots
            mask = padding_mask.clone()
            mask[:n, :n] = s.visible_new().cpu()
            masks[i] = pack_mask_bits(mask)
            key_bound[i] = 0 if bool(mask.triu(1).any()) else 1
        rows = torch.arange(B, dtype=torch.int32)
        seq_rows[:, 0] = rows * Q  # q_start
        seq_rows[:, 1] = Q  # q_len: padding rows included
        seq_rows[:, 2] = prefix
        seq_rows[:, 3] = rows * K  # table_off
        seq_rows[:, 4] = rows * Q * W  # mask_off
        seq_rows[:, 5] = key_bound
        seq_rows[:, 6] = W
        self._view(ints, "seqs").copy_(seq_rows.flatten())
        self._view(ints, "tiles").copy_(self._tiles.flatten())
        self._view(ints, "merge_tiles").copy_(self._merge)
        # Item = (tile, has_new, kv_start, kv_end): split j of a tile of sequence b covers
        # [min(P_b, j·split_len), min(P_b, (j + 1)·split_len)), empty past the prefix.
        item_prefix = prefix.repeat_interleave(self.tiles_per_seq * self.splits)  # [NI]
        start = torch.minimum(self._item_split * self.split_len, item_prefix)
        end = torch.minimum((self._item_split + 1) * self.split_len, item_prefix)
        items = torch.stack([self._item_tile, self._item_first, start, end], dim=1)
        self._view(ints, "items").copy_(items.flatten())

    def upload(self) -> None:
        """Nothing of its own: its tables travel in the step's packed buffer."""

    def device_tensors(self) -> list[torch.Tensor]:
        return []

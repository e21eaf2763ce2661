"""Work plan for the MLA attention kernels, packed once per forward and shared by every layer.

One batch = sequences laid end to end in the rows of q_lat [T, H, r]. Sequence b owns tokens
q_start .. q_start + q_len - 1; its *rows* are the (token, head) pairs, row m = token·H + head, so all H
heads of a token sit in neighbouring rows and one tile of BLOCK_M rows holds every head of
BLOCK_M / H tokens (the "head packing": one latent block read serves all of them).

Each sequence sees
- its committed prefix (P tokens, no mask), addressed through a table: slot(p) = table[p // page_size]
  · page_size + p % page_size (page_size 1: the table *is* the slot table);
- its own new tokens (slots `new_slots`, already written to the cache) under `new_mask`
  (None = causal: decode, prefill / extend; a tree's ancestor mask for verify).

Two kernels do the work (see mla/attention.py):
1. split (mla/split.py): one program per work item = (row tile, prefix split of `split_len` tokens, no
   mask); the tile's first item also attends to its new tokens (under the mask). A program runs an
   online softmax over its keys and writes a partial (o normalised, lse) per row, or, when the tile
   has a single item (short prefix), the final output directly;
2. merge (mla/merge.py): one program per (row, value block) of every tile with several items: an LSE
   merge of the tile's partials, vectorised over the items. It is a small reduction, spread over many
   programs so that long prefixes (many partials) do not funnel through a few SMs.

Packed layout (all int32, one host->device copy per plan):
- seqs   [B, 9]: q_start, q_len, prefix_len, table_off, mask_off (-1 = causal), key_bound, mask_words,
           shared_len, tail_off
           key_bound 1 = no row sees a new token after itself (causal, or a lower-triangular mask
           such as a tree in topological order), so a tile stops at its last token.
           Prefix position p < shared_len has its slot / page at table[table_off + p], a later one at
           table[tail_off + p - shared_len] (slots only). plan_mla's tables are whole (shared_len =
           prefix_len); a static plan (mla/static_plan.py) shares a sequence's committed prefix between
           its rows and gives each row a tail of its own (its ancestors' slots).
- tiles  [NT, 4]: seq, row_start, part_start, num_parts  (its items are contiguous)
- items  [NI, 4]: tile, has_new, kv_start, kv_end       (prefix positions [kv_start, kv_end); has_new on
                  the tile's first item only)
- merge_tiles [NM]: the tiles with num_parts > 1
- table  [sum ceil(P_b / page_size)]: slot ids or page ids
- new_slots [T]
- mask_bits [sum q_len_b · ceil(q_len_b / 32)]: row i of sequence b sees new token j iff bit j % 32
  of word mask_off + i · mask_words + j // 32 is set.

Split choice (row_invariant, the default): a row's splits come from its own prefix length alone
(row_split_len: min_split, longer past max_splits splits), block_m from the head count (row_block_m), and
every new token (a tree's rows, a prefill chunk's) is planned as a decode row, so a row reads its AR twin's
keys in the same order, blocks and splits, and is merged in the same order, whatever else the step holds
and however its prompt was cut into chunks (_decode_rows; the price: a chunk's tokens no longer share a
tile's key reads when the heads leave room in it, docs/performance.md). The throughput plan
(row_invariant=False, the negative control) aims at `target_programs` prefix programs (default: one per
SM, a single wave): split_len = max(min_split, round_up(Σ_b tiles_b · P_b / target_programs, block_n)),
so long prefixes are cut into many splits and short ones into one. Fewer, longer splits would leave SMs
idle; more, shorter ones cost a fp32 partial (BLOCK_M × r × 4 bytes) per split, written and read again
by the merge.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import torch

SEQ_FIELDS = 9
TILE_FIELDS = 4
ITEM_FIELDS = 4
_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class MLASeq:
    """One sequence's attention work (host tensors preferred: the plan is built on the host)."""

    q_len: int  # new tokens (query rows / H)
    prefix_len: int  # committed tokens seen by every new token
    prefix_table: torch.Tensor  # int64 [ceil(prefix_len / page_size)] slot ids (page_size 1) or page ids
    new_slots: torch.Tensor  # int64 [q_len] cache slots of the new tokens (already written)
    new_mask: torch.Tensor | None = None  # bool [q_len, q_len], True = row may see col; None = causal


@dataclasses.dataclass(frozen=True)
class MLAKernelConfig:
    """Block sizes and split policy. The defaults fit Kimi / DeepSeek shapes (512 + 64, bf16) in registers:
    on sm_90 the split kernel at block_m 32 does not spill; block_m 64 reaches wgmma but spills
    (`python -m scripts.bench.bench_kernels --compile-only` prints registers and spills; docs/performance.md).
    `--sweep` times the alternatives on a GPU. mla_split launches it fitted to the device's shared memory
    (smaller_mla_configs, kernels/shared_memory.py), and smaller on OutOfResources; block_m is the plan's."""

    block_m: int = 32  # rows (token, head) per program; capped at the largest sequence's row count
    block_n: int = 32  # keys per inner step
    num_warps: int = 8
    num_stages: int = 2
    min_split: int = 256  # shortest prefix split, tokens
    target_programs: int = 0  # prefix programs to aim for; 0 = the device's SM count (8 on the CPU)
    # Row invariance (the module docstring): a row's splits from its own context length, block_m from the
    # head count, every new token planned as a decode row. False: the throughput plan (splits from the whole
    # step's work over target_programs, block_m from the largest sequence), kept as the negative control.
    # Static plans (mla/static_plan.py) are row invariant either way.
    row_invariant: bool = True
    max_splits: int = 32  # row invariant: prefix splits of one row at most (split_len grows past that)

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if (self.min_split < 1 or self.target_programs < 0 or self.num_warps < 1 or self.num_stages < 1
                or self.max_splits < 1):  # fmt: skip
            raise ValueError(f"bad kernel config {self}")


def smaller_mla_configs(cfg: MLAKernelConfig) -> Iterator[MLAKernelConfig]:
    """Ever smaller split-kernel configs, to retry a launch that ran out of shared memory: block_n halved down
    to 16, then num_stages down by one to 1 (last: one stage keeps a second copy of c_kv, mla_smem_bytes).
    block_m never changes (the plan's tiles are cut by it); a halved block_n still divides split_len (a
    multiple of the original)."""
    while cfg.block_n > 16:
        cfg = dataclasses.replace(cfg, block_n=cfg.block_n // 2)
        yield cfg
    for stages in range(cfg.num_stages - 1, 0, -1):
        cfg = dataclasses.replace(cfg, num_stages=stages)
        yield cfg


def mla_smem_bytes(cfg: MLAKernelConfig, block_m: int, block_r: int, block_dr: int, kv_bytes: int) -> int:
    """Shared memory of the split kernel as Triton 3.9 allocates it (kernels/shared_memory.py; fitted to its
    compiled kernels for sm_90 / sm_120 with 16-byte aligned pointers, a bound from above): the tile's q_lat
    and q_pe rows; fp32 scores and their cast p [BLOCK_M, BLOCK_N]; per key row c_kv and k_pe once when
    pipelined (num_stages >= 2, a few bytes more per stage above 2), c_kv twice at one stage."""
    s, w = kv_bytes, block_r + block_dr
    key_row = w * s + 8 * max(0, cfg.num_stages - 2) if cfg.num_stages >= 2 else 2 * block_r * s
    return block_m * w * s + block_m * cfg.block_n * (4 + s) + cfg.block_n * key_row


@dataclasses.dataclass(frozen=True, eq=False)
class MLAPlan:
    seqs: torch.Tensor  # int32 [B, SEQ_FIELDS]
    tiles: torch.Tensor  # int32 [NT, TILE_FIELDS]
    items: torch.Tensor  # int32 [NI, ITEM_FIELDS]
    merge_tiles: torch.Tensor  # int32 [>= 1] (first num_merge_tiles entries)
    table: torch.Tensor  # int32 [>= 1]
    new_slots: torch.Tensor  # int32 [>= 1]
    mask_bits: torch.Tensor  # int32 [>= 1]
    num_tokens: int  # T
    num_heads: int  # H
    page_size: int
    min_cache_slots: int  # the cache must have at least this many slots (largest addressed slot + 1)
    split_len: int
    block_m: int
    num_merge_tiles: int
    config: MLAKernelConfig

    @property
    def device(self) -> torch.device:
        return self.seqs.device

    @property
    def num_tiles(self) -> int:
        return self.tiles.shape[0]

    @property
    def num_items(self) -> int:
        return self.items.shape[0]


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def pack_mask_bits(mask: torch.Tensor) -> torch.Tensor:
    """bool [q, q] -> int32 [q, ceil(q / 32)]: bit j % 32 of word j // 32 = mask[:, j]."""
    q = mask.shape[0]
    words = (q + 31) // 32
    padded = torch.zeros(q, words * 32, dtype=torch.int64)
    padded[:, :q] = mask.to("cpu", torch.int64)
    packed = (padded.view(q, words, 32) << torch.arange(32, dtype=torch.int64)).sum(-1)  # [q, words] < 2^32
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # same bits, two's complement


def plan_mla(
    seqs: list[MLASeq] | tuple[MLASeq, ...],
    num_heads: int,
    *,
    page_size: int = 1,
    num_cache_slots: int | None = None,
    device: torch.device | str = "cpu",
    config: MLAKernelConfig | None = None,
) -> MLAPlan:
    """Validate the batch and pack it for the kernels (one host->device copy): row invariant, every new token
    a decode row (_decode_rows); else the throughput plan (_throughput_tiles).

    `num_cache_slots`: when given, every addressed slot / page is checked against it here (once per
    forward); the kernels then only check that the cache they get is at least `min_cache_slots` long.
    """
    config = config or MLAKernelConfig()
    device = torch.device(device)
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    checked, max_slot = [], -1
    for i, s in enumerate(seqs):
        if s.q_len < 0 or s.prefix_len < 0:
            raise ValueError(f"seqs[{i}]: q_len {s.q_len} / prefix_len {s.prefix_len} must be >= 0")
        table = _host_index(s.prefix_table, -(-s.prefix_len // page_size), f"seqs[{i}].prefix_table")
        slots = _host_index(s.new_slots, s.q_len, f"seqs[{i}].new_slots")
        if table.numel():
            if int(table.min()) < 0:
                raise ValueError(f"seqs[{i}].prefix_table has a negative entry {int(table.min())}")
            top = int(table.max())
            max_slot = max(max_slot, top * page_size + page_size - 1 if page_size > 1 else top)
        if slots.numel():
            if int(slots.min()) < 0:
                raise ValueError(f"seqs[{i}].new_slots has a negative entry {int(slots.min())}")
            max_slot = max(max_slot, int(slots.max()))
        mask = s.new_mask
        if mask is not None:
            if mask.shape != (s.q_len, s.q_len) or mask.dtype != torch.bool:
                raise ValueError(f"seqs[{i}].new_mask must be bool [{s.q_len}, {s.q_len}], got {mask.dtype} "
                                 f"{tuple(mask.shape)}")  # fmt: skip
            mask = mask.cpu()
            if not bool(mask.diagonal().all()):
                raise ValueError(f"seqs[{i}].new_mask: every new token must see itself (diagonal all True)")
        checked.append(MLASeq(s.q_len, s.prefix_len, table, slots, mask))
    if num_cache_slots is not None and max_slot >= num_cache_slots:
        what = "slot" if page_size == 1 else f"page (page_size {page_size}) reaching slot"
        raise ValueError(f"a {what} {max_slot} is out of range for a cache of {num_cache_slots} slots")
    if max_slot > _INT32_MAX:
        raise ValueError("slot ids and packed metadata must fit int32")

    if config.row_invariant:
        if page_size > 1 and any(s.q_len > 1 for s in checked):  # rows with tails read slots (split.py)
            checked, page_size = [_as_slots(s, page_size) for s in checked], 1
        parts, block_m, split_len, n_merge = _decode_rows(checked, num_heads, config)
    else:
        parts, block_m, split_len, n_merge = _throughput_tiles(checked, num_heads, config, device)
    if max(p.numel() for p in parts) > _INT32_MAX:
        raise ValueError("slot ids and packed metadata must fit int32")
    flat = torch.cat([p.flatten() for p in parts]).to(torch.int32).to(device)
    views, off = [], 0
    for p in parts:
        views.append(flat[off : off + p.numel()].view(p.shape))
        off += p.numel()
    return MLAPlan(*views, num_tokens=sum(s.q_len for s in checked), num_heads=num_heads,  # type: ignore[misc]
                   page_size=page_size, min_cache_slots=max_slot + 1, split_len=split_len, block_m=block_m,
                   num_merge_tiles=n_merge, config=config)  # fmt: skip


def _decode_rows(seqs: list[MLASeq], num_heads: int, config: MLAKernelConfig) -> tuple[list, int, int, int]:
    """Row invariant: every new token is planned as the decode row its AR twin is, vectorised (a prefill chunk
    has thousands of rows). Row t of sequence b is plan sequence t (q_len 1): its context is b's committed
    prefix (shared_len, b's table) and then the other new tokens of b it sees, in row order (its tail): a
    causal chunk's earlier tokens (one tail, b's new slots, shared by the chunk's rows), a tree's ancestors
    (a tail per row). Its own token is its new part. Tiles: ceil(H / block_m) per row, block_m from the head
    count; items: the row's own splits (row_split_len of its context). Returns (parts, block_m, split_len,
    merge tiles), parts in MLAPlan's field order."""
    block_m = row_block_m(num_heads, config)
    per_row = -(-num_heads // block_m)
    tables, table_off, shared, depth, tail_off, at = [], [], [], [], [], 0
    for s in seqs:  # shared prefixes first; the tails after them (offsets fixed up below)
        tables.append(s.prefix_table)
        table_off.append(torch.full((s.q_len,), at, dtype=torch.int64))
        shared.append(torch.full((s.q_len,), s.prefix_len, dtype=torch.int64))
        at += s.prefix_table.numel()
    tails = []
    for s in seqs:
        if s.new_mask is None:  # causal: row j sees tokens 0..j-1, the first j entries of one shared tail
            depth.append(torch.arange(s.q_len, dtype=torch.int64))
            tail_off.append(torch.full((s.q_len,), at, dtype=torch.int64))
            tails.append(s.new_slots if s.q_len > 1 else s.new_slots[:0])
        else:  # a mask: row j's tail lists the other tokens its row shows, ascending (nonzero is row-major)
            sees = s.new_mask & ~torch.eye(s.q_len, dtype=torch.bool)
            d = sees.sum(-1)
            depth.append(d)
            tail_off.append(at + d.cumsum(0) - d)
            tails.append(s.new_slots[sees.nonzero(as_tuple=True)[1]])
        at += tails[-1].numel()
    cat = lambda xs: torch.cat([*xs, torch.zeros(0, dtype=torch.int64)])  # noqa: E731
    shared_len, row_depth = cat(shared), cat(depth)
    context = shared_len + row_depth  # [R] keys before the row's own token
    R = context.numel()
    rows = torch.arange(R)
    seq_rows = torch.stack([rows, torch.ones_like(rows), context, cat(table_off), torch.full_like(rows, -1),
                            torch.ones_like(rows), torch.zeros_like(rows), shared_len, cat(tail_off)], dim=1)  # fmt: skip
    split = row_split_len(context, config)  # [R]
    n_splits = row_splits(context, config)  # [R] >= 1
    tile_row = rows.repeat_interleave(per_row)  # [NT]
    parts = n_splits[tile_row]
    part_start = parts.cumsum(0) - parts
    tiles = torch.stack([tile_row, torch.arange(R * per_row) % per_row * block_m, part_start, parts], dim=1)
    item_tile = torch.arange(R * per_row).repeat_interleave(parts)  # [NI]
    s_ = torch.arange(item_tile.numel()) - part_start[item_tile]  # the item's split within its row
    r_ = tile_row[item_tile]
    start = s_ * split[r_]
    items = torch.stack([item_tile, (s_ == 0).long(), start, torch.minimum(start + split[r_], context[r_])], dim=1)
    merged = torch.nonzero(parts > 1).flatten()
    longest = int(split[n_splits > 1].max()) if bool((n_splits > 1).any()) else config.min_split
    zero = torch.zeros(1, dtype=torch.int64)
    return (
        [seq_rows.view(-1, SEQ_FIELDS), tiles.view(-1, TILE_FIELDS), items.view(-1, ITEM_FIELDS),
         torch.cat([merged, zero]), torch.cat([*tables, *tails, zero]), cat([s.new_slots for s in seqs] + [zero]),
         zero.clone()],
        block_m, longest, merged.numel(),
    )  # fmt: skip


def _throughput_tiles(seqs: list[MLASeq], num_heads: int, config: MLAKernelConfig,
                      device: torch.device) -> tuple[list, int, int, int]:  # fmt: skip
    """The throughput plan (row_invariant False, the negative control): each sequence's rows cut into tiles of
    block_m (from the largest sequence) under its mask, prefix splits of one length for the whole step, from
    its work over target_programs. Returns what _decode_rows returns."""
    block_m = row_block_m(max((s.q_len * num_heads for s in seqs), default=1), config)
    seq_rows, masks, T, table_len, mask_len = [], [], 0, 0, 0
    for s in seqs:
        mask_off, key_bound, words = -1, 1, 0
        if s.new_mask is not None:
            bits = pack_mask_bits(s.new_mask)
            mask_off, words = mask_len, bits.shape[1]
            key_bound = 0 if bool(s.new_mask.triu(1).any()) else 1
            masks.append(bits.flatten())
            mask_len += bits.numel()
        seq_rows.append([T, s.q_len, s.prefix_len, table_len, mask_off, key_bound, words, s.prefix_len, 0])
        T += s.q_len
        table_len += s.prefix_table.numel()
    tile_rows = [(b, r0) for b, s in enumerate(seqs) for r0 in range(0, s.q_len * num_heads, block_m)]
    work = sum(s.prefix_len * -(-s.q_len * num_heads // block_m) for s in seqs)
    target = config.target_programs or num_sms(device)
    bn = config.block_n
    split_len = max(config.min_split, -(-math.ceil(work / max(1, target)) // bn) * bn)
    tiles, items = [], []
    for t, (b, r0) in enumerate(tile_rows):
        P = seqs[b].prefix_len
        starts = range(0, P, split_len) or range(1)  # P == 0: one item, the new tokens alone
        tiles.append([b, r0, len(items), len(starts)])
        items.extend([t, int(k0 == 0), k0, min(P, k0 + split_len)] for k0 in starts)
    merge_tiles = [t for t, tile in enumerate(tiles) if tile[3] > 1]
    zero = torch.zeros(1, dtype=torch.int64)
    return (
        [torch.tensor(seq_rows, dtype=torch.int64).view(-1, SEQ_FIELDS),
         torch.tensor(tiles, dtype=torch.int64).view(-1, TILE_FIELDS),
         torch.tensor(items, dtype=torch.int64).view(-1, ITEM_FIELDS),
         torch.tensor(merge_tiles + [0], dtype=torch.int64),
         torch.cat([*(s.prefix_table for s in seqs), zero]),  # +1: never empty
         torch.cat([*(s.new_slots for s in seqs), zero]),
         torch.cat([*(m.long() for m in masks), zero])],
        block_m, split_len, len(merge_tiles),
    )  # fmt: skip


def row_block_m(max_rows: int, config: MLAKernelConfig) -> int:
    """Rows per tile for sequences of at most `max_rows` rows (token, head): config.block_m, or the power of two
    (>= 16, tl.dot's least) that holds them. Row invariant: max_rows is the head count (one decode row)."""
    return min(config.block_m, max(16, 1 << (max_rows - 1).bit_length()))


def row_split_len(prefix_len, config: MLAKernelConfig):
    """Row invariant: the prefix split of a row whose prefix is `prefix_len` keys, from that length alone:
    min_split, or longer (a multiple of block_n) so that the row has at most max_splits splits. `prefix_len`
    is an int, or an int64 tensor of them (a static plan packs a bucket's rows at once: the same rule)."""
    bn = config.block_n
    per_split = -(-prefix_len // config.max_splits)  # ceil(P / max_splits)
    cut = -(-per_split // bn) * bn  # rounded up to whole key blocks
    return cut.clamp(min=config.min_split) if isinstance(cut, torch.Tensor) else max(config.min_split, cut)


def row_splits(prefix_len, config: MLAKernelConfig):
    """Row invariant: the work items of a row whose prefix is `prefix_len` keys (int or int64 tensor): its
    prefix splits of row_split_len, at least one (an empty prefix: the new token alone)."""
    n = -(-prefix_len // row_split_len(prefix_len, config))
    return n.clamp(min=1) if isinstance(n, torch.Tensor) else max(1, n)


def _as_slots(s: MLASeq, page_size: int) -> MLASeq:
    """The (checked) sequence with its page table expanded to the slot of every prefix position."""
    pos = torch.arange(s.prefix_len, dtype=torch.int64)
    return dataclasses.replace(s, prefix_table=s.prefix_table[pos // page_size] * page_size + pos % page_size)


def _host_index(t: torch.Tensor, n: int, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be an int64 [{n}] tensor, got {getattr(t, 'dtype', type(t))} "
                         f"{tuple(getattr(t, 'shape', ()))}")  # fmt: skip
    if t.numel() != n:
        raise ValueError(f"{name} has {t.numel()} entries, expected {n}")
    return t.to("cpu", torch.int64)

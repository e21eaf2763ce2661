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
a tree's rows are planned as decode rows, so a row reads its AR twin's keys in the same order, blocks and
splits, and is merged in the same order, whatever else the step holds. The throughput plan
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
    # head count, a tree's rows planned as decode rows. False: the throughput plan (splits from the whole
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
    # The sequences the tiles index (row invariance plans a tree's rows as decodes; a static plan: none)
    planned: tuple = dataclasses.field(default=(), repr=False)

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
    """Validate the batch and pack it for the kernels (one host->device copy).

    `num_cache_slots`: when given, every addressed slot / page is checked against it here (once per
    forward); the kernels then only check that the cache they get is at least `min_cache_slots` long.
    """
    config = config or MLAKernelConfig()
    device = torch.device(device)
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if config.row_invariant and any(s.new_mask is not None and s.q_len > 1 for s in seqs):
        if page_size > 1:  # a row's own table lists its ancestors' slots: every table as slots
            seqs = [_as_slots(s, page_size, i, num_cache_slots) for i, s in enumerate(seqs)]
            page_size = 1
        seqs = [r for s in seqs for r in _rows_as_decodes(s)]
    max_rows = num_heads if config.row_invariant else max((s.q_len * num_heads for s in seqs), default=1)
    block_m = row_block_m(max_rows, config)
    tables, new_slots, masks = [], [], []
    seq_rows, max_slot, T, table_len, mask_len = [], -1, 0, 0, 0
    for i, s in enumerate(seqs):
        if s.q_len < 0 or s.prefix_len < 0:
            raise ValueError(f"seqs[{i}]: q_len {s.q_len} / prefix_len {s.prefix_len} must be >= 0")
        n_pages = -(-s.prefix_len // page_size)
        table = _host_index(s.prefix_table, n_pages, f"seqs[{i}].prefix_table")
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
        mask_off, key_bound, words = -1, 1, 0
        if s.new_mask is not None:
            m = s.new_mask
            if m.shape != (s.q_len, s.q_len) or m.dtype != torch.bool:
                raise ValueError(f"seqs[{i}].new_mask must be bool [{s.q_len}, {s.q_len}], got {m.dtype} "
                                 f"{tuple(m.shape)}")  # fmt: skip
            m = m.cpu()
            if not bool(m.diagonal().all()):
                raise ValueError(f"seqs[{i}].new_mask: every new token must see itself (diagonal all True)")
            bits = pack_mask_bits(m)
            mask_off, words = mask_len, bits.shape[1]
            key_bound = 0 if bool(m.triu(1).any()) else 1
            masks.append(bits.flatten())
            mask_len += bits.numel()
        seq_rows.append([T, s.q_len, s.prefix_len, table_len, mask_off, key_bound, words, s.prefix_len, 0])
        tables.append(table)
        new_slots.append(slots)
        T += s.q_len
        table_len += table.numel()
    if num_cache_slots is not None and max_slot >= num_cache_slots:
        what = "slot" if page_size == 1 else f"page (page_size {page_size}) reaching slot"
        raise ValueError(f"a {what} {max_slot} is out of range for a cache of {num_cache_slots} slots")
    if max_slot > _INT32_MAX or table_len > _INT32_MAX or mask_len > _INT32_MAX:
        raise ValueError("slot ids and packed metadata must fit int32")

    # Row tiles, then prefix splits: split_len from the total prefix work over the target program count.
    tile_rows = [(b, r0) for b, s in enumerate(seqs) for r0 in range(0, s.q_len * num_heads, block_m)]
    work = sum(s.prefix_len * -(-s.q_len * num_heads // block_m) for s in seqs)
    target = config.target_programs or num_sms(device)
    bn = config.block_n
    split_len = max(config.min_split, -(-math.ceil(work / max(1, target)) // bn) * bn)
    tiles, items = [], []
    for t, (b, r0) in enumerate(tile_rows):
        P = seqs[b].prefix_len
        if config.row_invariant:
            split_len = row_split_len(P, config)
        starts = range(0, P, split_len) or range(1)  # P == 0: one item, the new tokens alone
        tiles.append([b, r0, len(items), len(starts)])
        items.extend([t, int(k0 == 0), k0, min(P, k0 + split_len)] for k0 in starts)
    merge_tiles = [t for t, tile in enumerate(tiles) if tile[3] > 1]

    parts = [
        torch.tensor(seq_rows, dtype=torch.int32).view(-1, SEQ_FIELDS),
        torch.tensor(tiles, dtype=torch.int32).view(-1, TILE_FIELDS),
        torch.tensor(items, dtype=torch.int32).view(-1, ITEM_FIELDS),
        torch.tensor(merge_tiles + [0], dtype=torch.int32),
        torch.cat([*tables, torch.zeros(1, dtype=torch.int64)]).to(torch.int32),  # +1: never empty
        torch.cat([*new_slots, torch.zeros(1, dtype=torch.int64)]).to(torch.int32),
        torch.cat([*masks, torch.zeros(1, dtype=torch.int32)]),
    ]
    flat = torch.cat([p.flatten() for p in parts]).to(device)
    views, off = [], 0
    for p in parts:
        views.append(flat[off : off + p.numel()].view(p.shape))
        off += p.numel()
    return MLAPlan(*views, num_tokens=T, num_heads=num_heads, page_size=page_size,  # type: ignore[misc]
                   min_cache_slots=max_slot + 1, split_len=split_len, block_m=block_m,
                   num_merge_tiles=len(merge_tiles), config=config, planned=tuple(seqs))  # fmt: skip


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


def _as_slots(s: MLASeq, page_size: int, i: int, num_cache_slots: int | None) -> MLASeq:
    """The sequence with its page table expanded to the slot of every prefix position (pages checked first)."""
    pages = _host_index(s.prefix_table, -(-s.prefix_len // page_size), f"seqs[{i}].prefix_table")
    top = int(pages.max()) * page_size + page_size - 1 if pages.numel() else -1
    if num_cache_slots is not None and top >= num_cache_slots:
        raise ValueError(f"a page (page_size {page_size}) reaching slot {top} is out of range for a cache of "
                         f"{num_cache_slots} slots")  # fmt: skip
    pos = torch.arange(s.prefix_len, dtype=torch.int64)
    return dataclasses.replace(s, prefix_table=pages[pos // page_size] * page_size + pos % page_size)


def _rows_as_decodes(s: MLASeq) -> list[MLASeq]:
    """Row invariant: a sequence with a mask (a verify tree) as one decode row per new token, each over the
    committed prefix and then the other new tokens its mask row shows (a tree in topological order: its
    ancestors, in position order), so the row reads exactly the keys of its AR twin in the same order and
    blocks. Causal sequences (decode, prefill chunks) are kept as they are."""
    if s.new_mask is None or s.q_len <= 1:
        return [s]
    if s.new_mask.shape != (s.q_len, s.q_len) or s.new_mask.dtype != torch.bool:
        raise ValueError(f"new_mask must be bool [{s.q_len}, {s.q_len}], got {s.new_mask.dtype} "
                         f"{tuple(s.new_mask.shape)}")  # fmt: skip
    mask = s.new_mask.cpu()
    if not bool(mask.diagonal().all()):
        raise ValueError("new_mask: every new token must see itself (diagonal all True)")
    table = _host_index(s.prefix_table, s.prefix_len, "prefix_table")
    new = _host_index(s.new_slots, s.q_len, "new_slots")
    rows = []
    others = ~torch.eye(s.q_len, dtype=torch.bool)
    for i in range(s.q_len):
        seen = new[mask[i] & others[i]]  # the other new tokens the row sees, in row order (a tree's: its path)
        rows.append(MLASeq(1, s.prefix_len + seen.numel(), torch.cat([table, seen]), new[i : i + 1]))
    return rows


def _host_index(t: torch.Tensor, n: int, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be an int64 [{n}] tensor, got {getattr(t, 'dtype', type(t))} "
                         f"{tuple(getattr(t, 'shape', ()))}")  # fmt: skip
    if t.numel() != n:
        raise ValueError(f"{name} has {t.numel()} entries, expected {n}")
    return t.to("cpu", torch.int64)

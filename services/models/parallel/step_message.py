"""The per-step message from rank 0: one forward's inputs, one bounded host broadcast per step, no device one.

Rank 0 owns the scheduler and the KV pool's slot allocation; the other ranks only replay forwards.
A message is one int64 stream: words 0..2 are the header (kind, n_ints, n_mask_bytes), then
(FORWARD only)
  ints  int64 [n_ints]: T, R (-1 = all rows), n_taps, gather_logits, n_seqs, taps, input_ids [T],
        positions [T], logits_rows [R], then per sequence q_start, q_len, has_mask, prefix_slots and
        new_slots as runs (n, start_0, len_0, ..., start_n-1, len_n-1): a sequence's slots are mostly
        consecutive, so a long context costs a few ints, not one per token
  masks uint8 [n_mask_bytes] in the following words: the tree masks [q_len, q_len] of the sequences that
        have one, in order.
It travels over the host group (gloo) as one broadcast of the group's fixed first buffer (`FIRST_WORDS`,
allocated once, the same on every rank: `TPGroup.step_buffer`) holding the header and the stream's first
words; only a longer stream (an eager prefill: ids and positions of thousands of rows) continues in
broadcasts of at most `CHUNK_WORDS` each, straight from rank 0's packed stream into a receive tensor of
that message's length. No buffer grows: every persistent buffer is FIRST_WORDS long whatever ran before.
Rank 0 packs it from host tensors (batch.py keeps the step's inputs on the host beside their device
copies), so nothing is read back from the device, before the step's forward (tp_model.TensorParallelModel
.prepare: `encode`; the forward sends it before its own fill, so the other ranks fill while rank 0 does).
Every rank then derives the same forward from the same message: a step that fits a bucket of the static
step (the same buckets and the same decision on every rank) is filled by each rank into its own bucket
buffers from the decoded host inputs (replicated by construction: no device broadcast), else run eagerly.
CACHE (header = (CACHE, num_slots, 0)) makes the other ranks allocate their latent KV cache replica, once,
after rank 0 has sized its pool. STATIC (ints: pad slot, then the tap layers) makes every rank build its
static step over its replica and capture its graphs, in lockstep with rank 0 (their forwards hold
collectives). PING keeps idle peers inside their collective timeout; STOP ends the worker loop.
"""

from __future__ import annotations

import dataclasses

import torch

from ddtree.models.layers.attention import AttentionMetadata, SeqAttention
from ddtree.models.parallel.process_group import TPGroup

FORWARD, PING, STOP, CACHE, STATIC = 1, 2, 3, 4, 6
KINDS = frozenset((FORWARD, PING, STOP, CACHE, STATIC))
HEADER = 3  # kind, n_ints (CACHE: num_slots), n_mask_bytes
# The first broadcast's words: a decode or tree-verify step of a few sequences fits (one AR sequence ~20
# words, a 17-row tree ~110 with its mask); a longer stream continues in CHUNK_WORDS broadcasts.
FIRST_WORDS = 512
CHUNK_WORDS = 1 << 16  # at most 512 KiB per continuation broadcast


@dataclasses.dataclass(frozen=True, eq=False)
class StepInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    logits_rows: torch.Tensor | None  # int64 [R]; None = all T rows
    tap_layer_ids: tuple[int, ...]
    gather_logits: bool  # all-gather the full logits too (sampling at temperature > 0)


GATHER_AT = 3  # the index of gather_logits in encode's ints


def encode(s: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    rows = s.logits_rows
    head = [
        s.input_ids.numel(),
        -1 if rows is None else rows.numel(),
        len(s.tap_layer_ids),
        int(s.gather_logits),
        len(s.meta.seqs),
        *s.tap_layer_ids,
    ]
    parts = [torch.tensor(head, dtype=torch.int64), s.input_ids.cpu(), s.positions.cpu()]
    if rows is not None:
        parts.append(rows.cpu())
    masks = []
    for q in s.meta.seqs:
        parts.append(torch.tensor([q.q_start, q.q_len, int(q.new_mask is not None)]))
        parts += [runs(q.prefix_slots.cpu()), runs(q.new_slots.cpu())]
        if q.new_mask is not None:
            masks.append(q.new_mask.cpu().flatten().to(torch.uint8))
    ints = torch.cat([p.to(torch.int64) for p in parts])
    return ints, torch.cat(masks) if masks else torch.empty(0, dtype=torch.uint8)


def runs(slots: torch.Tensor) -> torch.Tensor:
    """int64 [P] -> [n, start_0, len_0, ...]: the maximal runs of consecutive slots."""
    if slots.numel() == 0:
        return torch.zeros(1, dtype=torch.int64)
    first = torch.cat([torch.zeros(1, dtype=torch.int64), torch.nonzero(slots.diff() != 1).flatten() + 1])
    lens = torch.cat([first, torch.tensor([slots.numel()])]).diff()
    return torch.cat([torch.tensor([first.numel()]), torch.stack([slots[first], lens], dim=1).flatten()])


def from_runs(pairs: torch.Tensor) -> torch.Tensor:
    """[start_0, len_0, ...] -> int64 [P], the inverse of runs() without its count."""
    starts, lens = pairs[0::2], pairs[1::2]
    before = lens.cumsum(0) - lens  # slots in the earlier runs
    return torch.repeat_interleave(starts - before, lens) + torch.arange(int(lens.sum()))


def decode(ints: torch.Tensor, masks: torch.Tensor) -> StepInputs:
    T, R, n_taps, gather, n_seqs = ints[:5].tolist()
    at = 5 + n_taps
    taps = tuple(ints[5:at].tolist())

    def take(n: int) -> torch.Tensor:
        nonlocal at
        at += n
        return ints[at - n : at]

    ids, pos = take(T), take(T)
    rows = None if R < 0 else take(R)
    seqs, m_at = [], 0
    for _ in range(n_seqs):
        q_start, q_len, has_mask = take(3).tolist()
        prefix = from_runs(take(2 * int(take(1))))
        new = from_runs(take(2 * int(take(1))))
        mask = None
        if has_mask:
            mask = masks[m_at : m_at + q_len * q_len].view(q_len, q_len).bool()
            m_at += q_len * q_len
        seqs.append(SeqAttention(q_start=q_start, q_len=q_len, prefix_slots=prefix, new_slots=new, new_mask=mask))
    assert at == ints.numel() and m_at == masks.numel(), "step message length mismatch"
    return StepInputs(ids, pos, AttentionMetadata(seqs=tuple(seqs)), rows, taps, bool(gather))


def first_buffer(tp: TPGroup) -> torch.Tensor:
    """The group's fixed first-broadcast buffer (int64 [FIRST_WORDS]), made once and reused by every message."""
    if tp.step_buffer[0] is None:
        tp.step_buffer[0] = torch.zeros(FIRST_WORDS, dtype=torch.int64)
    return tp.step_buffer[0]


def stream_words(kind: int, head: int, n_mask_bytes: int) -> int:
    """The int64 words of a message's stream, from its header."""
    n_ints = head if kind in (FORWARD, STATIC) else 0
    return HEADER + n_ints + -(-n_mask_bytes // 8)


def pack(kind: int, head: int, ints: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """int64 [stream_words]: header, ints, the mask bytes padded to whole words."""
    out = torch.zeros(stream_words(kind, head, masks.numel()), dtype=torch.int64)
    out[:HEADER] = torch.tensor([kind, head, masks.numel()])
    out[HEADER : HEADER + ints.numel()] = ints
    out[HEADER + ints.numel() :].view(torch.uint8)[: masks.numel()] = masks
    return out


def send_step(
    tp: TPGroup,
    kind: int,
    inputs: StepInputs | None = None,
    num_slots: int = 0,
    encoded: tuple[torch.Tensor, torch.Tensor] | None = None,  # encode(inputs), when packed before the step
    ints: torch.Tensor | None = None,  # STATIC: its int64 payload
) -> int:
    """Rank 0: broadcast one message (inputs for FORWARD, num_slots for CACHE, ints for STATIC) over the host
    group; returns the broadcasts it took: 1, plus one per CHUNK_WORDS past the first buffer."""
    masks = torch.empty(0, dtype=torch.uint8)
    if kind == FORWARD:
        ints, masks = encoded if encoded is not None else encode(inputs)
    elif kind != STATIC or ints is None:
        ints = torch.empty(0, dtype=torch.int64)
    stream = pack(kind, num_slots if kind == CACHE else ints.numel(), ints, masks)
    first = first_buffer(tp)
    n = min(stream.numel(), FIRST_WORDS)
    first[:n] = stream[:n]
    tp.broadcast_cpu(first)
    for at in range(FIRST_WORDS, stream.numel(), CHUNK_WORDS):
        tp.broadcast_cpu(stream[at : at + CHUNK_WORDS])
    return 1 + len(range(FIRST_WORDS, stream.numel(), CHUNK_WORDS))


def recv_step(tp: TPGroup) -> tuple[int, StepInputs | torch.Tensor | int | None]:
    """Ranks > 0: wait for rank 0's next message: (FORWARD, inputs), (CACHE, num_slots), (STATIC, ints),
    (PING|STOP, None)."""
    first = tp.broadcast_cpu(first_buffer(tp))
    kind, head, n_masks = first[:HEADER].tolist()
    if kind not in KINDS:
        raise RuntimeError(f"step message of unknown kind {kind}: the ranks run different builds")
    total = stream_words(kind, head, n_masks)
    if total <= FIRST_WORDS:
        stream = first[:total].clone()  # the first buffer is reused by the next message
    else:
        stream = torch.empty(total, dtype=torch.int64)
        stream[:FIRST_WORDS] = first
        for at in range(FIRST_WORDS, total, CHUNK_WORDS):
            tp.broadcast_cpu(stream[at : at + CHUNK_WORDS])
    if kind == CACHE:
        return kind, head
    if kind == STATIC:
        return kind, stream[HEADER : HEADER + head]
    if kind != FORWARD:
        return kind, None
    masks = stream[HEADER + head :].view(torch.uint8)[:n_masks]
    return kind, decode(stream[HEADER : HEADER + head], masks)

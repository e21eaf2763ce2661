"""The per-step broadcast from rank 0: one forward's inputs in one int64 buffer, one broadcast per step.

Rank 0 owns the scheduler and the KV pool's slot allocation; the other ranks only replay forwards.
Every message is one broadcast of the group's message buffer (`TPGroup.step_buffer`, int64 [capacity],
the same capacity on every rank): words 0..2 are the header (kind, n_ints, n_mask_bytes), then
(FORWARD only)
  ints  int64 [n_ints]: T, R (-1 = all rows), n_taps, gather_logits, n_seqs, taps, input_ids [T],
        positions [T], logits_rows [R], then per sequence q_start, q_len, has_mask, prefix_slots and
        new_slots as runs (n, start_0, len_0, ..., start_n-1, len_n-1): a sequence's slots are mostly
        consecutive, so a long context costs a few ints, not one per token
  masks uint8 [n_mask_bytes] in the following words: the tree masks [q_len, q_len] of the sequences that
        have one, in order.
Rank 0 packs it from host tensors (batch.py keeps the step's inputs on the host beside their device
copies), so nothing is read back from the device, and before the step's forward
(tp_model.TensorParallelModel.prepare: `encode` then, the buffer's fill and the broadcast in the forward).
A message longer than the buffer is preceded by GROW
(header = (GROW, new capacity, 0)): every rank then allocates the larger buffer, in lockstep.
CACHE (header = (CACHE, num_slots, 0)) makes the other ranks allocate their latent KV cache replica, once,
after rank 0 has sized its pool. STATIC (ints: pad slot, then the tap layers) makes every rank build its
static step over its replica and capture its graphs, in lockstep with rank 0 (their forwards hold
collectives); from then on each rank runs a FORWARD that fits a bucket through it (the same decision on
every rank). STATIC_STEP (ints: bucket index, gather_logits, the real rows' rows in the bucket, the rows
asked for or -1) announces a step of rank 0's static step: its buffers follow as device broadcasts
(tp_model.run_static_shard), nothing to decode. PING keeps idle peers inside their collective timeout;
STOP ends the worker loop.
"""

from __future__ import annotations

import dataclasses

import torch

from ddtree.models.attention import AttentionMetadata, SeqAttention

from .process_group import TPGroup

FORWARD, PING, STOP, CACHE, GROW, STATIC, STATIC_STEP = 1, 2, 3, 4, 5, 6, 7
HEADER = 3  # kind, n_ints (CACHE: num_slots; GROW: capacity), n_mask_bytes
INITIAL_WORDS = 1024  # the message buffer's first capacity, int64 words


@dataclasses.dataclass(frozen=True, eq=False)
class StepInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    logits_rows: torch.Tensor | None  # int64 [R]; None = all T rows
    tap_layer_ids: tuple[int, ...]
    gather_logits: bool  # all-gather the full logits too (sampling at temperature > 0)


GATHER_AT = 3  # the index of gather_logits in encode's ints


@dataclasses.dataclass(frozen=True, eq=False)
class StaticStepMessage:
    """A step of the static step (verifier/static_step.py): its bucket, where its real rows sit in it (int64
    [T_real], host), the rows asked for among them (int64 [R], host; None = all) and gather_logits."""

    bucket: object
    where: torch.Tensor
    rows: torch.Tensor | None
    gather_logits: bool

    def encode(self, static) -> torch.Tensor:
        rows = [-1] if self.rows is None else [self.rows.numel(), *self.rows.tolist()]
        head = [static.buckets.index(self.bucket), int(self.gather_logits), self.where.numel()]
        return torch.tensor([*head, *self.where.tolist(), *rows], dtype=torch.int64)

    @classmethod
    def decode(cls, ints: torch.Tensor, static) -> StaticStepMessage:
        index, gather, n = ints[:3].tolist()
        where = ints[3 : 3 + n].clone()
        rows = None if int(ints[3 + n]) < 0 else ints[4 + n :].clone()
        return cls(static.buckets[index], where, rows, bool(gather))


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


def message_buffer(tp: TPGroup, words: int = 0) -> torch.Tensor:
    """The group's message buffer (int64 [capacity]); `words` > 0: replace it by one of that capacity."""
    if words or tp.step_buffer[0] is None:
        tp.step_buffer[0] = torch.zeros(max(words, INITIAL_WORDS), dtype=torch.int64)
    return tp.step_buffer[0]


def send_step(
    tp: TPGroup,
    kind: int,
    inputs: StepInputs | None = None,
    num_slots: int = 0,
    encoded: tuple[torch.Tensor, torch.Tensor] | None = None,  # encode(inputs), when packed before the step
    ints: torch.Tensor | None = None,  # STATIC / STATIC_STEP: their int64 payload
) -> None:
    """Rank 0: broadcast one message (inputs for FORWARD, num_slots for CACHE, ints for STATIC): one
    broadcast (two when the buffer must grow first)."""
    masks = torch.empty(0, dtype=torch.uint8)
    if kind == FORWARD:
        ints, masks = encoded if encoded is not None else encode(inputs)
    elif kind not in (STATIC, STATIC_STEP) or ints is None:
        ints = torch.empty(0, dtype=torch.int64)
    mask_words = -(-masks.numel() // 8)
    need = HEADER + ints.numel() + mask_words
    buf = message_buffer(tp)
    if need > buf.numel():
        words = 1 << (need - 1).bit_length()
        buf[:HEADER] = torch.tensor([GROW, words, 0])
        tp.broadcast_cpu(buf)
        buf = message_buffer(tp, words)
    head = num_slots if kind == CACHE else ints.numel()
    buf[:HEADER] = torch.tensor([kind, head, masks.numel()])
    buf[HEADER : HEADER + ints.numel()] = ints
    if mask_words:
        at = HEADER + ints.numel()
        buf[at : at + mask_words].view(torch.uint8)[: masks.numel()] = masks
    tp.broadcast_cpu(buf)


def recv_step(tp: TPGroup) -> tuple[int, StepInputs | torch.Tensor | int | None]:
    """Ranks > 0: wait for rank 0's next message: (FORWARD, inputs), (CACHE, num_slots), (STATIC, ints),
    (PING|STOP, None)."""
    while True:
        buf = tp.broadcast_cpu(message_buffer(tp))
        kind, n_ints, n_masks = buf[:HEADER].tolist()
        if kind != GROW:
            break
        message_buffer(tp, n_ints)
    if kind == CACHE:
        return kind, n_ints
    if kind in (STATIC, STATIC_STEP):
        return kind, buf[HEADER : HEADER + n_ints].clone()
    if kind != FORWARD:
        return kind, None
    ints = buf[HEADER : HEADER + n_ints].clone()  # the buffer is reused by the next message
    at = HEADER + n_ints
    masks = buf[at : at + -(-n_masks // 8)].view(torch.uint8)[:n_masks].clone()
    return kind, decode(ints, masks)

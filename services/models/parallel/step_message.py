"""The per-step broadcast from rank 0: one forward's inputs as two flat CPU tensors.

Rank 0 owns the scheduler and the KV pool's slot allocation; the other ranks only replay forwards.
Each step rank 0 broadcasts a header int64 [3] = (kind, n_ints, n_mask_bytes), then (FORWARD only)
  ints  int64 [n_ints]: T, R (-1 = all rows), n_taps, gather_logits, n_seqs, taps, input_ids [T],
        positions [T], logits_rows [R], then per sequence q_start, q_len, P, has_mask, prefix_slots [P],
        new_slots [q_len]
  masks uint8 [n_mask_bytes]: the tree masks [q_len, q_len] of the sequences that have one, in order.
CACHE (header = (CACHE, num_slots, 0)) makes the other ranks allocate their latent KV cache replica, once,
after rank 0 has sized its pool. PING keeps idle peers inside their collective timeout; STOP ends the
worker loop.
"""
from __future__ import annotations

import dataclasses

import torch

from services.models.attention import AttentionMetadata, SeqAttention

from .process_group import TPGroup

FORWARD, PING, STOP, CACHE = 1, 2, 3, 4


@dataclasses.dataclass(frozen=True, eq=False)
class StepInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    logits_rows: torch.Tensor | None  # int64 [R]; None = all T rows
    tap_layer_ids: tuple[int, ...]
    gather_logits: bool  # all-gather the full logits too (sampling at temperature > 0)


def encode(s: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    rows = s.logits_rows
    head = [s.input_ids.numel(), -1 if rows is None else rows.numel(), len(s.tap_layer_ids),
            int(s.gather_logits), len(s.meta.seqs), *s.tap_layer_ids]
    parts = [torch.tensor(head, dtype=torch.int64), s.input_ids.cpu(), s.positions.cpu()]
    if rows is not None:
        parts.append(rows.cpu())
    masks = []
    for q in s.meta.seqs:
        parts.append(torch.tensor([q.q_start, q.q_len, q.prefix_slots.numel(), int(q.new_mask is not None)]))
        parts += [q.prefix_slots.cpu(), q.new_slots.cpu()]
        if q.new_mask is not None:
            masks.append(q.new_mask.cpu().flatten().to(torch.uint8))
    ints = torch.cat([p.to(torch.int64) for p in parts])
    return ints, torch.cat(masks) if masks else torch.empty(0, dtype=torch.uint8)


def decode(ints: torch.Tensor, masks: torch.Tensor) -> StepInputs:
    vals = ints.tolist()
    T, R, n_taps, gather, n_seqs = vals[:5]
    at = 5 + n_taps
    taps = tuple(vals[5:at])

    def take(n: int) -> torch.Tensor:
        nonlocal at
        at += n
        return ints[at - n:at]

    ids, pos = take(T), take(T)
    rows = None if R < 0 else take(R)
    seqs, m_at = [], 0
    for _ in range(n_seqs):
        q_start, q_len, P, has_mask = take(4).tolist()
        prefix, new = take(P), take(q_len)
        mask = None
        if has_mask:
            mask = masks[m_at:m_at + q_len * q_len].view(q_len, q_len).bool()
            m_at += q_len * q_len
        seqs.append(SeqAttention(q_start=q_start, q_len=q_len, prefix_slots=prefix, new_slots=new, new_mask=mask))
    assert at == ints.numel() and m_at == masks.numel(), "step message length mismatch"
    return StepInputs(ids, pos, AttentionMetadata(seqs=tuple(seqs)), rows, taps, bool(gather))


def send_step(tp: TPGroup, kind: int, inputs: StepInputs | None = None, num_slots: int = 0) -> None:
    """Rank 0: broadcast one message (inputs for FORWARD, num_slots for CACHE)."""
    ints, masks = encode(inputs) if kind == FORWARD else (None, None)
    header = torch.tensor([kind, num_slots if kind == CACHE else 0 if ints is None else ints.numel(),
                           0 if masks is None else masks.numel()])
    tp.broadcast_cpu(header)
    if kind == FORWARD:
        tp.broadcast_cpu(ints)
        if masks.numel():
            tp.broadcast_cpu(masks)


def recv_step(tp: TPGroup) -> tuple[int, StepInputs | int | None]:
    """Ranks > 0: wait for rank 0's next message: (FORWARD, inputs), (CACHE, num_slots), (PING|STOP, None)."""
    header = tp.broadcast_cpu(torch.zeros(3, dtype=torch.int64))
    kind, n_ints, n_masks = header.tolist()
    if kind == CACHE:
        return kind, n_ints
    if kind != FORWARD:
        return kind, None
    ints = tp.broadcast_cpu(torch.empty(n_ints, dtype=torch.int64))
    masks = tp.broadcast_cpu(torch.empty(n_masks, dtype=torch.uint8)) if n_masks else torch.empty(0, dtype=torch.uint8)
    return kind, decode(ints, masks)

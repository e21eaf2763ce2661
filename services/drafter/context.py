"""Per-sequence draft context: cached drafter K/V of committed tokens, optionally windowed.

Only committed tokens ever enter (their features come from the target's accepted nodes); the draft
block's K/V are never stored, so there is nothing to roll back (docs/design.md §3.1).

Window W > 0 keeps only the last W committed tokens. RoPE positions stay absolute: the K/V were
rotated at their true positions when computed, and dropping old rows does not change them
(docs/design.md §3.1). Attention over the context is unmasked, so the result equals a
fresh context built from the last W features alone.
"""

from __future__ import annotations

import torch
from torch import Tensor


class DraftContext:
    """K/V per drafter layer for the committed tokens at absolute positions [start, end).

    Storage: per layer one K and one V buffer [capacity, kvh, hd]; the held tokens are rows [lo, hi).
    Appends write at hi; when a buffer is full the held rows move to the front (windowed) or the
    capacity doubles (unlimited), so an append costs O(n) amortised instead of a copy of the window.

    dtype: the buffers' dtype (None = the appended K/V's). The drafter attends over the context in fp32,
    so a bf16 drafter on the CPU keeps fp32 buffers: each row is converted once when appended (exactly),
    not the whole window at every layer of every draft (engine.py).
    """

    def __init__(self, window: int = 0, dtype: torch.dtype | None = None):
        if window < 0:
            raise ValueError(f"window must be >= 0 (0 = unlimited), got {window}")
        self.window = window
        self.dtype = dtype
        self._buf: list[tuple[Tensor, Tensor]] = []  # per layer: K, V [capacity, kvh, hd]
        self._lo = 0
        self._hi = 0
        self._end = 0  # absolute position one past the last committed token

    @property
    def length(self) -> int:
        """Tokens currently held (<= window when windowed)."""
        return self._hi - self._lo

    @property
    def end(self) -> int:
        """Absolute position where the next commit must start."""
        return self._end

    @property
    def start(self) -> int:
        """Absolute position of the oldest held token."""
        return self._end - self.length

    @property
    def kv(self) -> list[tuple[Tensor, Tensor]]:
        """Per layer (K, V) [length, kvh, hd] views, oldest first; [] before the first append."""
        return [(k[self._lo : self._hi], v[self._lo : self._hi]) for k, v in self._buf]

    @property
    def nbytes(self) -> int:
        """Bytes of the held rows (the buffers may hold up to about twice as much)."""
        return sum(
            (k[0].numel() * k.element_size() + v[0].numel() * v.element_size()) * self.length for k, v in self._buf
        )

    def append(self, kv_per_layer: list[tuple[Tensor, Tensor]], positions: Tensor) -> None:
        """Append n committed tokens. positions [n] must be contiguous and, unless the context is
        empty, start at `end`. kv_per_layer: per layer (K, V) [n, kvh, hd]."""
        n = positions.shape[0] if positions.dim() == 1 else -1
        if n < 0:
            raise ValueError(f"positions must be 1-D, got shape {tuple(positions.shape)}")
        if self._buf and len(kv_per_layer) != len(self._buf):
            raise ValueError(f"got K/V for {len(kv_per_layer)} layers, the context holds {len(self._buf)}")
        for i, (k, v) in enumerate(kv_per_layer):
            if k.shape[0] != n or v.shape[0] != n:
                raise ValueError(f"layer {i}: K/V have {k.shape[0]}/{v.shape[0]} rows for {n} positions")
        if n == 0:
            return
        pos = positions.tolist()
        if any(b != a + 1 for a, b in zip(pos, pos[1:])):
            raise ValueError(f"positions must be contiguous, got {pos[:8]}{'...' if n > 8 else ''}")
        if self._buf and pos[0] != self._end:
            raise ValueError(f"positions start at {pos[0]}, the context ends at {self._end}")
        keep_new = n if self.window == 0 else min(n, self.window)
        keep_old = self.length if self.window == 0 else min(self.length, self.window - keep_new)
        self._make_room(kv_per_layer, keep_old, keep_new)
        for (bk, bv), (k, v) in zip(self._buf, kv_per_layer):
            bk[self._hi : self._hi + keep_new] = k[n - keep_new :]
            bv[self._hi : self._hi + keep_new] = v[n - keep_new :]
        self._hi += keep_new
        self._end = pos[-1] + 1

    def _make_room(self, kv_per_layer, keep_old: int, keep_new: int) -> None:
        """Drop all but the last keep_old held rows and leave space for keep_new rows at hi."""
        self._lo = self._hi - keep_old
        capacity = self._buf[0][0].shape[0] if self._buf else 0
        if self._hi + keep_new <= capacity:
            return
        need = keep_old + keep_new
        new_cap = max(need, 2 * self.window if self.window else 2 * max(capacity, need), 16)
        fresh = [
            (
                k.new_empty((new_cap, *k.shape[1:]), dtype=self.dtype or k.dtype),
                v.new_empty((new_cap, *v.shape[1:]), dtype=self.dtype or v.dtype),
            )
            for k, v in kv_per_layer
        ]
        for (fk, fv), (bk, bv) in zip(fresh, self._buf):
            fk[:keep_old] = bk[self._lo : self._hi]
            fv[:keep_old] = bv[self._lo : self._hi]
        self._buf, self._lo, self._hi = fresh, 0, keep_old

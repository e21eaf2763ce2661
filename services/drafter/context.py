"""Per-sequence draft context: cached drafter K/V of committed tokens, optionally windowed.

Only committed tokens ever enter (their features come from the target's accepted nodes); the draft
block's K/V are never stored, so there is nothing to roll back (ddtree.md §1.4).

Window W > 0 keeps only the last W committed tokens. RoPE positions stay absolute: the K/V were
rotated at their true positions when computed, and dropping old rows does not change them
(ddtree.md §1.4, "compact draft KV"). Attention over the context is unmasked, so the result equals a
fresh context built from the last W features alone.
"""

from __future__ import annotations

import torch
from torch import Tensor


class DraftContext:
    """K/V per drafter layer for the committed tokens at absolute positions [start, end)."""

    def __init__(self, window: int = 0):
        if window < 0:
            raise ValueError(f"window must be >= 0 (0 = unlimited), got {window}")
        self.window = window
        self._kv: list[tuple[Tensor, Tensor]] = []  # per layer: K, V [length, kvh, hd]
        self._end = 0  # absolute position one past the last committed token

    @property
    def length(self) -> int:
        """Tokens currently held (<= window when windowed)."""
        return self._kv[0][0].shape[0] if self._kv else 0

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
        """Per layer (K, V) [length, kvh, hd], oldest first; [] before the first append."""
        return list(self._kv)

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self._kv)

    def append(self, kv_per_layer: list[tuple[Tensor, Tensor]], positions: Tensor) -> None:
        """Append n committed tokens. positions [n] must be contiguous and, unless the context is
        empty, start at `end`. kv_per_layer: per layer (K, V) [n, kvh, hd]."""
        n = positions.shape[0] if positions.dim() == 1 else -1
        if n < 0:
            raise ValueError(f"positions must be 1-D, got shape {tuple(positions.shape)}")
        if self._kv and len(kv_per_layer) != len(self._kv):
            raise ValueError(f"got K/V for {len(kv_per_layer)} layers, the context holds {len(self._kv)}")
        for i, (k, v) in enumerate(kv_per_layer):
            if k.shape[0] != n or v.shape[0] != n:
                raise ValueError(f"layer {i}: K/V have {k.shape[0]}/{v.shape[0]} rows for {n} positions")
        if n == 0:
            return
        pos = positions.tolist()
        if any(b != a + 1 for a, b in zip(pos, pos[1:])):
            raise ValueError(f"positions must be contiguous, got {pos[:8]}{'...' if n > 8 else ''}")
        if self._kv and pos[0] != self._end:
            raise ValueError(f"positions start at {pos[0]}, the context ends at {self._end}")
        keep_new = n if self.window == 0 else min(n, self.window)
        keep_old = self.length if self.window == 0 else min(self.length, self.window - keep_new)
        if self._kv:
            self._kv = [
                (torch.cat([ok[ok.shape[0] - keep_old:], k[n - keep_new:]]),
                 torch.cat([ov[ov.shape[0] - keep_old:], v[n - keep_new:]]))
                for (ok, ov), (k, v) in zip(self._kv, kv_per_layer)
            ]
        else:
            self._kv = [(k[n - keep_new:].contiguous(), v[n - keep_new:].contiguous()) for k, v in kv_per_layer]
        self._end = pos[-1] + 1

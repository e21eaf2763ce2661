"""The latent KV pool: one tensor [num_layers, num_slots, kv_lora_rank + qk_rope_head_dim].

Page size 1: every token owns one slot, and a sequence's slot table (its committed slots in position
order) is kept by the sequence. Tree verify writes the root and all nodes into fresh slots; commit keeps
the accepted nodes' slots (whose latents were computed at exactly the positions they now hold, because
an accepted path has depths 0..len-1) and frees the rest, so no KV data moves.

Invariant (checked by `check()`): free + in use == total, no slot both free and in use.
"""
from __future__ import annotations

import threading

import torch


class KVPoolExhausted(RuntimeError):
    pass


class LatentKVPool:
    def __init__(self, num_layers: int, num_slots: int, width: int, dtype: torch.dtype, device: str | torch.device):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.cache = torch.zeros(num_layers, num_slots, width, dtype=dtype, device=device)
        # A stack of free slot ids: pop from the end. Kept on the host; slots are plain ints.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._in_use = torch.zeros(num_slots, dtype=torch.bool)
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def alloc(self, n: int) -> torch.Tensor:
        """n fresh slots as int64 [n]; raises KVPoolExhausted when fewer than n are free."""
        with self._lock:
            if n > len(self._free):
                raise KVPoolExhausted(f"need {n} KV slots, {len(self._free)} free of {self.num_slots}")
            taken = self._free[len(self._free) - n:]
            del self._free[len(self._free) - n:]
            slots = torch.tensor(taken[::-1], dtype=torch.int64)
            if self._in_use[slots].any():
                raise AssertionError("KV pool corrupted: a free slot was in use")
            self._in_use[slots] = True
            return slots

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        with self._lock:
            if not self._in_use[slots].all():
                raise AssertionError(f"double free of KV slots {slots[~self._in_use[slots]].tolist()[:8]}")
            self._in_use[slots] = False
            self._free.extend(slots.tolist())

    def check(self) -> None:
        with self._lock:
            used = int(self._in_use.sum())
            if used + len(self._free) != self.num_slots or len(set(self._free)) != len(self._free):
                raise AssertionError(f"KV accounting broken: used {used} + free {len(self._free)} != {self.num_slots}")

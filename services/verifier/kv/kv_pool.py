"""The latent KV pool: one tensor [num_layers, num_slots, kv_lora_rank + qk_rope_head_dim], handed out in
pages of `page_size` position-contiguous slots (page k = slots k·P .. k·P + P - 1).

Page size 1 (the default, what DDTree wants, docs/design.md §7.2): a page is a slot, every token owns one, and
tree verify writes the root and all nodes into fresh slots; commit keeps the accepted nodes' slots (their
latents were computed at exactly the positions they now hold, because an accepted path has depths
0..len-1) and frees the rest, so no KV data moves. Page size P > 1: a sequence's token at position p sits
at slot pages[p // P]·P + p % P, so accepted nodes are copied into place at commit (`copy`); see
page_table.py, which keeps each sequence's pages.

Allocation is lowest-free-page first (a min-heap), so the pages in use stay packed at the low end of the
pool whatever the history of allocations and frees: a sequence's slots lie close together and close to
those of the steps before, and gathering a long context touches a compact region of memory. A LIFO free
list instead hands out whatever was freed last: after many requests a new context is scattered across
the whole pool, and with page size 1 gathering it measurably slowed late decode steps (docs/performance.md;
scripts/bench/bench_serving.py fragmentation).

Units: `alloc`/`free` take pages (page ids; page size 1: slot ids); `num_free`/`num_used`/`num_slots`
count slots (tokens), `num_free_pages`/`num_used_pages`/`num_pages` count pages.
Invariant (checked by `check()`): free + in use == total, no page both free and in use.
"""

from __future__ import annotations

import heapq
import threading

import torch


class KVPoolExhausted(RuntimeError):
    pass


class LatentKVPool:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        width: int,
        dtype: torch.dtype,
        device: str | torch.device,
        page_size: int = 1,
    ):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_slots < page_size or num_slots % page_size:
            raise ValueError(f"num_slots must be a positive multiple of page_size {page_size}, got {num_slots}")
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.num_slots = num_slots
        # One row past the last slot, never handed out: a static-shape step's padding rows write their
        # latents there (static_step.py).
        self.pad_slot = num_slots
        self.cache = torch.zeros(num_layers, num_slots + 1, width, dtype=dtype, device=device)
        # A min-heap of free page ids (a sorted list is one). Kept on the host; pages are plain ints.
        self._free: list[int] = list(range(self.num_pages))
        self._in_use = torch.zeros(self.num_pages, dtype=torch.bool)
        self._lock = threading.Lock()

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def num_free(self) -> int:
        """Free slots (free pages × page size)."""
        return len(self._free) * self.page_size

    @property
    def num_used(self) -> int:
        return self.num_slots - self.num_free

    def alloc(self, n: int) -> torch.Tensor:
        """n fresh pages as int64 [n]; raises KVPoolExhausted when fewer than n are free."""
        with self._lock:
            if n > len(self._free):
                unit = "slots" if self.page_size == 1 else f"pages of {self.page_size} slots"
                raise KVPoolExhausted(f"need {n} KV {unit}, {len(self._free)} free of {self.num_pages}")
            if n == len(self._free):
                taken, self._free = sorted(self._free), []
            else:
                taken = [heapq.heappop(self._free) for _ in range(n)]  # the n lowest, ascending
            pages = torch.tensor(taken, dtype=torch.int64)
            if self._in_use[pages].any():
                raise AssertionError("KV pool corrupted: a free page was in use")
            self._in_use[pages] = True
            return pages

    def free(self, pages: torch.Tensor) -> None:
        if pages.numel() == 0:
            return
        with self._lock:
            if pages.unique().numel() != pages.numel() or not self._in_use[pages].all():
                bad = pages[~self._in_use[pages]].tolist()[:8] or pages.tolist()[:8]
                raise AssertionError(f"double free of KV {'slots' if self.page_size == 1 else 'pages'} {bad}")
            self._in_use[pages] = False
            for page in pages.tolist():
                heapq.heappush(self._free, page)

    def in_use(self, pages: torch.Tensor) -> torch.Tensor:
        """bool [len(pages)]: which pages are allocated."""
        with self._lock:
            return self._in_use[pages]

    def slots_of(self, pages: torch.Tensor) -> torch.Tensor:
        """int64 [len(pages) · P]: the slots of `pages`, page after page."""
        if self.page_size == 1:
            return pages
        return (pages[:, None] * self.page_size + torch.arange(self.page_size)).flatten()

    def pages_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The pages of page-aligned slots (whole pages, in order): the inverse of slots_of."""
        if self.page_size == 1:
            return slots
        assert slots.numel() % self.page_size == 0, "slots must cover whole pages"
        return slots[:: self.page_size] // self.page_size

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """cache[:, dst[i]] = cache[:, src[i]] in every layer; src is read in full before any write."""
        if src.numel():
            dev = self.cache.device
            self.cache[:, dst.to(dev)] = self.cache[:, src.to(dev)]

    def check(self) -> None:
        with self._lock:
            used = int(self._in_use.sum())
            if used + len(self._free) != self.num_pages or len(set(self._free)) != len(self._free):
                raise AssertionError(
                    f"KV accounting broken: used {used} + free {len(self._free)} != {self.num_pages} pages"
                )

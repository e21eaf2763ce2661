"""A sequence's KV addresses: its pages in position order, token at position p at slot
pages[p // P]·P + p % P (P = the pool's page size; page size 1: the pages are the slots).

Between steps a table covers exactly its committed tokens: ceil(length / P) pages, the last possibly
partial (its unused slots are the sequence's, written by the next step). The first `shared_pages` pages
belong to the prefix cache (a cached prefix, or the sequence's own prompt once it entered the cache,
pinned by the sequence's match); the rest to the sequence.

One step:
  extend(pool, q)   slots for positions length .. length+q-1, with new pages as needed: a prefill chunk's
                    rows, or a tree verify's rows [root, node 1, ..., node n] laid out as if they were a
                    chain, so the root sits at its own position `length` and the nodes fill the tail of
                    the current page and fresh pages (the step's scratch);
  commit(q)         prefill: the q rows are the next q tokens, already in place;
  commit_tree(pool, acc)   verify: row acc[j] (the accepted node at depth j) becomes position length + j.
      page size 1: the table takes the accepted rows' slots and frees the others; no KV moves.
      page size P: the accepted latents (every layer) are copied to the slots of their positions.
      acc[j] >= j, so only rows off the chain move and the root never does; then the pages past the
      new length are freed.
  trim(pool)        frees pages past the committed tokens (a step that failed before its commit).
"""

from __future__ import annotations

import torch

from ddtree.verifier.kv.kv_pool import LatentKVPool

_EMPTY = torch.empty(0, dtype=torch.int64)


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class PageTable:
    def __init__(self, page_size: int = 1):
        self.page_size = page_size
        self.pages = _EMPTY  # int64 page ids in position order
        self.length = 0  # committed tokens
        self.shared_pages = 0  # leading pages owned by the prefix cache
        self._slots = _EMPTY  # int64 [length]: committed slots in position order

    @property
    def slots(self) -> torch.Tensor:
        return self._slots

    @property
    def shared_len(self) -> int:
        return self.shared_pages * self.page_size

    def own_pages(self) -> torch.Tensor:
        return self.pages[self.shared_pages :]

    def _at(self, positions: torch.Tensor) -> torch.Tensor:
        P = self.page_size
        return self.pages[positions // P] * P + positions % P if P > 1 else self.pages[positions]

    def share(self, slots: torch.Tensor) -> None:
        """Start from a cached prefix: `slots` (whole pages) are the prefix cache's, pinned."""
        assert self.length == 0 and self.pages.numel() == 0, "share() starts an empty table"
        assert slots.numel() % self.page_size == 0, "a shared prefix covers whole pages"
        self.pages = slots[:: self.page_size] // self.page_size
        self.length = slots.numel()
        self.shared_pages = self.pages.numel()
        self._slots = slots.clone()

    def share_entered(self, slots: torch.Tensor) -> None:
        """The first slots.numel() committed slots (whole pages, these very slots) entered the prefix
        cache (PrefixCache.enter): from now on they are its pages, pinned by the sequence's match."""
        n = slots.numel()
        assert n % self.page_size == 0 and self.shared_len <= n <= self.length, "entered whole committed pages"
        assert torch.equal(self._slots[:n], slots), "entered slots are not the table's"
        self.shared_pages = n // self.page_size

    def pages_needed(self, n: int) -> int:
        """New pages extend(pool, n) will allocate."""
        return max(pages_for(self.length + n, self.page_size) - self.pages.numel(), 0)

    def extend(self, pool: LatentKVPool, n: int) -> torch.Tensor:
        """int64 [n] slots for positions length .. length+n-1 (nothing is committed yet)."""
        assert pool.page_size == self.page_size, f"pool page size {pool.page_size} != table's {self.page_size}"
        need = self.pages_needed(n)
        if need:
            self.pages = torch.cat([self.pages, pool.alloc(need)])
        return self._at(torch.arange(self.length, self.length + n))

    def commit(self, n: int) -> None:
        """The n rows written after extend() are the next n tokens, in order."""
        self._slots = torch.cat([self._slots, self._at(torch.arange(self.length, self.length + n))])
        self.length += n

    def commit_tree(self, pool: LatentKVPool, accepted_rows: tuple[int, ...] | list[int]) -> None:
        """Rows accepted_rows[j] (strictly increasing, [0] = the root) become positions length + j."""
        start, k = self.length, len(accepted_rows)
        rows = torch.tensor(accepted_rows, dtype=torch.int64)
        assert k >= 1 and accepted_rows[0] == 0 and bool((rows[1:] > rows[:-1]).all()), "accepted rows"
        if self.page_size == 1:
            scratch = self.pages[start:]
            keep = torch.zeros(scratch.numel(), dtype=torch.bool)
            keep[rows] = True
            pool.free(scratch[~keep])
            self.pages = torch.cat([self.pages[:start], scratch[rows]])
            self._slots = self.pages
            self.length += k
            return
        chain = torch.arange(k)
        moved = rows != chain
        if bool(moved.any()):
            pool.copy(self._at(start + rows[moved]), self._at(start + chain[moved]))
        self.commit(k)
        self.trim(pool)

    def trim(self, pool: LatentKVPool) -> None:
        """Free the pages past the committed tokens (the scratch of a step)."""
        keep = pages_for(self.length, self.page_size)
        if self.pages.numel() > keep:
            pool.free(self.pages[keep:])
            self.pages = self.pages[:keep]

    def check(self) -> None:
        if self.pages.numel() != pages_for(self.length, self.page_size) or self._slots.numel() != self.length:
            raise AssertionError(
                f"page table: {self.pages.numel()} pages, {self._slots.numel()} slots for "
                f"{self.length} tokens (page size {self.page_size})"
            )
        if self.length and not torch.equal(self._slots, self._at(torch.arange(self.length))):
            raise AssertionError("page table: committed slots disagree with the pages")


def check_accounting(pool: LatentKVPool, tables: list[PageTable], cache=None) -> None:
    """free + held by sequences + cached == total, in pages and in slots, every page in use is held by
    exactly one owner: one sequence, or the prefix cache (`cache`: a PrefixCache or None), and every page
    a sequence shares is pinned in the cache (its `pinned_slots` count checked too)."""
    pool.check()
    for t in tables:
        t.check()
    held = torch.cat([t.own_pages() for t in tables]) if tables else _EMPTY
    cached = cache.all_pages() if cache is not None else _EMPTY
    owned = torch.cat([held, cached])
    if owned.numel() != owned.unique().numel():
        raise AssertionError("a KV page is held twice (by two sequences, or by one and the cache)")
    if not bool(pool.in_use(owned).all()):
        raise AssertionError("a KV page held by a sequence or the cache is free in the pool")
    shared = torch.cat([t.pages[: t.shared_pages] for t in tables]) if tables else _EMPTY
    if not bool(torch.isin(shared, cached).all()):
        raise AssertionError("a sequence's shared prefix page is not in the prefix cache")
    P = pool.page_size
    cached_slots = cache.cached_slots if cache is not None else 0
    if cached_slots != cached.numel() * P:
        raise AssertionError(f"prefix cache counts {cached_slots} slots, holds {cached.numel()} pages of {P}")
    if cache is not None:  # a shared page must stay pinned while its sequence runs (never evicted under it)
        pinned = cache.all_pages(pinned_only=True)
        if cache.pinned_slots != pinned.numel() * P:
            raise AssertionError(f"prefix cache counts {cache.pinned_slots} pinned slots, pins {pinned.numel()} pages")
        if not bool(torch.isin(shared, pinned).all()):
            raise AssertionError("a sequence's shared prefix page is not pinned in the prefix cache")
    if pool.num_free_pages + held.numel() + cached.numel() != pool.num_pages:
        raise AssertionError(
            f"KV accounting: free {pool.num_free_pages} + held {held.numel()} + cached "
            f"{cached.numel()} != total {pool.num_pages} pages (page size {P})"
        )
    if pool.num_free + held.numel() * P + cached_slots != pool.num_slots:
        raise AssertionError(
            f"KV accounting: free {pool.num_free} + held {held.numel() * P} + cached "
            f"{cached_slots} != total {pool.num_slots} slots"
        )

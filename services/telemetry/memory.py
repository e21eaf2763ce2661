"""Keep a long-running service's resident memory flat: glibc's allocator, set up once and trimmed while it runs.

A service's RSS under hours of mixed traffic grows for allocator reasons more than for live objects
(docs/performance.md, "Memory under a soak"):
- glibc gives every thread that allocates its own arena (up to 8 per core), and the gRPC handler threads
  of an engine each allocate request tensors: memory freed in one arena is not reused by another;
- freed blocks inside an arena's heap stay resident until something trims them, and glibc raises its mmap
  threshold after large frees, so later large tensors (features, logits) land in the heap as well;
- oneDNN and ideep (torch's CPU matmuls) keep a primitive per shape they have seen, 1024 each by default
  at about 0.3 MB apiece (docs/performance.md section 5): a batch of a new composition is a new shape,
  so under varied traffic both caches fill for hours.

`limit_shape_caches` caps those two caches (ONEDNN_PRIMITIVE_CACHE_CAPACITY, LRU_CACHE_CAPACITY: before
torch loads; a variable set already is kept); `limit_arenas` caps the arenas (M_ARENA_MAX, as
MALLOC_ARENA_MAX would, from inside the process before its threads start); `start_trimming` runs
malloc_trim(0) from a daemon thread every `interval_s`, which hands the free pages of every arena back to
the kernel (madvise), in a few milliseconds. The allocator calls do nothing where
the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

M_ARENA_MAX = -8  # glibc malloc.h
DEFAULT_ARENAS = 2
DEFAULT_TRIM_INTERVAL_S = 10.0
DEFAULT_SHAPE_CACHE = 128  # entries per cache: about 40 MB each at most


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None  # glibc only
    except (OSError, AttributeError):
        return None


def limit_shape_caches(entries: int = DEFAULT_SHAPE_CACHE) -> None:
    """Cap oneDNN's and ideep's per-shape caches at `entries` each (call before torch is imported)."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(entries))


def limit_arenas(arenas: int = DEFAULT_ARENAS) -> bool:
    """Cap glibc's malloc arenas (call before the process starts its threads); False where unsupported."""
    libc = _libc()
    return bool(libc is not None and libc.mallopt(M_ARENA_MAX, arenas))


def trim() -> bool:
    """Return the allocator's free pages to the kernel now; True when some were."""
    libc = _libc()
    return bool(libc is not None and libc.malloc_trim(0))


def start_trimming(interval_s: float = DEFAULT_TRIM_INTERVAL_S) -> threading.Event | None:
    """malloc_trim(0) every interval_s from a daemon thread; set the returned event to stop it (None where
    the C library cannot trim)."""
    libc = _libc()
    if libc is None:
        return None
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(interval_s):
            libc.malloc_trim(0)

    threading.Thread(target=loop, name="malloc-trim", daemon=True).start()
    return stop

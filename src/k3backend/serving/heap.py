"""Give freed heap memory back to the OS, and read a process's resident set size.

A large image makes hundred-megabyte transient allocations (decoded pixels, float32 patches, tower
activations on CPU). glibc serves allocations above its mmap threshold with mmap and unmaps them
on free, but it raises that threshold to the size of each freed mmapped block (up to 32 MiB), so
later blocks of that size come from the heap arenas, and freed heap memory stays mapped. Without
a trim, a model process's RSS climbs to the high-water mark of the largest requests it has seen
and stays there. `malloc_trim(0)` returns the free pages of every arena; it costs well under a
millisecond after small requests and a few milliseconds after large ones. Elsewhere than glibc
it is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def release_free_heap() -> bool:
    """Return the free pages of the malloc heaps to the OS; False where that is not available."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process (Linux /proc), in bytes."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

"""The pool allocator: byte ranges of the pool file handed out as slots (first fit,
coalescing on free), and what it needs of the pool's memory."""

from __future__ import annotations

import bisect
from typing import Protocol

POOL_ALIGN = 4096  # slots start on page boundaries: O_DIRECT and page-granular copies want it


def align_up(n: int, a: int = POOL_ALIGN) -> int:
    return (n + a - 1) // a * a


class PoolAllocator:
    """First-fit allocator of byte ranges in the pool, coalescing on free.

    Slots of one namespace all have one size, so in the common case (one model)
    the free list stays short; several namespaces share the pool by range.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._starts: list[int] = [0] if capacity else []  # sorted free-range starts
        self._sizes: dict[int, int] = {0: capacity} if capacity else {}
        self._live: dict[int, int] = {}  # start -> size of every range handed out
        self.used = 0
        self.high_water = 0  # end of the highest range ever handed out

    def alloc(self, size: int) -> int | None:
        """A range of ``size`` bytes starting at a multiple of ``size``.

        Natural alignment lets a copy address a slot as ``offset // size`` with a
        fixed stride; with one slot size (one model) it wastes nothing.
        """
        size = align_up(size)
        for i, start in enumerate(self._starts):
            avail = self._sizes[start]
            begin = -(-start // size) * size
            if begin + size > start + avail:
                continue
            del self._starts[i]
            del self._sizes[start]
            tail = start + avail - (begin + size)
            if tail:
                self._starts.insert(i, begin + size)
                self._sizes[begin + size] = tail
            if begin > start:
                self._starts.insert(i, start)
                self._sizes[start] = begin - start
            self.used += size
            self.high_water = max(self.high_water, begin + size)
            self._live[begin] = size
            return begin
        return None

    def free(self, offset: int, size: int) -> None:
        """Return a range :meth:`alloc` handed out, with the size it was asked for. Anything
        else (a double free, another size) raises before the free list is touched: a wrong
        free would hand one byte range to two blocks."""
        size = align_up(size)
        had = self._live.pop(offset, None)
        if had != size:
            if had is not None:
                self._live[offset] = had
            what = "not allocated" if had is None else f"allocated with {had} bytes"
            raise RuntimeError(f"pool allocator: free of {size} bytes at offset {offset}, which is {what}")
        self.used -= size
        i = bisect.bisect_left(self._starts, offset)
        # merge with the following range
        if i < len(self._starts) and self._starts[i] == offset + size:
            size += self._sizes.pop(self._starts[i])
            del self._starts[i]
        # merge with the preceding range
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._sizes[prev] == offset:
                self._sizes[prev] += size
                return
            assert prev + self._sizes[prev] < offset, "double free in the pool allocator"
        self._starts.insert(i, offset)
        self._sizes[offset] = size

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used


class PoolMemory(Protocol):
    """The pool's memory as the allocator sees it (:class:`hpkv.common.pool.PoolFile`):
    ``[0, backed)`` exists; ``reserve_to(end)`` makes ``[0, end)`` exist, or says it cannot."""

    backed: int

    def reserve_to(self, end: int) -> bool: ...

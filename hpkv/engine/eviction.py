"""Which evictable DRAM block goes first (``HPKV_DRAM_EVICTION``).

The index (:mod:`hpkv.engine.index`) owns the blocks and decides which are *evictable*
(READY, unpinned, no IO on their slots, files written or not wanted); a policy here only
orders the evictable ones. Its contract, for both policies:

* :meth:`enter` when a block comes into DRAM (committed or read back from storage), before
  anything else about it;
* it holds exactly the blocks the index last reported evictable: :meth:`add` when a block
  becomes (or stays) evictable, :meth:`discard` when it stops being so or leaves DRAM;
* :meth:`victim` removes and returns one of them (None when it holds none), and nothing else;
  the index then frees it. A pinned or in-IO block is never in a policy, so never a victim;
* every operation is O(1) (S3-FIFO's :meth:`victim` amortized: a block moves at most
  ``MAX_FREQ`` + 1 times between two of its hits), and no object is made per block: a block's
  place is an entry of an ordered dict (key → block) and, for S3-FIFO, one small int on the
  block (:attr:`Block.heat`).

``touch`` in :meth:`add` is a use of the block (committed, loaded and released, promoted):
LRU moves it to the most recent end; S3-FIFO counts it.

**LRU** (the default): least recently used first.

**S3-FIFO** (Yang et al., SOSP 2023, "FIFO queues are all you need for cache eviction"):
a block enters a *small* FIFO queue (about 10 % of the evictable bytes); the oldest block of
the small queue leaves DRAM unless it was used since it entered, in which case it moves to the
*main* FIFO queue. The main queue evicts its oldest block whose use count is 0, giving each
used block another round (count - 1). Keys evicted from the small queue are remembered in a
*ghost* (fingerprints of keys only, 16-32 bytes per queued block: :class:`Ghost`); a block
whose key is a ghost, and a block read back from storage (it was asked for again after it left
DRAM), enter the main queue directly. A one-shot prompt's blocks thus pass through the small queue only and never
push the reused prefixes out of the main one, which LRU does whenever the one-shot traffic
between two uses of a prefix exceeds the pool.

A block made unevictable for a while (pinned by a load, read by a spill) leaves its queue and
re-enters it at the newest end of the same queue when it is evictable again.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Generic, Protocol, TypeVar

import numpy as np


class _Shape(Protocol):
    @property
    def slot_bytes(self) -> int: ...

    @property
    def world_size(self) -> int: ...


class Evictable(Protocol):
    """What a policy needs of the index's block (:class:`hpkv.engine.index.Block`, which
    imports this module): its key, its namespace's shape (bytes it holds) and its heat."""

    key: bytes
    heat: int

    @property
    def ns(self) -> _Shape: ...


Block = TypeVar("Block", bound=Evictable)


POLICIES = ("lru", "s3fifo")

# Block.heat for S3-FIFO: queue in the low 2 bits (0: never queued yet), use count above.
SMALL = 1
MAIN = 2
_QUEUE = 3
_FREQ_SHIFT = 2
MAX_FREQ = 3
SMALL_SHARE = 0.10  # of the queued bytes the small queue holds before it evicts


def _bytes(b: Evictable) -> int:
    return b.ns.slot_bytes * b.ns.world_size


class Ghost:
    """Keys recently evicted from the small queue, as 8-byte fingerprints in a direct-mapped
    table (8 bytes a slot, no object per key): a newer key whose slot collides replaces the
    older one, so membership is a hint that fades, as the paper's ghost queue does. The table
    doubles while it is smaller than twice the blocks queued (the fingerprints move along)."""

    MIN_SLOTS = 1024

    def __init__(self) -> None:
        self._t = np.zeros(self.MIN_SLOTS, np.uint64)
        self.size = 0  # slots in use

    @staticmethod
    def _fp(key: bytes) -> int:
        return int.from_bytes(key[:8], "little") | 1 << 63  # 0 marks a free slot; keys are uniform

    def fit(self, blocks: int) -> None:
        """Grow to at least twice ``blocks`` slots."""
        n = len(self._t)
        if n >= 2 * blocks:
            return
        while n < 2 * blocks:
            n *= 2
        old = self._t[self._t != 0]
        self._t = np.zeros(n, np.uint64)
        self._t[old % np.uint64(n)] = old
        self.size = int(np.count_nonzero(self._t))

    def add(self, key: bytes) -> None:
        fp = self._fp(key)
        i = fp & (len(self._t) - 1)
        if self._t[i] == 0:
            self.size += 1
        self._t[i] = fp

    def take(self, key: bytes) -> bool:
        """Whether ``key`` is a ghost (then it is one no more)."""
        fp = self._fp(key)
        i = fp & (len(self._t) - 1)
        if self._t[i] != fp:
            return False
        self._t[i] = 0
        self.size -= 1
        return True

    def __len__(self) -> int:
        return self.size


class Lru(Generic[Block]):
    """Least recently used first."""

    name = "lru"

    def __init__(self) -> None:
        self._q: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._q)

    def __contains__(self, key: bytes) -> bool:
        return key in self._q

    def enter(self, b: Block, reused: bool = False) -> None:
        pass

    def add(self, b: Block, touch: bool = False) -> None:
        if touch or b.key not in self._q:
            self._q[b.key] = b
            self._q.move_to_end(b.key)

    def add_first(self, b: Block) -> None:
        """Queue ``b`` to go next (a victim kept for a copy below, whose copy ended)."""
        self._q[b.key] = b
        self._q.move_to_end(b.key, last=False)

    def discard(self, b: Block) -> None:
        self._q.pop(b.key, None)

    def victim(self) -> Block | None:
        if not self._q:
            return None
        return self._q.popitem(last=False)[1]

    def describe(self) -> dict[str, int]:
        return {"queued": len(self._q)}


class S3Fifo(Generic[Block]):
    """S3-FIFO: a small probation FIFO, a main FIFO with use counts, a ghost of keys."""

    name = "s3fifo"

    def __init__(self, small_share: float = SMALL_SHARE) -> None:
        self.small_share = small_share
        self._small: OrderedDict[bytes, Block] = OrderedDict()  # oldest first
        self._main: OrderedDict[bytes, Block] = OrderedDict()  # oldest first
        self._ghost = Ghost()  # keys evicted from small
        self._small_bytes = 0
        self._main_bytes = 0
        self.moved_to_main = 0  # blocks used while in the small queue
        self.ghost_hits = 0  # blocks that came back after leaving from the small queue

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __contains__(self, key: bytes) -> bool:
        return key in self._small or key in self._main

    def queue_of(self, b: Block) -> str | None:
        """'small', 'main', or None (not queued now): for tests and monitors."""
        if b.key in self._small:
            return "small"
        if b.key in self._main:
            return "main"
        return None

    @staticmethod
    def uses(b: Block) -> int:
        return b.heat >> _FREQ_SHIFT

    def enter(self, b: Block, reused: bool = False) -> None:
        """``b`` came into DRAM (committed, or read back from storage: ``reused``), evictable or
        not yet: it will queue in the main queue if it was asked for again since it left DRAM
        (read back, or a ghost), else in the small one."""
        q = SMALL
        if self._ghost.take(b.key):
            self.ghost_hits += 1
            q = MAIN
        elif reused:
            q = MAIN
        b.heat = q

    def add(self, b: Block, touch: bool = False) -> None:
        q = b.heat & _QUEUE
        if q == 0:  # never entered (a caller that skipped enter): on probation
            q = b.heat = SMALL
        elif touch:
            b.heat = q | min((b.heat >> _FREQ_SHIFT) + 1, MAX_FREQ) << _FREQ_SHIFT
        if q == SMALL:
            if b.key not in self._small:
                self._small[b.key] = b
                self._small_bytes += _bytes(b)
        elif b.key not in self._main:
            self._main[b.key] = b
            self._main_bytes += _bytes(b)

    def add_first(self, b: Block) -> None:
        """Queue ``b`` to go next from its queue, its use count kept (a victim kept for a copy
        below, whose copy ended; it was no ghost meanwhile)."""
        self._ghost.take(b.key)
        self.add(b)
        q = self._small if b.heat & _QUEUE == SMALL else self._main
        q.move_to_end(b.key, last=False)

    def discard(self, b: Block) -> None:
        if self._small.pop(b.key, None) is not None:
            self._small_bytes -= _bytes(b)
        elif self._main.pop(b.key, None) is not None:
            self._main_bytes -= _bytes(b)

    def victim(self) -> Block | None:
        while self._small or self._main:
            total = self._small_bytes + self._main_bytes
            if self._small and (not self._main or self._small_bytes >= self.small_share * total):
                _, b = self._small.popitem(last=False)
                self._small_bytes -= _bytes(b)
                uses = b.heat >> _FREQ_SHIFT
                if uses:  # used while on probation: into the main queue, for one use
                    b.heat = MAIN | (uses - 1) << _FREQ_SHIFT
                    self._main[b.key] = b
                    self._main_bytes += _bytes(b)
                    self.moved_to_main += 1
                    continue
                self._ghost.fit(len(self) + 1)
                self._ghost.add(b.key)
                return b
            _, b = self._main.popitem(last=False)
            uses = b.heat >> _FREQ_SHIFT
            if uses:  # another round, one use less
                b.heat = MAIN | (uses - 1) << _FREQ_SHIFT
                self._main[b.key] = b
                continue
            self._main_bytes -= _bytes(b)
            return b
        return None

    def describe(self) -> dict[str, int]:
        return {
            "queued": len(self),
            "small": len(self._small),
            "main": len(self._main),
            "ghost": len(self._ghost),
            "moved_to_main": self.moved_to_main,
            "ghost_hits": self.ghost_hits,
        }


def make_policy(name: str) -> Lru[Any] | S3Fifo[Any]:
    if name == "lru":
        return Lru()
    if name == "s3fifo":
        return S3Fifo()
    raise ValueError(f"HPKV_DRAM_EVICTION={name!r} is not one of {', '.join(POLICIES)}")

"""The server's block index (its pool allocator: :mod:`hpkv.engine.allocator`).

One process (the server) owns the index; nothing else mutates it. A *block* is
one engine block of one namespace (a model layout), identified by a 16-byte key
derived from the namespace fingerprint and the engine's chained block hash
(:func:`hpkv.protocol.keys.block_key`). With tensor parallelism a block has one
*shard* per rank; each shard has its own pool slot, and the block becomes visible
to lookups only when every rank has committed its shard.

Identity. A block is (namespace, key), and a key belongs to the namespace that
first made it (reserved it, or found its files): until that block is gone, every
call made under another namespace treats the key as absent (lookup and pin miss,
reserve answers -2 and counts a conflict, commit/abort/unpin ignore it). Honest
clients never meet this (a key hashes the namespace fingerprint); a client that
reuses keys across namespaces can then never put a block into a slot of another
namespace's size, nor see, pin, commit or free another namespace's block.

States of a block (a key holding pool slots)::

    reserve ──▶ RESERVED ──(all ranks commit)──▶ READY ──(evict)──▶ gone from the index
                    │                              ▲                (files only, or nothing)
                    └─(owner gone / aborted)─▶ freed  └──(files read)── PROMOTING ◀─(promote)─ files only

Files. Which keys have a copy below the pool is known by the catalogs of the tiers below
(:class:`hpkv.engine.storage.catalog.FileCatalog`: the file tier's, the remote tier's;
:attr:`Index.below`, in tier order); the index asks them and keeps only what it owns: pool
slots, pins, reservations. A key with a copy below and no slots ("stored") is no block of
the index: it is a catalog's entry, which the catalog makes visible to lookups through
:meth:`Index.files_added` and :meth:`Index.files_gone`, with the wire tier of the first
catalog that has it (in HPKV_TIER_ORDER: files before the remote store by default; the key
table answers lookups for all tiers at C speed). A PROMOTING block is a block whose slots a
tier below is filling.

Ownership. A reservation belongs to the client that made it (``owner``); a pin
belongs to the client that pinned it (``pins_by_owner``), counted only when a block
was really pinned. Releasing a reservation (aborted, owner gone, lease over) *retires*
it, invisible and unwritable by commits, and the server frees it (:meth:`Index.free_retired`)
at once: a freed slot gets a new generation (the server's slot fence), so no save made for
the old reservation can land in it; a slot a save is still copying into waits in ``fenced``
until that copy ends (:meth:`Index.reclaim_fenced`). A block's slots also take a new
generation when its last rank commits (sealed): once served, no save can change it.

A READY block is *evictable* when it is unpinned, no IO job is reading its slots
(``io``), and, if the storage tier is on, its files are written or will not be
(``no_spill``: spilling paused or failed) — a block is never dropped while its
spill is in flight. Eviction takes the evictable block the policy
(``HPKV_DRAM_EVICTION``, :mod:`hpkv.engine.eviction`: LRU by default, or S3-FIFO) puts first,
across all namespaces, unless :attr:`Index.before_evict` (the remote tier's publish on
eviction) starts copying it below instead: it then stays until that copy ends (back at the
head of the policy's queue, unless it was used meanwhile) and the next victim is taken, never
waited for.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

import numpy as np

from hpkv.engine.allocator import PoolAllocator, PoolMemory, align_up
from hpkv.engine.events import REMOVED_DRAM, STORED_DRAM, NsEventLog
from hpkv.engine.eviction import Lru, S3Fifo, make_policy
from hpkv.engine.keytable import KeyTable
from hpkv.protocol.errors import NamespaceNotAttached, NotOwner
from hpkv.protocol.stats import NS_COUNTERS, NsCounter
from hpkv.protocol.wire import Tier

# The owner of operator pins (`hpkv pin`): no client, so no lease and no client's exit ends them.
OPERATOR = -1


class State(IntEnum):
    RESERVED = 1
    READY = 2
    # 3 was STORED: a key with files only is the catalog's, not a block of the index
    PROMOTING = 4  # files being read into freshly allocated slots; still a storage hit


class FileOwner(Protocol):
    """Who knows which keys have a copy in one tier below the pool (the tier's catalog)."""

    def owner(self, key: bytes) -> Namespace | None:
        """The namespace whose copy ``key`` has there, None when it has none."""
        ...

    def held_many(self, keys: bytes, n: int) -> bytes | None:
        """For each of ``n`` 16-byte keys: 1 when :meth:`owner` has a namespace for it, else 0,
        in one native call; None when that cannot be said in one (ask :meth:`owner`)."""
        ...


@dataclass
class Namespace:
    ns_id: int
    name: str  # human-readable (model, layout) for monitors
    fingerprint: str
    world_size: int
    shard_bytes: int  # bytes of one rank's shard of one block
    block_tokens: int = 0  # tokens per block (for token counts in monitors; 0 = unknown)
    released: bool = False  # dropped by the server (no client, id reused): scans stop
    counters: np.ndarray = field(default_factory=lambda: np.zeros(NS_COUNTERS, np.int64))
    # Its blocks' tier changes, once a client asked for them (KV events); None: nobody did.
    events: NsEventLog | None = None

    @property
    def slot_bytes(self) -> int:
        return align_up(self.shard_bytes)


class Block:
    __slots__ = (
        "key",
        "ns",
        "state",
        "slots",
        "committed",
        "pins",
        "owner",
        "io",
        "no_spill",
        "since",
        "retired",
        "used",
        "heat",
        "kept",
    )

    def __init__(self, key: bytes, ns: Namespace, slots: list[int], owner: int):
        self.key = key
        self.ns = ns
        self.state = State.RESERVED
        self.slots: list[int] | None = slots  # pool offset per rank
        self.committed = 0  # bitmask of ranks
        self.pins = 0
        self.owner = owner  # client that reserved it (RESERVED only)
        self.io = 0  # IO jobs in flight that read its slots (spills)
        self.no_spill = False  # storage on, but this block will not get files
        self.since = time.monotonic()  # when reserved (the reservation's lease starts)
        self.retired = False  # RESERVED, released, waiting for its copies to end
        self.used = self.since  # when last committed, loaded or promoted (`hpkv evict --older-than`)
        self.heat = 0  # the eviction policy's state of the block (hpkv.engine.eviction)
        self.kept = False  # a victim Index.before_evict kept: first to go once evictable again

    @property
    def in_dram(self) -> bool:
        return self.state == State.READY


class Index:
    """key → block state, tier, slots, pins and recency; eviction by HPKV_DRAM_EVICTION."""

    def __init__(
        self,
        pool_capacity: int,
        storage_enabled: bool = False,
        on_evict: Callable[[Block], None] | None = None,
        memory: PoolMemory | None = None,
        fence_bump: Callable[[int], bool] | None = None,
        eviction: str = "lru",
        below_order: Sequence[int] = (Tier.STORAGE, Tier.REMOTE),
    ):
        self.alloc = PoolAllocator(pool_capacity)
        self.memory = memory  # None: every byte of the pool exists (tests)
        # Starts a freed slot on a new generation (the server's SlotFence.bump): False while a
        # copy into the slot is still running; the slot then waits in ``fenced`` (reclaim_fenced).
        self._fence_bump = fence_bump
        self.fenced: list[tuple[int, int]] = []  # (offset, size) freed, not yet back in the allocator
        self.torn_commits = 0  # blocks committed while a save into them still ran (dropped)
        self.storage_enabled = storage_enabled
        # (wire tier, catalog) of the tiers below, in tier order (``below_order``: HPKV_TIER_ORDER's
        # wire tiers, files then the remote store by default): each catalog adds itself
        self.below: list[tuple[int, FileOwner]] = []
        self._below_rank = {int(t): i for i, t in enumerate(below_order)}
        self.blocks: dict[bytes, Block] = {}  # key -> block holding slots; the key belongs to block.ns
        # key -> (ns id, Tier) of every key a lookup can hit (READY: DRAM; a copy below only, or
        # PROMOTING: the first tier below that has it, storage or remote). Kept beside
        # ``blocks`` in a native table, so a lookup runs in C.
        self.present = KeyTable()
        self.conflicts = 0  # reserves of a key that belongs to another namespace (refused)
        self.namespaces: dict[int, Namespace] = {}
        # The evictable READY blocks, in the order HPKV_DRAM_EVICTION evicts them
        self.evictable: Lru[Block] | S3Fifo[Block] = make_policy(eviction)
        self._on_evict = on_evict
        # A tier that copies a block when the pool evicts it (HPKV_REMOTE_WRITE_POLICY=evict):
        # called with the victim, True when it started reading the victim's slots instead
        # (the block stays until that ends, not evictable meanwhile; the next victim is taken).
        self.before_evict: Callable[[Block], bool] | None = None
        self.pinned_bytes = 0
        self.reserved: dict[bytes, Block] = {}  # RESERVED blocks (retired ones too)
        # owner -> key -> [pins held, monotonic time of the latest]: who holds which pins
        self.pins_by_owner: dict[int, dict[bytes, list]] = {}

    # ------------------------------------------------------------ namespaces
    def add_namespace(self, ns: Namespace) -> None:
        self.namespaces[ns.ns_id] = ns

    def ns(self, ns_id: int) -> Namespace:
        try:
            return self.namespaces[ns_id]
        except KeyError:
            raise NamespaceNotAttached(f"namespace id {ns_id} is not attached") from None

    def owner(self, key: bytes) -> Namespace | None:
        """The namespace of the block holding slots for ``key``, None when there is none."""
        b = self.blocks.get(key)
        return b.ns if b is not None else None

    def block_count(self) -> int:
        """Keys the server knows: blocks holding slots and keys with files only."""
        # RESERVED blocks are the ones not in the key table; every other key is in it once
        return len(self.reserved) + len(self.present)

    def add_below(self, catalog: FileOwner, tier: int) -> None:
        """A tier below the pool knows its keys through ``catalog``; its stored keys are hits of
        wire tier ``tier`` where no catalog of a tier before it (in ``below_order``) has them."""
        self.below = [(t, c) for t, c in self.below if t != tier]  # a new catalog replaces its tier's
        self.below.append((tier, catalog))
        self.below.sort(key=lambda tc: (self._below_rank.get(tc[0], len(self._below_rank)), tc[0]))

    def below_owner(self, key: bytes) -> tuple[int, Namespace] | None:
        """(wire tier, namespace) of the first tier below the pool that has ``key``."""
        for tier, cat in self.below:
            ns = cat.owner(key)
            if ns is not None:
                return tier, ns
        return None

    def _has_files(self, key: bytes) -> bool:
        return self.below_owner(key) is not None

    def _present_below(self, key: bytes) -> None:
        """``key`` holds no slots: a hit of the first tier below that has it, or no hit."""
        found = self.below_owner(key)
        if found is None:
            self.present.pop(key, None)
        else:
            self.present.set(key, found[1].ns_id, found[0])

    def _mine(self, ns: Namespace, k: bytes) -> Block | None:
        """The block of ``k`` if it belongs to ``ns`` (another namespace's key is absent)."""
        b = self.blocks.get(k)
        return b if b is not None and b.ns is ns else None

    # ------------------------------------------------------------ evictability
    def _is_evictable(self, b: Block) -> bool:
        return (
            b.state == State.READY
            and b.pins == 0
            and b.io == 0
            and (b.no_spill or not self.storage_enabled or self._has_files(b.key))
        )

    def _refresh(self, b: Block, touch: bool = False) -> None:
        """Tell the eviction policy whether ``b`` is evictable now; ``touch``: it was used
        (committed, loaded, promoted)."""
        if touch:
            b.used = time.monotonic()
            b.kept = False
        if self._is_evictable(b):
            if b.kept:  # its copy below ended: it goes next, as it would have then
                b.kept = False
                self.evictable.add_first(b)
            else:
                self.evictable.add(b, touch)
        else:
            self.evictable.discard(b)

    def _enter(self, b: Block, reused: bool = False) -> None:
        """``b`` just became READY (committed, or read back from storage: ``reused``)."""
        b.used = time.monotonic()
        self.evictable.enter(b, reused)
        self._refresh(b)  # its first use is its entry, not a hit

    def _free_slots(self, b: Block) -> None:
        assert b.slots is not None
        size = b.ns.slot_bytes
        for off in b.slots:
            if off >= 0:
                self._free_fenced(off, size)
        b.slots = None

    def _free_fenced(self, off: int, size: int) -> None:
        """Back to the allocator once no save made for the slot's old owner can land in it."""
        if self._fence_bump is None or self._fence_bump(off):
            self.alloc.free(off, size)
        else:
            self.fenced.append((off, size))

    def reclaim_fenced(self) -> int:
        """Free the slots whose copy has ended since they were released; returns how many."""
        if not self.fenced:
            return 0
        waiting, self.fenced = self.fenced, []
        for off, size in waiting:
            self._free_fenced(off, size)
        return len(waiting) - len(self.fenced)

    def _drop_from_dram(self, b: Block) -> None:
        """The block's pool copy is gone: it lives on as the catalog's files, or not at all."""
        del self.blocks[b.key]
        self._present_below(b.key)

    def _evict_one(self) -> bool:
        while True:
            b = self.evictable.victim()
            if b is None:
                return False
            assert self.blocks.get(b.key) is b and self._is_evictable(b), "eviction policy out of step"
            if self.before_evict is None or not self.before_evict(b):
                break
            # copied below first: out of the policy's queue until that ends, never waited for
            assert not self._is_evictable(b), "before_evict kept a block without starting IO on it"
            b.kept = True
        key = b.key
        c = b.ns.counters
        c[NsCounter.BLOCKS_DRAM] -= 1
        c[NsCounter.BYTES_DRAM] -= b.ns.slot_bytes * b.ns.world_size
        c[NsCounter.EVICTIONS] += 1
        self._free_slots(b)
        self._drop_from_dram(b)
        if b.ns.events is not None:
            b.ns.events.add(key, REMOVED_DRAM)
        if self._on_evict is not None:
            self._on_evict(b)
        return True

    def _alloc_slot(self, size: int) -> int | None:
        """A slot whose memory exists: a slot beyond what the file system could reserve is
        given back and an LRU block evicted instead (its slot lies below, reserved already)."""
        mem = self.memory
        while True:
            off = self.alloc.alloc(size)
            if off is not None:
                end = off + align_up(size)
                if mem is None or end <= mem.backed or mem.reserve_to(end):
                    return off
                self.alloc.free(off, size)
            if not self._evict_one():
                return None

    # ------------------------------------------------------------ protocol operations
    def lookup(self, ns_id: int, keys: Sequence[bytes]) -> tuple[int, list[int]]:
        """How many leading keys are present in namespace ``ns_id``, and the tier of each.

        No side effects (the engine may ask again and again): recency is updated
        when a hit is pinned for loading.
        """
        return self.present.lookup(ns_id, keys)

    def count_lookup(self, ns: Namespace, n_keys: int, tiers: list[int]) -> None:
        c = ns.counters
        dram = tiers.count(Tier.DRAM)
        remote = tiers.count(Tier.REMOTE)
        c[NsCounter.LOOKUPS] += 1
        c[NsCounter.HITS_DRAM] += dram
        c[NsCounter.HITS_STORAGE] += len(tiers) - dram - remote
        c[NsCounter.HITS_REMOTE] += remote
        if len(tiers) < n_keys:
            c[NsCounter.MISSES] += 1

    def reserve(self, ns_id: int, keys: Sequence[bytes], owner: int = 0) -> np.ndarray:
        """Allocate one pool slot per rank for each new key.

        Returns int64 ``[len(keys), world_size]``: pool offsets, or -1 for a key
        that needs no write (already present or being written) and -2 where the
        pool is full of blocks that cannot be evicted, or where the key belongs to
        another namespace (counted in :attr:`conflicts`): the caller skips saving it.
        """
        ns = self.ns(ns_id)
        out = np.full((len(keys), ns.world_size), -1, np.int64)
        size = ns.slot_bytes
        self.reclaim_fenced()
        for i, k in enumerate(keys):
            b = self.blocks.get(k)
            below = self.below_owner(k) if b is None else None
            holder = b.ns if b is not None else below[1] if below is not None else None
            if holder is not None and holder is not ns:
                out[i] = -2  # never a slot of this size for another namespace's block
                self.conflicts += 1
                continue
            if b is not None:
                continue
            slots: list[int] = []
            for _ in range(ns.world_size):
                off = self._alloc_slot(size)
                if off is None:
                    break
                slots.append(off)
            if len(slots) < ns.world_size:
                for off in slots:
                    self.alloc.free(off, size)
                out[i] = -2
                ns.counters[NsCounter.RESERVE_FAILED] += 1
                continue
            b = Block(k, ns, slots, owner)
            self.blocks[k] = b
            if holder is ns:  # files only, written again: no hit until committed
                self.present.pop(k, None)
            self.reserved[k] = b
            ns.counters[NsCounter.BLOCKS_RESERVED] += 1
            out[i] = slots
        return out

    def check_owner(self, ns: Namespace, keys: Iterable[bytes], client: int, writer: bool) -> None:
        """Raise :class:`NotOwner` if any of these live reservations of ``ns`` belongs to another
        client and ``client`` is not a declared writer of the namespace (a rank's worker)."""
        if writer:
            return
        for k in keys:
            b = self.reserved.get(k)
            if b is not None and b.ns is ns and not b.retired and b.owner != client:
                raise NotOwner(f"key {k.hex()} is reserved by client {b.owner}, not {client}")

    def commit(self, ns_id: int, keys: Iterable[bytes], rank: int) -> list[Block]:
        """Rank ``rank`` wrote its shard of these keys; returns blocks that became READY.
        Retired reservations (released while the copy ran) are not committed."""
        ns = self.ns(ns_id)
        if not 0 <= rank < ns.world_size:
            raise ValueError(f"rank {rank} outside 0..{ns.world_size - 1}")
        full = (1 << ns.world_size) - 1
        ready: list[Block] = []
        for k in keys:
            b = self.blocks.get(k)
            if b is None or b.state != State.RESERVED or b.retired or b.ns is not ns:
                continue
            b.committed |= 1 << rank
            if b.committed == full and not self._seal(b):
                # A copy into it was still running at its last commit (a client that commits
                # before its save ended): its bytes are not known whole, so it is never served.
                self.torn_commits += 1
                b.retired = True
                self.free_retired([b])
            elif b.committed == full:
                b.state = State.READY
                b.owner = 0
                del self.reserved[k]
                self.present.set(k, ns.ns_id, Tier.DRAM)
                c = ns.counters
                c[NsCounter.BLOCKS_RESERVED] -= 1
                c[NsCounter.BLOCKS_DRAM] += 1
                c[NsCounter.BYTES_DRAM] += ns.slot_bytes * ns.world_size
                c[NsCounter.COMMITS] += 1
                self._enter(b)
                ready.append(b)
                if ns.events is not None:
                    ns.events.add(k, STORED_DRAM)
        return ready

    def _seal(self, b: Block) -> bool:
        """A block every rank committed takes new slot generations: no save made for its
        reservation (a retried or duplicated one) can change it once it is served. False when
        a copy into one of its slots is still running."""
        if self._fence_bump is None:
            return True
        assert b.slots is not None
        return all([self._fence_bump(off) for off in b.slots])  # a list: bump every slot

    def retire(self, keys: Iterable[bytes], ns: Namespace | None = None) -> list[Block]:
        """Release reservations that will never be committed (failed copy, owner gone, lease
        over): they become invisible to commits but keep their slots until :meth:`free_retired`,
        which the server calls once no copy into them can still be running. With ``ns`` (a
        client's abort), only that namespace's reservations."""
        out = []
        for k in keys:
            b = self.reserved.get(k)
            if b is None or b.retired or (ns is not None and b.ns is not ns):
                continue
            b.retired = True
            out.append(b)
        return out

    def free_retired(self, blocks: Iterable[Block]) -> int:
        """Free the slots of retired reservations (no copy into them is running any more)."""
        n = 0
        for b in blocks:
            if b.state != State.RESERVED or not b.retired or self.reserved.get(b.key) is not b:
                continue
            del self.reserved[b.key]
            b.ns.counters[NsCounter.BLOCKS_RESERVED] -= 1
            self._free_slots(b)
            b.committed = 0
            b.retired = False
            self._drop_from_dram(b)
            n += 1
        return n

    def abort(self, keys: Iterable[bytes], ns: Namespace | None = None) -> None:
        """Retire and free at once: only when no copy into these reservations can be running."""
        self.free_retired(self.retire(list(keys), ns))

    def abort_owner(self, owner: int) -> int:
        """Retire and free every live reservation of ``owner`` (no copy may be running)."""
        keys = self.owned_reservations(owner)
        self.abort(keys)
        return len(keys)

    def owned_reservations(self, owner: int) -> list[bytes]:
        return [k for k, b in self.reserved.items() if b.owner == owner and not b.retired]

    def expired_reservations(self, lease: float, now: float | None = None) -> list[bytes]:
        now = time.monotonic() if now is None else now
        return [k for k, b in self.reserved.items() if not b.retired and now - b.since > lease]

    def pin(self, ns: Namespace, keys: Iterable[bytes], owner: int = 0) -> list[list[int] | None]:
        """Pin present blocks of ``ns`` against eviction for ``owner``; returns each block's slots
        (None if not in DRAM or another namespace's: then nothing is pinned, and nothing is
        recorded for the owner)."""
        out: list[list[int] | None] = []
        held = self.pins_by_owner.setdefault(owner, {})
        now = time.monotonic()
        for k in keys:
            b = self.blocks.get(k)
            if b is None or b.ns is not ns or b.state != State.READY or b.slots is None:
                out.append(None)
                continue
            if b.pins == 0:
                b.ns.counters[NsCounter.BLOCKS_PINNED] += 1
                self.pinned_bytes += b.ns.slot_bytes * b.ns.world_size
            b.pins += 1
            self._refresh(b)
            rec = held.get(k)
            if rec is None:
                held[k] = [1, now]
            else:
                rec[0] += 1
                rec[1] = now
            out.append(list(b.slots))
        if not held:
            del self.pins_by_owner[owner]
        return out

    def unpin(self, keys: Iterable[bytes], owner: int = 0, ns: Namespace | None = None) -> int:
        """Release pins ``owner`` holds (one per occurrence of a key; with ``ns``, of that
        namespace's blocks only); a key the owner did not pin is ignored, so no client can
        release another's pin. Returns pins released."""
        held = self.pins_by_owner.get(owner)
        if not held:
            return 0
        n = 0
        for k in keys:
            rec = held.get(k)
            if rec is None or (ns is not None and self._mine(ns, k) is None):
                continue
            rec[0] -= 1
            if rec[0] <= 0:
                del held[k]
            self._unpin_one(k)
            n += 1
        if not held:
            self.pins_by_owner.pop(owner, None)
        return n

    def take_pins(self, owner: int, keys: Iterable[bytes] | None = None) -> list[bytes]:
        """Detach ``owner``'s pins (all, or of ``keys``) from it without releasing them: one
        key per pin held. The server releases them with :meth:`drop_pins` once no copy out of
        the blocks can still be running."""
        held = self.pins_by_owner.get(owner)
        if not held:
            return []
        which = list(held) if keys is None else [k for k in keys if k in held]
        out = []
        for k in which:
            rec = held.pop(k, None)
            if rec is not None:
                out.extend([k] * rec[0])
        if not held:
            self.pins_by_owner.pop(owner, None)
        return out

    def expired_pins(self, lease: float, now: float | None = None) -> dict[int, list[bytes]]:
        """owner -> keys whose latest pin is older than ``lease`` seconds."""
        now = time.monotonic() if now is None else now
        return {
            o: ks
            for o, held in self.pins_by_owner.items()
            if o != OPERATOR and (ks := [k for k, rec in held.items() if now - rec[1] > lease])
        }

    def drop_pins(self, keys: Iterable[bytes]) -> None:
        """Release pins detached by :meth:`take_pins`."""
        for k in keys:
            self._unpin_one(k)

    def pins_of(self, owner: int) -> int:
        return sum(rec[0] for rec in self.pins_by_owner.get(owner, {}).values())

    def _unpin_one(self, k: bytes) -> None:
        b = self.blocks.get(k)
        if b is None or b.pins == 0:
            return
        b.pins -= 1
        if b.pins == 0:
            b.ns.counters[NsCounter.BLOCKS_PINNED] -= 1
            self.pinned_bytes -= b.ns.slot_bytes * b.ns.world_size
        self._refresh(b, touch=True)

    # ------------------------------------------------------------ storage tier
    def files_added(self, ns: Namespace, key: bytes) -> None:
        """A catalog learned that ``key`` has a copy in its tier (spill done, scan, stat, the
        store's answer): a DRAM copy may now be evicted, a key with no slots is a hit of the
        first tier below that has it."""
        b = self.blocks.get(key)
        if b is None:
            self._present_below(key)
        else:
            self._refresh(b)

    def files_found(self, ns: Namespace, keys: bytes, n: int, tier: int = Tier.STORAGE) -> None:
        """:meth:`files_added` of ``n`` keys (16 bytes each in ``keys``) that hold no slots (a
        scan's or a journal's batch), found by the catalog of ``tier``: a key a tier before it
        has keeps that tier's hit (its hits win), the others are hits of ``tier``, in one native
        call per tier (HPKV_TIER_ORDER=remote,files: the files' batches too)."""
        at = next((i for i, (t, _) in enumerate(self.below) if t == tier), len(self.below))
        earlier: list[bytes] = []
        for _, cat in self.below[:at]:
            held = cat.held_many(keys, n)
            if held is None:
                for i in range(n):
                    self._present_below(keys[16 * i : 16 * i + 16])
                return
            earlier.append(held)
        if earlier:
            taken = earlier[0] if len(earlier) == 1 else bytes(map(max, *earlier))
            keys = b"".join([keys[16 * i : 16 * i + 16] for i, t in enumerate(taken) if not t])
            n = len(keys) // 16
        if n:
            self.present.set_many(keys, n, ns.ns_id, tier)

    def files_gone(self, key: bytes) -> None:
        """A catalog forgot the key's copy (evicted, corrupt, missing, namespace released): a
        key with no slots is a hit of the next tier below that has it, or no hit any more; a
        DRAM copy stays (and is not spilled again)."""
        b = self.blocks.get(key)
        if b is None:
            self._present_below(key)
        elif b.state == State.READY:
            b.no_spill = True
            self._refresh(b)

    def spill_started(self, b: Block) -> None:
        """A spill reads the block's slots: not evictable until :meth:`set_io` (-1) ends it."""
        b.no_spill = False
        self.set_io(b, +1)

    def set_io(self, b: Block, delta: int) -> None:
        """IO jobs started (+) or finished (-) on the block's slots; it is not evictable meanwhile."""
        b.io += delta
        self._refresh(b)

    def in_io(self, key: bytes) -> bool:
        """An IO job reads the block's slots (its files must stay)."""
        b = self.blocks.get(key)
        return b is not None and b.io > 0

    def spillable(self, key: bytes) -> Block | None:
        """The block if a spill may start on it now: READY and no IO job on its slots."""
        b = self.blocks.get(key)
        return b if b is not None and b.state == State.READY and not b.io else None

    def in_dram(self, ns: Namespace, key: bytes) -> bool:
        b = self._mine(ns, key)
        return b is not None and b.state == State.READY

    def skip_spill(self, b: Block) -> None:
        """The block will not get files (spilling paused or failed): evictable without them."""
        b.no_spill = True
        self._refresh(b)

    def begin_promote(self, ns: Namespace, key: bytes) -> Block | None:
        """A PROMOTING block of ``ns``'s key with files only: pool slots to read its files into
        (evicting LRU blocks). None, and nothing changed, when the key holds slots already or
        the pool is full of blocks that cannot be evicted."""
        if key in self.blocks:
            return None
        assert any(cat.owner(key) is ns for _, cat in self.below), "promote of a key with no copy below"
        size = ns.slot_bytes
        slots: list[int] = []
        for _ in range(ns.world_size):
            off = self._alloc_slot(size)
            if off is None:
                for o in slots:
                    self.alloc.free(o, size)
                ns.counters[NsCounter.RESERVE_FAILED] += 1
                return None
            slots.append(off)
        b = Block(key, ns, slots, owner=0)
        b.state = State.PROMOTING
        self.blocks[key] = b
        return b

    def finish_promote(self, key: bytes, ok: bool) -> None:
        """The files were read into the slots (READY, a DRAM block like any other), or not
        (slots freed: files only again)."""
        b = self.blocks[key]
        assert b.state == State.PROMOTING, b.state
        if ok:
            b.state = State.READY
            self.present.set(key, b.ns.ns_id, Tier.DRAM)
            c = b.ns.counters
            c[NsCounter.BLOCKS_DRAM] += 1
            c[NsCounter.BYTES_DRAM] += b.ns.slot_bytes * b.ns.world_size
            self._enter(b, reused=True)
            if b.ns.events is not None:
                b.ns.events.add(key, STORED_DRAM)
        else:
            self._free_slots(b)
            self._drop_from_dram(b)

    def drop_namespace(self, ns: Namespace) -> bool:
        """Forget a namespace no client uses: its DRAM copies are freed (the catalog forgets its
        files, which stay, when the storage tier detaches it). False, and nothing changed,
        while any of its blocks is reserved, pinned, promoting or in IO."""
        mine = [b for b in self.blocks.values() if b.ns is ns]
        if any(b.state in (State.RESERVED, State.PROMOTING) or b.pins or b.io for b in mine):
            return False
        for b in mine:
            if b.state == State.READY:
                self.evictable.discard(b)
                self._free_slots(b)
            del self.blocks[b.key]
            self.present.pop(b.key, None)
        for owner in list(self.pins_by_owner):  # no pins left on it (checked above)
            if not self.pins_by_owner[owner]:
                del self.pins_by_owner[owner]
        ns.counters[:] = 0
        self.namespaces.pop(ns.ns_id, None)
        return True

    def clear_namespace(self, ns_id: int) -> int:
        """Drop the namespace's DRAM copies (pinned and reserved blocks stay); returns blocks dropped."""
        victims, _ = self.dram_victims(self.ns(ns_id), cutoff=None)
        return self.drop_dram(victims)

    # ------------------------------------------------------------ operator calls (hpkv evict, hpkv pin)
    def dram_victims(self, ns: Namespace, cutoff: float | None) -> tuple[list[Block], dict[str, int]]:
        """``ns``'s DRAM blocks `hpkv evict` may drop (READY, unpinned, no IO on their slots, not
        used since monotonic time ``cutoff`` when given), and what it must skip, counted by why."""
        out: list[Block] = []
        skipped = {"pinned": 0, "reserved": 0, "in_io": 0, "recent": 0}
        for b in self.blocks.values():
            if b.ns is not ns:
                continue
            if b.state != State.READY:
                skipped["reserved"] += 1  # being written (RESERVED) or read from storage (PROMOTING)
            elif b.pins:
                skipped["pinned"] += 1
            elif b.io:
                skipped["in_io"] += 1
            elif cutoff is not None and b.used > cutoff:
                skipped["recent"] += 1
            else:
                out.append(b)
        return out, skipped

    def drop_dram(self, blocks: Iterable[Block]) -> int:
        """Drop these DRAM copies (from :meth:`dram_victims`, under the same lock hold); returns
        blocks dropped."""
        n = 0
        for b in blocks:
            ns = b.ns
            self.evictable.discard(b)
            ns.counters[NsCounter.BLOCKS_DRAM] -= 1
            ns.counters[NsCounter.BYTES_DRAM] -= ns.slot_bytes * ns.world_size
            self._free_slots(b)
            self._drop_from_dram(b)
            if ns.events is not None:
                ns.events.add(b.key, REMOVED_DRAM)
            n += 1
        return n

    def operator_pinned(self, ns: Namespace | None = None) -> list[bytes]:
        """Keys the operator pinned (of ``ns`` only, when given)."""
        held = self.pins_by_owner.get(OPERATOR, {})
        return [k for k in held if ns is None or self._mine(ns, k) is not None]

    def operator_pinned_bytes(self) -> int:
        return sum(
            b.ns.slot_bytes * b.ns.world_size
            for k in self.pins_by_owner.get(OPERATOR, {})
            if (b := self.blocks.get(k)) is not None
        )

    def operator_pin(self, ns: Namespace, keys: Iterable[bytes], cap: int) -> tuple[int, int, list[bytes]]:
        """Pin ``ns``'s DRAM blocks of ``keys`` for the operator (once per key: pinning a pinned
        key again changes nothing), unless the operator's pins would then exceed ``cap`` bytes
        (then :class:`PinCapExceeded`, nothing pinned). Returns (blocks newly pinned, their bytes,
        keys not in DRAM)."""
        held = self.pins_by_owner.get(OPERATOR, {})
        new: list[bytes] = []
        missing: list[bytes] = []
        for k in dict.fromkeys(keys):
            b = self._mine(ns, k)
            if b is None or b.state != State.READY:
                missing.append(k)
            elif k not in held:
                new.append(k)
        size = ns.slot_bytes * ns.world_size
        total = self.operator_pinned_bytes() + size * len(new)
        if total > cap:
            raise PinCapExceeded(total, cap)
        self.pin(ns, new, owner=OPERATOR)
        ns.counters[NsCounter.BYTES_PINNED_OPERATOR] += size * len(new)
        return len(new), size * len(new), missing

    def operator_unpin(self, ns: Namespace, keys: Iterable[bytes] | None) -> tuple[int, int]:
        """Release the operator's pins of ``ns``'s ``keys`` (all of them: None); returns (blocks
        unpinned, their bytes)."""
        mine = set(self.operator_pinned(ns))
        which = list(mine) if keys is None else [k for k in dict.fromkeys(keys) if k in mine]
        n = self.unpin(which, owner=OPERATOR, ns=ns)
        size = ns.slot_bytes * ns.world_size
        ns.counters[NsCounter.BYTES_PINNED_OPERATOR] -= size * n
        return n, size * n


class PinCapExceeded(Exception):
    """Operator pins beyond HPKV_OPERATOR_PIN_MAX."""

    def __init__(self, total: int, cap: int):
        super().__init__(f"{total} bytes would be pinned by the operator, over {cap}")
        self.total = total
        self.cap = cap

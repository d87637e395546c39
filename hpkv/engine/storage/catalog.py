"""The catalog: the one owner of "which blocks have files" (or, for the remote tier, "which
blocks are in the store": one catalog per tier below the pool).

A key is in the catalog when every rank's file of its block is known to be on storage:
spilled here, found by the scan at attach, or by a stat on a lookup miss. The index asks
the catalog (:attr:`hpkv.engine.index.Index.files`) and keeps only what it owns (pool
slots, pins, reservations); a key with files and no slots exists only here, and the
catalog makes it a storage hit through :meth:`Index.files_added` / :meth:`Index.files_gone`.

Order is recency, least recently used first, for ``HPKV_KV_STORAGE_SIZE``: files found
by a scan enter at the cold end, in directory order. A key belongs to one namespace: the
catalog takes no key whose block the index holds for another namespace, and the index
reserves no key whose files are another namespace's.

Compact at scale: a million stored blocks must not cost the server a Python object each.
Every entry lives in one native key table with columns (:class:`~hpkv.engine.keytable.KeyTable`,
~30 bytes a slot): the key, its namespace id, two flag bits (:data:`FILES`: the entry;
:data:`DELETING`: its files are being unlinked), a 64-bit recency and a 32-bit stamp (when a
lookup last saw its files). Recency is a counter, not a list: a key used here takes the next
value above :data:`_MID`, a key found by a scan the next one below it, so "least recently
used" is "smallest recency". Capacity eviction finds the oldest entries in one pass over
the table (:meth:`KeyTable.oldest`) and keeps them as candidates for its next rounds: keys
only ever become more recent, except those a scan adds at the cold end, which drop the
candidates. Nothing on the lookup path is proportional to the number of entries.

The remote tier keeps its catalog of the objects in the store in the same class
(``tier=Tier.REMOTE``): its own gauges (``blocks_remote`` / ``bytes_remote``) and no KV events
(a block in a store every node shares is no block of this engine's cache for a router).

Everything here runs under the server's lock; nothing here touches the disk.
"""

from __future__ import annotations

from collections.abc import Callable

from hpkv.engine.events import REMOVED_STORAGE, STORED_STORAGE
from hpkv.engine.index import Index, Namespace
from hpkv.engine.keytable import KeyTable
from hpkv.io_workers import kvfile
from hpkv.protocol.stats import G, NsCounter
from hpkv.protocol.wire import Tier

VERIFY_TTL_S = 2.0  # a storage hit's files are stat-ed again at most this often
FILES = 1  # flag: all ranks' files are on storage (the key is in the catalog)
DELETING = 2  # flag: the key's files are being unlinked (capacity eviction)
VICTIM_CANDIDATES = 1024  # least recent entries found per pass over the table
SLOT_BYTES = 16 + 1 + 1 + 8 + 4  # a table slot: key, state, namespace and flags, recency, stamp
_MID = 1 << 62  # recencies: keys used here count up from it, keys found by a scan down
_STAMP_MASK = 0xFFFFFFFF  # stamps are milliseconds of time.monotonic(), modulo 2**32
_HAS_FILES = bytes(v & FILES for v in range(256))  # a table value -> 1 when it has FILES (bytes.translate)


def _stamp(now: float) -> int:
    """A verification time as a stamp (0 is "never")."""
    return int(now * 1000) & _STAMP_MASK or 1


class FileCatalog:
    """key → namespace of the blocks with files, LRU first, with their file and byte totals."""

    def __init__(self, index: Index, tier: int = Tier.STORAGE):
        self.index = index
        self.tier = tier
        self._events = tier == Tier.STORAGE  # KV events of the file tier only
        if tier == Tier.STORAGE:
            self._blocks_counter, self._bytes_counter = NsCounter.BLOCKS_STORAGE, NsCounter.BYTES_STORAGE
        else:
            self._blocks_counter, self._bytes_counter = NsCounter.BLOCKS_REMOTE, NsCounter.BYTES_REMOTE
        self._t = KeyTable(columns=True)
        self._peek = self._t.peeker()  # key -> value | owner << 2 | stamp << 8 (0: absent)
        self._ns: dict[int, Namespace] = {}  # namespace id -> the namespace its entries belong to
        self._per_ns: dict[int, int] = {}  # namespace id -> entries
        self._entries = 0
        self._hot = _MID  # the recency of the most recently used key
        self._cold = _MID  # the recency of the last key a scan found (the coldest)
        # the least recent entries when last looked for, most recent first (pop() is the oldest)
        self._candidates: list[tuple[bytes, int]] = []
        self.files = 0
        self.bytes = 0
        # retire_all: the keys still to walk (16 bytes each, from _retire_pos), and the stamp
        # and time entries confirmed before are stale
        self._retiring = b""
        self._retire_pos = 0
        self._retire_stamp = 0
        self._retire_since = 0.0
        index.add_below(self, tier)

    def __len__(self) -> int:
        return self._entries

    def __contains__(self, key: bytes) -> bool:
        m = self._peek(key)
        return bool(m & FILES) and not (self._retiring and self._retired(m))

    def owner(self, key: bytes, retired: bool = False) -> Namespace | None:
        """The namespace of the key's entry; None when there is none, or (unless ``retired``)
        when it is retired (:meth:`retire_all`)."""
        m = self._peek(key)
        if not m & FILES or (self._retiring and not retired and self._retired(m)):
            return None
        return self._ns[m >> 2 & 63]

    def held_many(self, keys: bytes, n: int) -> bytes | None:
        """:meth:`Index.files_found`'s question (:class:`~hpkv.engine.index.FileOwner`): which of
        ``n`` 16-byte keys have an entry, in one native call; None while entries are retiring
        (a retired entry has no owner: asked key by key then)."""
        if self._retiring:
            return None
        return self._t.get_many(keys, n).translate(_HAS_FILES)

    # ------------------------------------------------------------ retirement
    def retire_all(self, now: float) -> None:
        """Every entry not confirmed (:meth:`verified`) after ``now`` is stale: at once no
        entry for ``in``, :meth:`owner` and :meth:`add`, due for :meth:`to_verify`, and
        forgotten by :meth:`retire_step` a slice at a time (a catalog of millions is not walked
        under the server's lock at once). One native pass takes the keys to walk."""
        self._retire_stamp = _stamp(now)
        self._retire_since = now
        self._retiring = self._t.select_raw(FILES)
        self._retire_pos = 0

    def retire_step(self, n: int, in_use: Callable[[bytes], bool]) -> tuple[int, bool]:
        """Forget up to ``n`` more of the entries :meth:`retire_all` took that are still
        retired, skipping those ``in_use``; returns (how many, whether all are done)."""
        raw, pos = self._retiring, self._retire_pos
        end = min(len(raw), pos + 16 * n)
        gone = 0
        for at in range(pos, end, 16):
            key = raw[at : at + 16]
            m = self._peek(key)
            if m & FILES and self._retired(m) and not in_use(key):
                self.forget(key)
                gone += 1
        self._retire_pos = end
        if end < len(raw):
            return gone, False
        self._retiring = b""
        return gone, True

    @property
    def retiring(self) -> bool:
        return bool(self._retiring)

    def _retired(self, m: int) -> bool:
        """The entry (its peek ``m``) was not confirmed after the last :meth:`retire_all` (its
        stamp is not a later millisecond: :meth:`verified` makes one confirmed since so)."""
        after = (m >> 8) - self._retire_stamp & _STAMP_MASK
        return after == 0 or after >= 1 << 31 or not m >> 8

    def keys(self) -> list[bytes]:
        """The keys with files, least recently used first."""
        return [k for k, _ in self._t.oldest(FILES, self._entries)]

    def keys_of(self, ns: Namespace) -> list[bytes]:
        """``ns``'s keys with files, most recently used first (operator calls: one pass over
        the table and a sort; never on the lookup path)."""
        if self._ns.get(ns.ns_id) is not ns:
            return []
        keys = self._t.select(FILES, ns.ns_id)
        keys.sort(key=lambda k: self._t.columns(k)[2], reverse=True)
        return keys

    def knows(self, key: bytes) -> bool:
        """The key has files here, or its files are being unlinked."""
        return key in self._t

    def unknown(self, key: bytes) -> bool:
        """Neither the catalog nor the index knows the key, and no unlink of its files runs:
        a stat may find files the scan has not reached (or another server wrote)."""
        return key not in self._t and self.index.owner(key) is None

    def add(self, ns: Namespace, key: bytes, recent: bool = True) -> bool:
        """All ranks' files of ``ns``'s ``key`` are on storage. False, and nothing changed, when
        the key is another namespace's (its files are no hit for ``ns``) or already known."""
        m = self._peek(key)
        if m & FILES and self._retiring and self._retired(m):
            self.forget(key)  # a stale entry: the key comes in anew
            m = self._peek(key)
        if m & FILES:
            if recent and self._ns[m >> 2 & 63] is ns:
                self._t.set_recency(key, self._next_hot())
            return False
        held = self.index.owner(key)
        if held is not None and held is not ns:
            return False
        self._register(ns)
        self._t.set(key, ns.ns_id, m & 3 | FILES)  # (a stamp of 0: a new slot, or reset by _drop)
        if recent:
            self._t.set_recency(key, self._next_hot())
        else:  # found on disk: older than anything used here
            self._cold -= 1
            self._t.set_recency(key, self._cold)
            self._candidates.clear()  # older than the candidates
        self._count_in(ns, 1)
        self.index.files_added(ns, key)
        # Not for keys found on disk (a scan, another server's journal): no engine here saved
        # them, so none knows their hashes; an engine that hits one learns it then.
        if recent and ns.events is not None and self._events:
            ns.events.add(key, STORED_STORAGE)
        return True

    def add_found(self, ns: Namespace, keys: list[bytes], skip: Callable[[bytes], bool]) -> int:
        """:meth:`add` (``recent=False``) of the keys a scan found, in order, each colder than
        the one before, skipping keys known already or being deleted and those ``skip`` names;
        returns how many were added. Keys that hold no pool slots (all, unless a block was saved
        meanwhile) go into the table and the index in one native call each."""
        if not keys:
            return 0
        known = self._t.get_many(b"".join(keys), len(keys))
        blocks = self.index.blocks
        fresh = [k for k, v in zip(keys, known, strict=True) if not v and not skip(k)]
        if any(k in blocks for k in fresh):  # the index's own checks, key by key
            return sum(self.add(ns, k, recent=False) for k in fresh)
        n = len(fresh)
        if n:
            raw = b"".join(fresh)
            self._register(ns)
            self._t.set_many(raw, n, ns.ns_id, FILES, rec=self._cold - 1, rec_step=-1)
            self._cold -= n
            self._candidates.clear()
            self._count_in(ns, n)
            self.index.files_found(ns, raw, n, self.tier)
        return n

    def forget(self, key: bytes) -> Namespace | None:
        """The key's files are gone or going (evicted, corrupt, missing); returns their namespace."""
        m = self._peek(key)
        if not m & FILES:
            return None
        ns = self._ns[m >> 2 & 63]
        self._drop(key, m, ns)
        ns.counters[self._blocks_counter] -= 1
        ns.counters[self._bytes_counter] -= ns.world_size * kvfile.file_size(ns.shard_bytes)
        self.index.files_gone(key)
        if ns.events is not None and self._events:
            ns.events.add(key, REMOVED_STORAGE)
        return ns

    def detach(self, ns: Namespace) -> None:
        """Forget a released namespace's entries (the files stay). Its counters were reset
        with the namespace (the stats row now belongs to the id's next user): not touched."""
        if self._ns.get(ns.ns_id) is not ns:
            return
        for key in self._t.select(FILES, ns.ns_id):
            self._drop(key, self._peek(key), ns)
            self.index.files_gone(key)

    def touch(self, key: bytes) -> None:
        if self._peek(key) & FILES:
            self._t.set_recency(key, self._next_hot())

    def needs_verify(self, ns: Namespace, key: bytes, now: float) -> bool:
        """A hit on files only whose files were not seen for VERIFY_TTL_S."""
        m = self._peek(key)
        if not m & FILES or self._ns[m >> 2 & 63] is not ns or self.index.owner(key) is not None:
            return False
        seen = m >> 8
        return seen == 0 or (int(now * 1000) - seen) & _STAMP_MASK >= int(VERIFY_TTL_S * 1000)

    def to_verify(
        self, ns: Namespace, keys: list[bytes], now: float, ttl_s: float | None = None
    ) -> list[int]:
        """The positions in ``keys`` where :meth:`needs_verify` is true (seen ``ttl_s`` ago or
        never, VERIFY_TTL_S by default, or retired), in one native call over the keys (for a
        lookup's whole prefix of hits below)."""
        if not keys or self._ns.get(ns.ns_id) is not ns:
            return []
        if ttl_s is None:
            ttl_s = VERIFY_TTL_S
        if self._retiring:  # (retired at most ~now - _retire_since ago)
            ttl_s = min(ttl_s, max(0.0, now - self._retire_since))
        flags = self._t.stale(
            b"".join(keys),
            len(keys),
            ns.ns_id,
            FILES,
            int(now * 1000) & _STAMP_MASK,
            int(ttl_s * 1000),
        )
        owner = self.index.owner
        return [i for i, f in enumerate(flags) if f and owner(keys[i]) is None]

    def verified(self, key: bytes, now: float) -> None:
        stamp = _stamp(now)
        if self._retiring and self._retired(stamp << 8):  # confirmed since (in the same millisecond)
            stamp = (self._retire_stamp + 1) & _STAMP_MASK or 1
        self._t.set_stamp(key, stamp)

    def take_victims(self, capacity: int, in_use: Callable[[bytes], bool]) -> list[tuple[Namespace, bytes]]:
        """Forget least recently used entries, skipping those ``in_use``, until the files fit in
        ``capacity`` bytes; they stay marked as being deleted until :meth:`deleted`."""
        victims: list[tuple[Namespace, bytes]] = []
        kept: list[tuple[bytes, int]] = []  # in use: still the least recent, looked at again next time
        kept_keys: set[bytes] = set()
        cand = self._candidates
        while self.bytes > capacity and self._entries:
            if not cand:
                found = self._t.oldest(FILES, len(kept) + VICTIM_CANDIDATES)
                cand.extend(reversed([c for c in found if c[0] not in kept_keys]))
                if not cand:
                    break  # everything left is in use
            key, rec = cand.pop()
            v, ns_id, now_rec, _ = self._t.columns(key)
            if not v & FILES or now_rec != rec:
                continue  # forgotten, or used, since it was found
            if in_use(key):
                kept.append((key, rec))
                kept_keys.add(key)
                continue
            ns = self._ns[ns_id]
            self.forget(key)
            self._mark_deleting(key, ns_id)
            victims.append((ns, key))
        cand.extend(reversed(kept))
        return victims

    def begin_delete(self, key: bytes) -> Namespace | None:
        """Forget a key whose files the evictor is about to unlink (one at a time, chosen by the
        directory's recency, :mod:`~hpkv.engine.storage.shared`); it stays marked as being
        deleted until :meth:`deleted`. Returns its namespace, None if it was not here."""
        ns = self.forget(key)
        if ns is not None:
            self._mark_deleting(key, ns.ns_id)
        return ns

    def _mark_deleting(self, key: bytes, ns_id: int) -> None:
        """A forgotten key's files are being unlinked: a stat must not find them meanwhile."""
        self._t.set(key, ns_id, (self._t.get(key, 0) or 0) | DELETING)

    def deleted(self, keys: list[bytes]) -> None:
        """The victims' files are unlinked: a stat may find new ones again."""
        for key in keys:
            m = self._peek(key)
            if m & 3 == DELETING:
                self._t.pop(key)
            elif m & DELETING:
                self._t.set(key, m >> 2 & 63, m & 3 & ~DELETING)

    def publish(self, glob) -> None:
        """The gauges of what it holds (the stats segment's global row)."""
        glob[G.STORAGE_FILES] = self.files
        glob[G.STORAGE_BYTES] = self.bytes

    def memory_bytes(self) -> int:
        """Bytes the entries' table takes (its slots, used or not)."""
        return self._t.capacity() * SLOT_BYTES

    def _next_hot(self) -> int:
        self._hot += 1
        return self._hot

    def _register(self, ns: Namespace) -> None:
        known = self._ns.get(ns.ns_id)
        if known is not ns:
            if known is not None:  # a released namespace's id, taken again: its entries go
                self.detach(known)
            self._ns[ns.ns_id] = ns

    def _count_in(self, ns: Namespace, n: int) -> None:
        self._per_ns[ns.ns_id] = self._per_ns.get(ns.ns_id, 0) + n
        self._entries += n
        self.files += n * ns.world_size
        self.bytes += n * ns.world_size * kvfile.file_size(ns.shard_bytes)
        ns.counters[self._blocks_counter] += n
        ns.counters[self._bytes_counter] += n * ns.world_size * kvfile.file_size(ns.shard_bytes)

    def _drop(self, key: bytes, m: int, ns: Namespace) -> None:
        """Clear the entry's FILES flag (``m``: its :meth:`KeyTable.peek`; the slot goes unless
        its files are being deleted) and count it out."""
        if m & DELETING:
            self._t.set(key, m >> 2 & 63, DELETING)
            self._t.set_stamp(key, 0)
        else:
            self._t.pop(key)
        self._entries -= 1
        left = self._per_ns[ns.ns_id] - 1
        if left:
            self._per_ns[ns.ns_id] = left
        else:
            del self._per_ns[ns.ns_id]
            del self._ns[ns.ns_id]
        self.files -= ns.world_size
        self.bytes -= ns.world_size * kvfile.file_size(ns.shard_bytes)

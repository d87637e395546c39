"""The catalog: the one owner of "which blocks have files".

A key is in the catalog when every rank's file of its block is known to be on storage:
spilled here, found by the scan at attach, or by a stat on a lookup miss. The index asks
the catalog (:attr:`hpkv.engine.index.Index.files`) and keeps only what it owns (pool
slots, pins, reservations); a key with files and no slots exists only here, and the
catalog makes it a storage hit through :meth:`Index.files_added` / :meth:`Index.files_gone`.

Order is recency, least recently used first, for ``HPKV_KV_STORAGE_SIZE``: files found
by a scan enter at the cold end, in directory order. A key belongs to one namespace: the
catalog takes no key whose block the index holds for another namespace, and the index
reserves no key whose files are another namespace's.

Everything here runs under the server's lock; nothing here touches the disk.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from hpkv.engine.index import Index, Namespace
from hpkv.io_workers import kvfile
from hpkv.protocol.stats import G, NsCounter

VERIFY_TTL_S = 2.0  # a storage hit's files are stat-ed again at most this often


class FileCatalog:
    """key → namespace of the blocks with files, LRU first, with their file and byte totals."""

    def __init__(self, index: Index):
        self.index = index
        self._lru: OrderedDict[bytes, Namespace] = OrderedDict()
        self._verified: dict[bytes, float] = {}  # when a lookup last saw the files exist
        self._deleting: set[bytes] = set()  # files being unlinked (capacity eviction)
        self.files = 0
        self.bytes = 0
        index.files = self

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: bytes) -> bool:
        return key in self._lru

    def owner(self, key: bytes) -> Namespace | None:
        return self._lru.get(key)

    def keys(self) -> list[bytes]:
        """The keys with files, least recently used first."""
        return list(self._lru)

    def knows(self, key: bytes) -> bool:
        """The key has files here, or its files are being unlinked."""
        return key in self._lru or key in self._deleting

    def unknown(self, key: bytes) -> bool:
        """Neither the catalog nor the index knows the key, and no unlink of its files runs:
        a stat may find files the scan has not reached (or another server wrote)."""
        return not self.knows(key) and self.index.owner(key) is None

    def add(self, ns: Namespace, key: bytes, recent: bool = True) -> bool:
        """All ranks' files of ``ns``'s ``key`` are on storage. False, and nothing changed, when
        the key is another namespace's (its files are no hit for ``ns``) or already known."""
        known = self._lru.get(key)
        if known is not None:
            if recent and known is ns:
                self._lru.move_to_end(key)
            return False
        held = self.index.owner(key)
        if held is not None and held is not ns:
            return False
        self._lru[key] = ns
        if not recent:
            self._lru.move_to_end(key, last=False)  # found on disk: older than anything used here
        self.files += ns.world_size
        self.bytes += ns.world_size * kvfile.file_size(ns.shard_bytes)
        ns.counters[NsCounter.BLOCKS_STORAGE] += 1
        self.index.files_added(ns, key)
        return True

    def forget(self, key: bytes) -> Namespace | None:
        """The key's files are gone or going (evicted, corrupt, missing); returns their namespace."""
        ns = self._lru.pop(key, None)
        self._verified.pop(key, None)
        if ns is None:
            return None
        self._count_out(ns)
        ns.counters[NsCounter.BLOCKS_STORAGE] -= 1
        self.index.files_gone(key)
        return ns

    def detach(self, ns: Namespace) -> None:
        """Forget a released namespace's entries (the files stay). Its counters were reset
        with the namespace (the stats row now belongs to the id's next user): not touched."""
        for key in [k for k, n in self._lru.items() if n is ns]:
            del self._lru[key]
            self._verified.pop(key, None)
            self._count_out(ns)
            self.index.files_gone(key)

    def touch(self, key: bytes) -> None:
        if key in self._lru:
            self._lru.move_to_end(key)

    def needs_verify(self, ns: Namespace, key: bytes, now: float) -> bool:
        """A hit on files only whose files were not seen for VERIFY_TTL_S."""
        return (
            self._lru.get(key) is ns
            and self.index.owner(key) is None
            and now - self._verified.get(key, 0.0) >= VERIFY_TTL_S
        )

    def verified(self, key: bytes, now: float) -> None:
        self._verified[key] = now

    def take_victims(self, capacity: int, in_use: Callable[[bytes], bool]) -> list[tuple[Namespace, bytes]]:
        """Forget least recently used entries, skipping those ``in_use``, until the files fit in
        ``capacity`` bytes; they stay marked as being deleted until :meth:`deleted`."""
        victims: list[tuple[Namespace, bytes]] = []
        skipped: list[tuple[bytes, Namespace]] = []
        while self.bytes > capacity and self._lru:
            key, ns = next(iter(self._lru.items()))
            if in_use(key):
                self._lru.popitem(last=False)  # in use: keep it, look further
                skipped.append((key, ns))
                continue
            self.forget(key)
            self._deleting.add(key)
            victims.append((ns, key))
        for key, ns in reversed(skipped):
            self._lru[key] = ns
            self._lru.move_to_end(key, last=False)
        return victims

    def begin_delete(self, key: bytes) -> Namespace | None:
        """Forget a key whose files the evictor is about to unlink (one at a time, chosen by the
        directory's recency, :mod:`~hpkv.engine.storage.shared`); it stays marked as being
        deleted until :meth:`deleted`. Returns its namespace, None if it was not here."""
        ns = self.forget(key)
        if ns is not None:
            self._deleting.add(key)
        return ns

    def deleted(self, keys: list[bytes]) -> None:
        """The victims' files are unlinked: a stat may find new ones again."""
        self._deleting.difference_update(keys)

    def publish(self, glob) -> None:
        """The gauges of what it holds (the stats segment's global row)."""
        glob[G.STORAGE_FILES] = self.files
        glob[G.STORAGE_BYTES] = self.bytes

    def _count_out(self, ns: Namespace) -> None:
        self.files -= ns.world_size
        self.bytes -= ns.world_size * kvfile.file_size(ns.shard_bytes)

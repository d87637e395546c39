"""Several servers on one storage directory: discovery through the journals, one evictor.

Every server (a *node*) runs one thread here, ticking every ``HPKV_STORAGE_JOURNAL_POLL``
seconds:

* **its journal**: the blocks it spilled (ADD), used (READ, at most once per
  :data:`READ_EVERY_S` per block) and, as the evictor, deleted (DEL) since the last tick are
  appended to ``<fingerprint>/.journal/<node>.log`` (:mod:`~hpkv.engine.storage.journal`),
  one ``write`` per namespace. The request loop only queues records (lock held, no IO).
* **discovery**: the new records of every other node's journal of each attached namespace
  join the catalog (ADD: a storage hit, stat-ed before a lookup first reports it; DEL: the
  catalog forgets the block). At attach the journals are read from the start instead of the
  tree being walked; only a namespace with no journal (or whose own journal shows this node
  crashed, so temporary files may be left) is scanned, and what the scan finds is journaled
  so that other nodes need not scan it.
* **the evictor lease** (``HPKV_STORAGE_EVICTOR``): with ``auto`` the nodes elect one evictor
  per directory through the file ``<storage>/.evictor`` (:class:`Lease`).
* **eviction**, by the evictor only: it tails every namespace's journals in the directory
  (attached here or not), keeps the directory's blocks in recency order across nodes (the
  journals' ADD and READ times) with their total, and while the total is over
  ``HPKV_KV_STORAGE_SIZE`` deletes the least recently used, except blocks in use here and
  files any node's IO worker read within ``HPKV_STORAGE_READ_GRACE`` (readers set the file's
  access time, :func:`hpkv.io_workers.kvfile.leave_access_time`; the evictor stats a victim's
  files just before it unlinks them).

Threads: the request loop calls :meth:`SharedDir.added` / :meth:`used` (server lock held,
memory only); a namespace's scan thread calls :meth:`attach_journals` / :meth:`adopt`; the
rest runs on this module's thread, which takes the server lock only to change the catalog.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import numpy as np

from hpkv.common.proc import pid_alive, trim_heap
from hpkv.engine.index import Namespace
from hpkv.engine.storage.catalog import FileCatalog
from hpkv.engine.storage.journal import (
    ADD,
    DEL,
    READ,
    SUFFIX,
    Adds,
    JournalReader,
    JournalWriter,
    Record,
    writer_crashed,
)
from hpkv.engine.storage.keytimes import KeyTimes
from hpkv.engine.storage.upkeep import IoErrorLog, unlink_quietly
from hpkv.io_workers import kvfile
from hpkv.io_workers.tree import StorageTree
from hpkv.protocol.stats import G

log = logging.getLogger("hpkv.storage")

STOP_WAIT_S = 2.0  # each step of a stop that touches the storage directory

LEASE_FILE = ".evictor"
READ_EVERY_S = 10.0  # a block's READ is journaled at most this often per node
READ_SLOTS = 1 << 17  # blocks whose last READ time is remembered (a key's slot: by its bytes)
EVICT_CANDIDATES = 4096  # least recently used entries sorted by time per eviction pass
_FP_LEN = 32


class RecentReads:
    """When this node last journaled a READ of a block, for :data:`READ_EVERY_S`: a fixed table
    of :data:`READ_SLOTS` (8 bytes of the key, a time) indexed by other bytes of the key (keys are
    uniform hashes), 2 MiB whatever the number of blocks. A key that lost its slot to another
    is journaled again a little early: one record more, never one less. The arrays are
    zero-filled by the kernel as they are touched (calloc'd pages), so a server that reads few
    blocks keeps few of these pages."""

    def __init__(self, slots: int = READ_SLOTS):
        self._tags = np.zeros(slots, np.uint64)
        self._times = np.zeros(slots, np.float64)
        self._mask = slots - 1

    def due(self, key: bytes, now: float) -> bool:
        """Should a READ of ``key`` be journaled at ``now`` (then it counts as journaled)?"""
        i = int.from_bytes(key[8:12], "little") & self._mask
        tag = int.from_bytes(key[:8], "little") | 1  # (0: an empty slot)
        if int(self._tags[i]) == tag and now - float(self._times[i]) < READ_EVERY_S:
            return False
        self._tags[i], self._times[i] = tag, now
        return True


class Lease:
    """Who evicts: a small JSON file ``{"node", "pid", "host", "until"}`` in the storage root.

    Taken with ``O_CREAT | O_EXCL``; renewed by its holder (rewritten under a temporary name and
    renamed over) whenever less than 3/4 of ``length_s`` is left; taken over when its ``until``
    is more than ``length_s / 2`` in the past (the holder died or hangs): the taker renames the
    stale file away (only one rename of it succeeds), then creates its own. A holder evicts only
    while its lease has more than ``length_s / 4`` left by its own clock, so a holder that hung
    past its lease finds it taken and steps down before deleting anything. Clocks of the nodes
    must agree to well within ``length_s / 4`` (NTP)."""

    def __init__(self, tree: StorageTree, node: str, length_s: float):
        self.tree = tree
        self.node = node
        self.length_s = length_s
        self.until = 0.0  # our lease's end (wall clock), 0 when not ours
        self.holder: str | None = None  # the node that holds it, as last read

    def held(self) -> bool:
        return time.time() < self.until - self.length_s / 4

    def tick(self) -> bool:
        """Take, renew or observe the lease; returns whether this node holds it."""
        now = time.time()
        cur = self._read()
        mine = cur is not None and cur.get("node") == self.node and cur.get("pid") == os.getpid()
        if cur is not None and not mine and cur.get("node") == self.node and not _alive(cur.get("pid")):
            cur["until"] = -self.length_s  # this node's last run held it and died: take it now
        if cur is None:
            if self._create(now):
                log.info("storage evictor: this node (%s) holds the lease", self.node)
        elif mine:
            if self.until - now < 0.75 * self.length_s:
                self._write(now)
        else:
            self.until = 0.0
            self.holder = str(cur.get("node"))
            until = float(cur.get("until", 0.0))
            if now > until + self.length_s / 2:
                stale = f"{LEASE_FILE}.stale.{self.node}"
                try:
                    os.rename(LEASE_FILE, stale, src_dir_fd=self.tree.root_fd, dst_dir_fd=self.tree.root_fd)
                except FileNotFoundError:
                    return False  # another node took it first
                os.unlink(stale, dir_fd=self.tree.root_fd)
                if self._create(now):
                    log.warning(
                        "storage evictor: took the lease over from %s (expired %.1fs ago)",
                        self.holder,
                        now - until,
                    )
        return self.held()

    def release(self) -> None:
        """Give the lease up (a clean stop): another node takes it at once."""
        if self.until and self._read_node() == (self.node, os.getpid()):
            try:
                os.unlink(LEASE_FILE, dir_fd=self.tree.root_fd)
            except OSError:
                pass
        self.until = 0.0

    def _body(self, now: float) -> bytes:
        until = now + self.length_s
        return json.dumps(
            {"node": self.node, "pid": os.getpid(), "host": socket.gethostname(), "until": until}
        ).encode()

    def _create(self, now: float) -> bool:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(LEASE_FILE, flags, 0o600, dir_fd=self.tree.root_fd)
        except FileExistsError:
            return False
        try:
            os.write(fd, self._body(now))
        finally:
            os.close(fd)
        self.until, self.holder = now + self.length_s, self.node
        return True

    def _write(self, now: float) -> None:
        tmp = f".{LEASE_FILE}.{self.node}.tmp"
        root = self.tree.root_fd
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=root
        )
        try:
            os.write(fd, self._body(now))
        finally:
            os.close(fd)
        os.rename(tmp, LEASE_FILE, src_dir_fd=root, dst_dir_fd=root)
        self.until = now + self.length_s

    def _read(self) -> dict | None:
        try:
            fd = os.open(LEASE_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.tree.root_fd)
        except FileNotFoundError:
            return None
        try:
            raw = os.read(fd, 4096)
            mtime = os.fstat(fd).st_mtime
        finally:
            os.close(fd)
        try:
            cur = json.loads(raw)
            if isinstance(cur, dict):
                return cur
        except ValueError:
            pass
        return {"until": mtime + self.length_s}  # being written (created, not filled yet)

    def _read_node(self) -> tuple[str, int] | None:
        try:
            cur = self._read()
        except OSError:
            return None
        return (cur.get("node"), cur.get("pid")) if cur else None  # type: ignore[return-value]


class SharedDir:
    """The journals, the lease and the directory-wide eviction (see the module docstring)."""

    def __init__(
        self,
        tree: StorageTree,
        catalog: FileCatalog,
        lock: threading.RLock,
        glob,
        errors: IoErrorLog,
        node: str,
        capacity: int,
        evictor: str,
        poll_s: float,
        grace_s: float,
        lease_s: float,
        in_use: Callable[[bytes], bool],
    ):
        self.tree = tree
        self.catalog = catalog
        self.lock = lock
        self.g = glob
        self.errors = errors
        self.node = node
        self.capacity = capacity
        self.evictor = evictor  # auto | always | never
        self.poll_s = poll_s
        self.grace_ns = int(grace_s * 1e9)
        self._in_use = in_use
        self.lease = Lease(tree, node, lease_s)
        self._mu = threading.Lock()  # guards the dicts below against the scan threads and the loop
        self._pending: dict[str, list[Record | Adds]] = {}  # fingerprint -> records to append
        self._reads = RecentReads()
        self._writers: dict[str, JournalWriter] = {}
        self._readers: dict[str, JournalReader] = {}  # discovery, attached namespaces
        self._attached: dict[str, Namespace] = {}
        # the evictor's view of the whole directory: key -> last ADD or READ time, and its kind,
        # an index into _kinds: (fingerprint, world, bytes of its files)
        self.evicting = False
        self._dir = KeyTimes()
        self._kinds: list[tuple[str, int, int]] = []
        self._kind_ids: dict[tuple[str, int, int], int] = {}
        self.total = 0
        self._dir_readers: dict[str, JournalReader] = {}
        self._stop = threading.Event()
        self.wake = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ life cycle
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="storage-shared", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Write what is queued, close the journals and give the lease up, each within
        STOP_WAIT_S: a storage directory that does not answer (a hung mount) does not hold the
        stop; its last records are lost and its lease expires by itself."""
        self._stop.set()
        self.wake.set()
        if self._thread is not None:
            self._thread.join(timeout=STOP_WAIT_S)
            if self._thread.is_alive():
                log.warning(
                    "the storage journal thread is still in the file system at stop: its last "
                    "records are not written, and the evictor lease expires by itself"
                )
                return
        last = threading.Thread(target=self._write_last, name="hpkv-journal-stop", daemon=True)
        last.start()
        last.join(timeout=STOP_WAIT_S)
        if last.is_alive():
            log.warning("the storage directory did not answer the journal's last write at stop: left behind")

    def _write_last(self) -> None:
        try:
            self._flush()
        except OSError as exc:
            self.errors.io_error("journal", exc.errno or errno.EIO, self.tree.rel_path(""))
        with self._mu:
            for w in self._writers.values():
                w.close()
        self.lease.release()

    # ------------------------------------------------------------ request loop (server lock held)
    def added(self, ns: Namespace, key: bytes) -> None:
        """All ranks' files of ``key`` were written here."""
        nbytes = ns.world_size * kvfile.file_size(ns.shard_bytes)
        self._queue(ns.fingerprint, Record(ADD, ns.world_size, time.time_ns(), key, nbytes))

    def used(self, ns: Namespace, key: bytes) -> None:
        """The block was used here (a pin or promote): its files are recent for the evictor."""
        if not self._reads.due(key, time.monotonic()):
            return
        self._queue(ns.fingerprint, Record(READ, ns.world_size, time.time_ns(), key, 0))

    def _queue(self, fp: str, r: Record) -> None:
        with self._mu:
            self._pending.setdefault(fp, []).append(r)

    # ------------------------------------------------------------ attach (a scan thread)
    def attach_journals(self, ns: Namespace) -> list[bytes] | None:
        """The namespace's blocks the journals hold live (its journals read from the start), or
        None when the tree must be scanned: there is no journal yet, or this node's last run
        crashed (its temporary files are found by the scan). Either way the namespace is tailed
        from now on."""
        fp = ns.fingerprint
        reader = JournalReader(self.tree, fp, skip=self.node + SUFFIX)
        with self._mu:
            writer = self._writers.get(fp) or JournalWriter(self.tree, fp, self.node)
        own = self.node + SUFFIX
        scan = not reader.exists()
        live: dict[bytes, int] = {}
        if not scan:
            for name, r in _sorted(self._read_all(reader)):
                if r.op == ADD:
                    live[r.key] = max(r.time_ns, live.get(r.key, 0))
                elif r.op == DEL and live.get(r.key, 0) <= r.time_ns:
                    live.pop(r.key, None)
                if writer.fd < 0:
                    writer.apply(r, mine=name == own)
            scan = writer_crashed(reader.headers.get(own))
            if scan:
                log.info("namespace %s: this node's last run did not stop cleanly: scanning it", fp[:12])
        writer.loaded = True
        writer.ensure_open()
        with self._mu:
            self._writers[fp] = writer
            self._readers[fp] = reader
            self._attached[fp] = ns
        self.wake.set()
        return None if scan else list(live)

    def adopt(self, ns: Namespace, keys: bytes) -> None:
        """A scan found these blocks (16-byte keys end to end): journal them as this node's, so
        no other node scans (those this node's journal holds already are left out when written)."""
        nbytes = ns.world_size * kvfile.file_size(ns.shard_bytes)
        adds = Adds(ns.world_size, time.time_ns(), keys, nbytes)
        with self._mu:
            self._pending.setdefault(ns.fingerprint, []).append(adds)
        self.wake.set()

    def detach(self, ns: Namespace) -> None:
        with self._mu:
            if self._attached.get(ns.fingerprint) is ns:
                del self._attached[ns.fingerprint]
                self._readers.pop(ns.fingerprint, None)

    @staticmethod
    def _read_all(reader: JournalReader) -> list[tuple[str, Record]]:
        out: list[tuple[str, Record]] = []
        while True:
            got = reader.poll()
            if not got:
                return out
            for name, recs in got.items():
                out.extend((name, r) for r in recs)

    # ------------------------------------------------------------ the thread
    def _loop(self) -> None:
        while not self._stop.is_set():
            self.wake.wait(self.poll_s)
            self.wake.clear()
            if self._stop.is_set():
                return
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the shared-directory thread must keep running
                log.exception("shared storage step failed")

    def tick(self) -> None:
        """One round: append, discover, lease, evict."""
        try:
            self._flush()
        except OSError as exc:
            self.errors.io_error("journal", exc.errno or errno.EIO, self.tree.rel_path(""))
        self._discover()
        evicting = self.capacity > 0 and self.evictor != "never"
        if evicting and self.evictor == "auto":
            try:
                evicting = self.lease.tick()
            except OSError as exc:
                self.errors.io_error("lease", exc.errno or errno.EIO, self.tree.rel_path(LEASE_FILE))
                evicting = self.lease.held()
        if evicting != self.evicting:
            log.info("storage evictor: this node %s evicting", "starts" if evicting else "stops")
            if not evicting:
                self._dir.clear()
                self._kinds.clear()
                self._kind_ids.clear()
                self._dir_readers.clear()
                self.total = 0
            self.evicting = evicting
        if evicting:
            self._follow_directory()
            self._evict()

    def _flush(self) -> None:
        with self._mu:
            pending = {fp: recs for fp, recs in self._pending.items() if fp in self._writers}
            for fp in pending:
                del self._pending[fp]
            writers = dict(self._writers)
        scanned = False
        for fp, recs in pending.items():
            w = writers[fp]
            w.ensure_open()
            for i, r in enumerate(recs):
                if isinstance(r, Adds):
                    recs[i] = w.apply_adds(r)
                    scanned = True
                else:
                    w.apply(r, mine=True)
            w.append(recs)
        if scanned:  # a scan's finds, journaled: its temporary objects are all freed now
            trim_heap()

    def _discover(self) -> None:
        with self._mu:
            attached = [(fp, ns, self._readers[fp]) for fp, ns in self._attached.items()]
        for fp, ns, reader in attached:
            try:
                got = reader.poll()
            except OSError as exc:
                self.errors.io_error("journal", exc.errno or errno.EIO, self.tree.rel_path(reader.rel))
                continue
            if not got:
                continue
            records = _sorted([(n, r) for n, recs in got.items() for r in recs])
            writer = self._writers.get(fp)
            added = gone = 0
            with self.lock:
                if ns.released:
                    continue
                cat = self.catalog
                for _, r in records:
                    if r.op == ADD and cat.unknown(r.key):
                        added += cat.add(ns, r.key, recent=False)
                    elif r.op == DEL and cat.owner(r.key) is ns and not self._in_use(r.key):
                        cat.forget(r.key)
                        gone += 1
                cat.publish(self.g)
            if writer is not None:
                for _, r in records:
                    if r.op == DEL:
                        writer.apply(r, mine=False)
            if added or gone:
                log.debug("namespace %s: %d block(s) found, %d gone (journals)", fp[:12], added, gone)

    # ------------------------------------------------------------ the evictor
    def _follow_directory(self) -> None:
        """Tail every namespace's journals in the directory into the recency order."""
        with self.tree.entries("") as entries:
            fps = [e.name for e in entries if len(e.name) == _FP_LEN and e.is_dir(follow_symlinks=False)]
        for fp in fps:
            reader = self._dir_readers.get(fp)
            if reader is None:
                reader = self._dir_readers[fp] = JournalReader(self.tree, fp)
            try:
                got = reader.poll()
            except OSError as exc:
                self.errors.io_error("journal", exc.errno or errno.EIO, self.tree.rel_path(reader.rel))
                continue
            for _, r in _sorted([(n, r) for n, recs in got.items() for r in recs]):
                self._apply_dir(fp, r)

    def _apply_dir(self, fp: str, r: Record) -> None:
        e = self._dir.get(r.key)  # (last time, kind)
        if r.op == ADD:
            if e is None:
                self._dir.put(r.key, r.time_ns, self._kind(fp, r.world, r.nbytes))
                self.total += r.nbytes
            elif r.time_ns > e[0]:
                self._dir.put(r.key, r.time_ns, e[1])
        elif r.op == READ:
            if e is not None and r.time_ns > e[0]:
                self._dir.put(r.key, r.time_ns, e[1])
        elif e is not None and r.time_ns >= e[0]:
            self._dir.remove(r.key)
            self.total -= self._kinds[e[1]][2]

    def _kind(self, fp: str, world: int, nbytes: int) -> int:
        kind = (fp, world, nbytes)
        i = self._kind_ids.get(kind)
        if i is None:
            i = self._kind_ids[kind] = len(self._kinds)
            self._kinds.append(kind)
        return i

    def _evict(self) -> None:
        """Delete least recently used blocks until the directory fits the capacity."""
        if self.total <= self.capacity or not self.lease_ok():
            return
        removed = blocks = 0
        deleted: list[bytes] = []
        dels: dict[str, list[Record | Adds]] = {}
        for _, key, kind in self._dir.oldest(EVICT_CANDIDATES):
            if self.total <= self.capacity or not self.lease_ok():
                break
            fp, world, nbytes = self._kinds[kind]
            n = self._evict_one(key, kind, deleted)
            if n is None:
                continue
            removed += n
            blocks += 1
            dels.setdefault(fp, []).append(Record(DEL, world, time.time_ns(), key, nbytes))
        with self.lock:
            self.catalog.deleted(deleted)
            self.catalog.publish(self.g)
            self.g[G.STORAGE_EVICTED_FILES] += removed
        for fp, recs in dels.items():
            self._journal_dels(fp, recs)
        if blocks:
            log.debug(
                "capacity limit: evicted %d block(s), %d file(s); directory now %d of %d bytes",
                blocks,
                removed,
                self.total,
                self.capacity,
            )
        elif self.total > self.capacity:
            self.errors.log(
                logging.WARNING,
                "evict-none",
                "storage directory holds %d bytes, over HPKV_KV_STORAGE_SIZE=%d, but every least "
                "recently used block is in use or was read within HPKV_STORAGE_READ_GRACE",
                self.total,
                self.capacity,
            )

    def _evict_one(self, key: bytes, kind: int, deleted: list[bytes]) -> int | None:
        """Unlink one block's files (returns how many were there), or None when it must stay: in
        use here, or read by some node within the grace (then it counts as used at that time)."""
        fp, world, nbytes = self._kinds[kind]
        with self.lock:
            if self._in_use(key):
                return None
        read_at = self._read_within_grace(fp, world, key)
        if read_at is not None:
            self._dir.put(key, read_at, kind)
            return None
        with self.lock:
            if self._in_use(key):
                return None
            if self.catalog.begin_delete(key) is not None:
                deleted.append(key)
        rel = kvfile.rel_dir(fp, key)
        removed = 0
        for rank in range(world):
            removed += unlink_quietly(self.tree, self.errors, rel, kvfile.file_name(key, rank))
        self._dir.remove(key)
        self.total -= nbytes
        return removed

    def lease_ok(self) -> bool:
        return self.evictor == "always" or self.lease.held()

    def _read_within_grace(self, fp: str, world: int, key: bytes) -> int | None:
        """The last read time (ns) of the block's files when one was read within the grace,
        else None (evict it; files already gone count as evicted)."""
        rel = kvfile.rel_dir(fp, key)
        newest = 0
        for rank in range(world):
            try:
                st = self.tree.stat(rel, kvfile.file_name(key, rank))
            except OSError:
                continue
            if st.st_atime_ns > st.st_mtime_ns:  # read after it was written
                newest = max(newest, st.st_atime_ns)
        return newest if newest and time.time_ns() - newest < self.grace_ns else None

    def deleted_here(self, ns: Namespace, keys: list[bytes]) -> None:
        """An operator (`hpkv evict`) unlinked these blocks' files: DEL records in this node's
        journal, so other nodes forget them and the evictor's total drops."""
        if not keys:
            return
        nbytes = ns.world_size * kvfile.file_size(ns.shard_bytes)
        now = time.time_ns()
        self._journal_dels(ns.fingerprint, [Record(DEL, ns.world_size, now, k, nbytes) for k in keys])
        self.wake.set()

    def _journal_dels(self, fp: str, recs: list[Record | Adds]) -> None:
        """Deletions go into this node's journal of the namespace (made if it has none)."""
        with self._mu:
            writer = self._writers.get(fp)
            if writer is None:
                writer = self._writers[fp] = JournalWriter(self.tree, fp, self.node)
            self._pending.setdefault(fp, []).extend(recs)


def _alive(pid: object) -> bool:
    return isinstance(pid, int) and pid_alive(pid)


def _sorted(records: list[tuple[str, Record]]) -> list[tuple[str, Record]]:
    return sorted(records, key=lambda nr: nr[1].time_ns)

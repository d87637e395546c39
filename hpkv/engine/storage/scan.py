"""How the server learns which files exist: one thread per attached namespace reads the
namespace's journals (:mod:`~hpkv.engine.storage.shared`: what every node sharing the
directory wrote and deleted) and adds their blocks to the catalog in batches under the lock.
Only a namespace without journals, or one this node's crashed last run wrote, is scanned:
the thread lists ``<storage>/<fingerprint>/`` and adds complete blocks (every rank's file
present), then journals them so that other nodes need not scan. A stat
(:func:`stat_block`) answers for one block on a lookup miss or to check that a storage
hit's files are still there."""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from hpkv.common.proc import pid_alive
from hpkv.engine.index import Namespace
from hpkv.engine.storage.catalog import FileCatalog
from hpkv.io_workers import kvfile
from hpkv.io_workers.tree import StorageTree

if TYPE_CHECKING:
    from hpkv.engine.storage.shared import SharedDir

log = logging.getLogger("hpkv.storage")

SCAN_BATCH = 1024  # blocks added to the catalog per lock hold
STALE_TMP_AGE_S = 3600.0  # another host's temporary file older than this is abandoned

IoError = Callable[[str, int, str], None]  # (what, errno, path): count and log a storage error


def stat_block(tree: StorageTree, ns: Namespace, key: bytes, by_open: bool = False) -> bool:
    """Are all ranks' files of ``key`` on storage, each a regular file of the right size?
    ``by_open``: each file is opened rather than stat-ed (:meth:`StorageTree.stat_opened`), for
    a key whose files a caching mount may still show after another host deleted them.
    Raises OSError for an error other than ENOENT (which is no proof either way)."""
    want = kvfile.file_size(ns.shard_bytes)
    rel = kvfile.rel_dir(ns.fingerprint, key)
    look = tree.stat_opened if by_open else tree.stat
    for rank in range(ns.world_size):
        try:
            st = look(rel, kvfile.file_name(key, rank))
        except FileNotFoundError:
            return False
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # (opened) a symlink: not a KV file, as a stat says
                return False
            exc.filename = tree.rel_path(rel, kvfile.file_name(key, rank))
            raise
        if not (stat.S_ISREG(st.st_mode) and st.st_size == want):
            return False
    return True


class Scanner:
    """The scan threads (one per attached namespace) and what they found."""

    def __init__(
        self,
        tree: StorageTree,
        catalog: FileCatalog,
        lock: threading.RLock,
        glob,
        io_error: IoError,
        skip: Callable[[bytes], bool],
        wake: threading.Event,
        shared: SharedDir | None = None,
    ):
        self.tree = tree
        self.catalog = catalog
        self.lock = lock
        self.g = glob
        self._io_error = io_error
        self._skip = skip  # a key not to add (a promote of it is running)
        self._wake = wake  # the upkeep thread: found files may be over the capacity limit
        self.shared = shared  # the journals (None: always scan)
        self.scans = 0  # namespaces scanned (not read from journals), for tests and the log
        self._threads: dict[int, threading.Thread] = {}
        self.done: dict[int, bool] = {}
        self.finished = False  # a scan ended since the last look (the catalog file shows scans)
        self._stop = threading.Event()

    def start(self, ns: Namespace) -> None:
        old = self._threads.get(ns.ns_id)
        if old is not None and old.name == f"scan-ns{ns.ns_id}-{id(ns)}":
            return
        self.done[ns.ns_id] = False
        t = threading.Thread(target=self._scan, args=(ns,), name=f"scan-ns{ns.ns_id}-{id(ns)}", daemon=True)
        self._threads[ns.ns_id] = t
        t.start()

    def forget(self, ns: Namespace) -> None:
        """The namespace was released: its thread stops at its next batch (``ns.released``)."""
        self._threads.pop(ns.ns_id, None)
        self.done.pop(ns.ns_id, None)

    def _done(self, ns: Namespace) -> None:
        """The namespace's files are learned; not said of a released one (its id may already
        be a new namespace's, whose scan runs)."""
        if not ns.released:
            self.done[ns.ns_id] = True

    def stop(self) -> None:
        self._stop.set()
        for t in list(self._threads.values()):
            t.join(timeout=5.0)

    def _scan(self, ns: Namespace) -> None:
        t0 = time.monotonic()
        journaled: list[bytes] | None = None
        if self.shared is not None:
            try:
                journaled = self.shared.attach_journals(ns)
            except OSError as exc:  # the scan below finds the files
                self._io_error("journal", exc.errno or errno.EIO, self.tree.rel_path(ns.fingerprint))
        if journaled is None:
            self._walk(ns, t0)
            return
        found = self._add_scanned(ns, journaled)
        self.finished = True
        self._done(ns)
        log.info(
            "namespace %d (%s): %d block(s) from the journals (%d live) in %.2fs, no scan",
            ns.ns_id,
            ns.fingerprint[:12],
            found or 0,
            len(journaled),
            time.monotonic() - t0,
        )
        self._wake.set()

    def _walk(self, ns: Namespace, t0: float) -> None:
        top = ns.fingerprint
        found = files = 0
        host = kvfile.this_host()
        # The complete keys, end to end, in one buffer: not an object per leaf that lives as long
        # as the scan (they hold Python's small-object arenas resident after it).
        adopted = bytearray()
        self.scans += 1
        try:
            for aa in self._subdirs(top):
                for bb in self._subdirs(aa):
                    if self._stop.is_set():
                        return
                    complete, n_files = self._scan_leaf(ns, bb, host)
                    files += n_files
                    added = self._add_scanned(ns, complete)
                    if added is None:
                        return
                    found += added
                    adopted += b"".join(complete)
        except OSError as exc:
            self._io_error("scan", exc.errno or errno.EIO, self.tree.rel_path(top))
        finally:
            self.finished = True
            self._done(ns)
        if self.shared is not None:
            self.shared.adopt(ns, bytes(adopted))
        log.info(
            "scan of namespace %d (%s): %d complete block(s) from %d file(s) in %.2fs",
            ns.ns_id,
            ns.fingerprint[:12],
            found,
            files,
            time.monotonic() - t0,
        )
        self._wake.set()

    def _scan_leaf(self, ns: Namespace, leaf: str, host: str) -> tuple[list[bytes], int]:
        """(keys with a file for every rank, KV files seen) in one leaf directory; removes the
        temporary files of dead writers on the way."""
        ranks: dict[bytes, int] = {}
        files = 0
        with self.tree.entries(leaf) as entries:
            for entry in entries:
                parsed = kvfile.parse_name(entry.name)
                if parsed is None:
                    self._maybe_remove_tmp(leaf, entry, host)
                    continue
                key, rank = parsed
                if rank < ns.world_size:
                    ranks[key] = ranks.get(key, 0) | 1 << rank
                    files += 1
        full = (1 << ns.world_size) - 1
        return [k for k, mask in ranks.items() if mask == full], files

    def _add_scanned(self, ns: Namespace, complete: list[bytes]) -> int | None:
        """Add scanned blocks to the catalog (storage hits), in batches under the lock; None if
        the namespace was released meanwhile. Blocks known already keep their recency."""
        found = 0
        cat = self.catalog
        for i in range(0, len(complete), SCAN_BATCH):
            with self.lock:
                if ns.released:
                    return None
                found += cat.add_found(ns, complete[i : i + SCAN_BATCH], self._skip)
                cat.publish(self.g)
        return found

    def _maybe_remove_tmp(self, leaf: str, entry: os.DirEntry, host: str) -> None:
        """A temporary file of a writer that died (this host: pid gone; other hosts: old)."""
        owner = kvfile.parse_tmp_name(entry.name)
        if owner is None:
            return
        w_host, pid = owner
        try:
            if w_host == host:
                if pid_alive(pid):
                    return
            elif time.time() - entry.stat(follow_symlinks=False).st_mtime < STALE_TMP_AGE_S:
                return
            self.tree.unlink(leaf, entry.name)
            log.info("removed %s, left by a writer that died", self.tree.rel_path(leaf, entry.name))
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._io_error("unlink", exc.errno or errno.EIO, self.tree.rel_path(leaf, entry.name))

    def _subdirs(self, rel: str) -> list[str]:
        """The two-character subdirectories of ``rel`` (symlinks are not directories here)."""
        with self.tree.entries(rel) as entries:
            return [
                f"{rel}/{e.name}" for e in entries if len(e.name) == 2 and e.is_dir(follow_symlinks=False)
            ]

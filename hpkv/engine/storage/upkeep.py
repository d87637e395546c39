"""Keeping the storage directory healthy: free space, the spill pause and the quarantine, on
one maintenance thread.

Spilling pauses while free space is under ``HPKV_STORAGE_MIN_FREE`` and after ENOSPC
(backing off 1 s → 30 s); the request loop learns the pause's start and end from
:meth:`Upkeep.take_pause_began` / :meth:`Upkeep.take_resumed` (the doorbell wakes it).
The capacity limit ``HPKV_KV_STORAGE_SIZE`` is the directory's, kept by one evictor for
every server that shares it (:mod:`~hpkv.engine.storage.shared`), not here. The quarantine
keeps the newest QUARANTINE_MAX_FILES corrupt files, none older than QUARANTINE_MAX_AGE_S.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time

from hpkv.common.ratelimit import RateLimitedLog
from hpkv.io_workers import kvfile
from hpkv.io_workers.tree import StorageTree
from hpkv.protocol.stats import G
from hpkv.ring import Doorbell

log = logging.getLogger("hpkv.storage")

MAINT_INTERVAL_S = 0.5
ENOSPC_BACKOFF_S = (1.0, 30.0)
QUARANTINE_MAX_FILES = 1000  # corrupt files kept for inspection: the newest this many ...
QUARANTINE_MAX_AGE_S = 7 * 86400  # ... and none older than a week
QUARANTINE_CHECK_S = 60.0


class IoErrorLog:
    """Counts storage IO errors (G.STORAGE_IO_ERRORS) and logs them, rate-limited per kind."""

    def __init__(self, glob):
        self.g = glob
        self._log = RateLimitedLog(log)

    def io_error(self, what: str, err: int, path: str, text: str | None = None) -> None:
        self.g[G.STORAGE_IO_ERRORS] += 1
        name = errno.errorcode.get(err, str(err))
        self._log.log(
            logging.ERROR,
            f"{what}-{name}",
            "storage %s failed: %s (%s) on %s",
            what,
            name,
            text or os.strerror(err),
            path,
        )

    def log(self, level: int, kind: str, msg: str, *args) -> None:
        self._log.log(level, kind, msg, *args)


def unlink_quietly(tree: StorageTree, errors: IoErrorLog, rel: str, name: str) -> bool:
    """Unlink a file; True if it was there. Errors other than ENOENT are counted and logged."""
    try:
        tree.unlink(rel, name)
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        errors.io_error("unlink", exc.errno or errno.EIO, tree.rel_path(rel, name))
        return False


class Upkeep:
    """The maintenance thread and the spill pause (see the module docstring)."""

    def __init__(
        self,
        root: str,
        tree: StorageTree,
        lock: threading.RLock,
        glob,
        doorbell: Doorbell | None,
        errors: IoErrorLog,
        min_free_pct: float,
    ):
        self.root = root
        self.tree = tree
        self.lock = lock
        self.g = glob
        self.doorbell = doorbell
        self.errors = errors
        self.min_free_pct = min_free_pct
        self._low_space = False
        self._enospc_until = 0.0
        self._enospc_backoff = ENOSPC_BACKOFF_S[0]
        self._enospc_episode = 0  # ENOSPC failures since the last successful spill
        self.paused = False
        self._pause_began = False  # the request loop has yet to end the queued spills
        self._resumed = False  # the request loop has yet to retry the skipped spills
        self._quarantine_checked = 0.0
        self._stop = threading.Event()
        self.wake = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._loop, name="storage-maint", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self.wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.wake.wait(MAINT_INTERVAL_S)
            self.wake.clear()
            if self._stop.is_set():
                return
            try:
                self.check_free_space()
                if time.monotonic() - self._quarantine_checked > QUARANTINE_CHECK_S:
                    self.clean_quarantine()
            except Exception:  # noqa: BLE001 - maintenance must keep running
                log.exception("storage maintenance step failed")

    # ------------------------------------------------------------ the spill pause
    def take_pause_began(self) -> bool:
        """Spilling paused since the last call: queued spills would only fail."""
        began, self._pause_began = self._pause_began, False
        return began

    def take_resumed(self) -> bool:
        """Spilling resumed since the last call: skipped spills may be retried."""
        resumed, self._resumed = self._resumed, False
        return resumed

    def resume_pending(self) -> bool:
        return self._resumed

    def retry_soon(self) -> None:
        """Retry skipped spills on the request loop's next round (a worker died: not a
        storage problem)."""
        self._resumed = True

    def on_enospc(self, path: str) -> None:
        now = time.monotonic()
        if self._enospc_episode == 0:
            log.warning(
                "storage full (ENOSPC writing %s): spilling paused, the partial file was "
                "removed; reads continue; retrying in %.0fs (logged once until a spill "
                "succeeds again)",
                path,
                self._enospc_backoff,
            )
        self._enospc_episode += 1
        if now >= self._enospc_until:
            self._enospc_until = now + self._enospc_backoff
            self._enospc_backoff = min(self._enospc_backoff * 2, ENOSPC_BACKOFF_S[1])
        self._set_paused()

    def spill_succeeded(self) -> None:
        if self._enospc_episode:
            log.warning("spilling works again after %d ENOSPC failure(s)", self._enospc_episode)
            self._enospc_episode = 0
            self._enospc_backoff = ENOSPC_BACKOFF_S[0]

    def _set_paused(self) -> None:
        paused = self._low_space or time.monotonic() < self._enospc_until
        if paused and not self.paused:
            self._pause_began = True
            self._ring()
        elif self.paused and not paused:
            self._resumed = True
            self._ring()
        self.paused = paused
        self.g[G.STORAGE_SPILL_PAUSED] = int(paused)

    def _ring(self) -> None:
        if self.doorbell is not None:
            self.doorbell.ring()

    def check_free_space(self) -> None:
        try:
            st = os.statvfs(self.tree.root_fd)
        except OSError as exc:
            with self.lock:
                self.errors.io_error("statvfs", exc.errno or errno.EIO, self.root)
            return
        free = st.f_bavail * st.f_frsize
        pct = 100.0 * st.f_bavail / st.f_blocks if st.f_blocks else 100.0
        with self.lock:
            self.g[G.STORAGE_FREE] = free
            low = pct < self.min_free_pct
            if low != self._low_space:
                if low:
                    log.warning(
                        "storage %s has %.1f%% free, under HPKV_STORAGE_MIN_FREE=%g%%: "
                        "spilling paused (reads continue)",
                        self.root,
                        pct,
                        self.min_free_pct,
                    )
                else:
                    log.info("storage %s has %.1f%% free again: spilling resumes", self.root, pct)
            self._low_space = low
            self._set_paused()

    # ------------------------------------------------------------ the quarantine
    def clean_quarantine(self) -> None:
        """Keep the quarantine bounded: the newest QUARANTINE_MAX_FILES files, none older
        than QUARANTINE_MAX_AGE_S (maintenance thread, no lock needed)."""
        self._quarantine_checked = time.monotonic()
        qdir = kvfile.QUARANTINE_DIR
        entries = []
        with self.tree.entries(qdir) as found:
            for e in found:
                try:
                    if e.is_file(follow_symlinks=False) or e.is_symlink():
                        entries.append((e.stat(follow_symlinks=False).st_mtime, e.name))
                except OSError:
                    continue
        entries.sort(reverse=True)
        now = time.time()
        doomed = [
            p
            for i, (mtime, p) in enumerate(entries)
            if i >= QUARANTINE_MAX_FILES or now - mtime > QUARANTINE_MAX_AGE_S
        ]
        removed = sum(unlink_quietly(self.tree, self.errors, qdir, p) for p in doomed)
        if removed:
            log.info(
                "quarantine %s: removed %d old corrupt file(s) (keeps the newest %d, none older "
                "than %d days)",
                self.tree.rel_path(qdir),
                removed,
                QUARANTINE_MAX_FILES,
                QUARANTINE_MAX_AGE_S // 86400,
            )

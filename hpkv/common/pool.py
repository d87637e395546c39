"""The shared-memory DRAM pool: one file in HPKV_SHARE_MEM_FILE_PATH, mapped by every hpkv process.

Making the memory of a pool exist costs far more than mapping it. Measured on the
development VM (``hpkv bench pool``, 2 vCPUs):

* first touch of a tmpfs page (allocation, zeroing, the hypervisor backing it):
  2.6-3.9 s per GiB, so 20-30 s for the default 8 GiB pool;
* page tables for pages that already exist, in another process: 0.12 s/GiB with
  MAP_POPULATE, 0.3 s/GiB with MADV_POPULATE_WRITE, 0.47 s/GiB by faulting on use.

So nothing waits for it: the server creates the file sparse (instant) and a
background thread at idle CPU priority reserves the pages (fallocate) and locks
them (mlock) chunk by chunk, lowest offsets first, as the allocator hands slots
out. Workers map the file without populating and fill their page tables the same
way in the background. A copy that reaches a page before the warmer only pays the
first-touch cost itself; it never waits for the warmer.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import resource
import threading
import time
from collections.abc import Callable

import numpy as np

log = logging.getLogger("hpkv.pool")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
MADV_POPULATE_WRITE = 23  # Linux >= 5.14
WARM_CHUNK = 64 << 20
SCHED_IDLE = getattr(os, "SCHED_IDLE", 5)


def _idle_priority() -> None:
    """Run the calling thread only on otherwise idle CPU time (never slows the engine)."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, 19)
        except OSError:
            pass


class PoolFile:
    """A mapping of the pool file; ``address`` is the base for native copies."""

    def __init__(self, path: str, mm: mmap.mmap, size: int, fd: int | None = None):
        self.path = path
        self.mm = mm
        self.size = size
        self.locked = False  # every page locked in memory (set by the warmer)
        self.array = np.frombuffer(mm, dtype=np.uint8)
        self.address = int(self.array.ctypes.data)
        self._fd = fd  # kept by the creator, for the warmer's fallocate
        self._stop = threading.Event()
        self._warmer: threading.Thread | None = None

    @classmethod
    def create(cls, path: str, size: int) -> PoolFile:
        """Create the pool file sparse and map it; call :meth:`warm_in_background` next."""
        tmp = f"{path}.tmp{os.getpid()}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            os.rename(tmp, path)
            return cls(path, mmap.mmap(fd, size, flags=mmap.MAP_SHARED), size, fd)
        except BaseException:
            os.close(fd)
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    @classmethod
    def attach(cls, path: str, warm: bool = True) -> PoolFile:
        """Map an existing pool (workers); ``warm`` fills the page tables in the background."""
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            pool = cls(path, mmap.mmap(fd, size, flags=mmap.MAP_SHARED), size)
        finally:
            os.close(fd)
        if warm:
            pool.warm_in_background(lock=False)
        return pool

    def warm_in_background(self, lock: bool, progress: Callable[[int], None] | None = None) -> None:
        """Start the warmer thread: reserve (creator only), lock or populate, chunk by chunk."""
        self._warmer = threading.Thread(
            target=self._warm, args=(lock, progress), name="pool-warm", daemon=True
        )
        self._warmer.start()

    def _warm(self, lock: bool, progress: Callable[[int], None] | None) -> None:
        _idle_priority()
        t0 = time.monotonic()
        done = 0
        locking = lock
        try:
            while done < self.size and not self._stop.is_set():
                n = min(WARM_CHUNK, self.size - done)
                if self._fd is not None:
                    try:
                        os.posix_fallocate(self._fd, done, n)
                    except OSError as exc:
                        log.error(
                            "pool %s: cannot reserve memory at offset %d (%s): the file system of "
                            "the pool is full; lower HPKV_KV_MEM_POOL_SIZE or free space in it. "
                            "Copies into the pool may fail (and are recomputed) meanwhile",
                            self.path,
                            done,
                            exc.strerror,
                        )
                        return
                addr = ctypes.c_void_p(self.address + done)
                if locking and _libc.mlock(addr, ctypes.c_size_t(n)) != 0:
                    self._lock_failed(ctypes.get_errno())
                    locking = False
                if not locking and _libc.madvise(addr, ctypes.c_size_t(n), MADV_POPULATE_WRITE) != 0:
                    return  # an older kernel: pages are faulted in on first use instead
                done += n
                if done >= self.size:
                    self.locked = locking
                if progress is not None:
                    progress(done)
            if done >= self.size and lock:
                log.info(
                    "pool %s: %d bytes allocated%s in %.1fs (background, idle priority)",
                    self.path,
                    self.size,
                    " and locked" if locking else "",
                    time.monotonic() - t0,
                )
        except ValueError:
            pass  # the mapping was closed under us at shutdown
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _lock_failed(self, err: int) -> None:
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
        log.warning(
            "pool %s: not locked in memory (%s; RLIMIT_MEMLOCK is %s): the kernel may "
            "swap pool pages out; raise `ulimit -l` or grant CAP_IPC_LOCK to lock it",
            self.path,
            os.strerror(err),
            limit,
        )

    def stop_warming(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._warmer is not None:
            self._warmer.join(timeout)

    def close(self) -> None:
        self.stop_warming()
        del self.array
        try:
            self.mm.close()
        except BufferError:
            pass  # views are still alive (e.g. a copier): unmapped when they go

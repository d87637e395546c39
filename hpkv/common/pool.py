"""The shared-memory DRAM pool: one file in HPKV_SHARE_MEM_FILE_PATH, mapped by every hpkv process.

Making the memory of a pool exist costs far more than mapping it. Measured on the
development VM (``hpkv bench pool``, 2 vCPUs):

* first touch of a tmpfs page (allocation, zeroing, the hypervisor backing it):
  2.6-3.9 s per GiB, so 20-30 s for the default 8 GiB pool;
* page tables for pages that already exist, in another process: 0.12 s/GiB with
  MAP_POPULATE, 0.3 s/GiB with MADV_POPULATE_WRITE, 0.47 s/GiB by faulting on use.

So nothing waits for it: the server creates the file sparse (instant) and
background threads reserve the pages (fallocate) and lock them (mlock) chunk by
chunk. While the engine that spawned the server is still starting, only idle CPU
time is used, and only for the lowest 2 GiB (vLLM starting on the CPU needs every
core it can get, and its KV-cache allocation runs 5x slower next to the warmer).
Once an engine is about to use the pool, 256 MiB beyond the highest slot the
allocator has handed out is warmed at normal priority and the lowest 2 GiB at nice 10,
so a copy into a new slot finds its memory ready, and the rest from the top down at
idle priority.
Workers map the file without populating and fill their page tables up to what the
server has warmed. A copy that reaches a page before the warmer pays the
first-touch cost itself; it never waits for the warmer.

A slot is never handed out over memory that does not exist yet: a process touching a
page that a full tmpfs cannot back takes SIGBUS (a transfer worker, or SGLang itself,
which maps the pool in-process). So the server calls :meth:`PoolFile.reserve_to` for a
slot that ends beyond the reserved prefix (one fallocate per new chunk, never per slot);
when the file system is full, or only the space engines' KV caches need is left
(``keep_free``), the slot is refused (reserve skips, promote misses) and warming waits
until space returns.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import resource
import threading
import time
from collections.abc import Callable

import numpy as np

from hpkv.common.ratelimit import RateLimitedLog

log = logging.getLogger("hpkv.pool")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
MADV_POPULATE_WRITE = 23  # Linux >= 5.14
WARM_CHUNK = 16 << 20  # short holds of the mmap lock
WARM_URGENT = 256 << 20  # warmed at normal priority beyond the allocator's high-water mark
WARM_AHEAD = 2 << 30  # warmed at nice WARM_AHEAD_NICE beyond it
WARM_AHEAD_NICE = 10
WARM_POLL_S = 0.1
SPACE_RETRY_S = 1.0  # a warmer stopped by a full file system looks again this often
SCHED_IDLE = getattr(os, "SCHED_IDLE", 5)


def populate(address: int, nbytes: int) -> bool:
    """Fill this process's page tables for ``[address, address + nbytes)`` of a shared mapping
    (its pages exist); False where the kernel lacks MADV_POPULATE_WRITE."""
    return _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), MADV_POPULATE_WRITE) == 0


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
        self._warmers: list[threading.Thread] = []
        self._done_ranges: dict[int, int] = {}  # warmed, not yet part of the ready prefix
        self._ready = 0  # [0, ready) is warm
        # [0, backed) is fallocated (creator only): a slot below it can be handed out without
        # a system call. Ranges reserved beyond it (the top-down warmer) wait in _backed_ranges.
        self.backed = size if fd is None else 0
        self._backed_ranges: dict[int, int] = {}
        self._reserve_lock = threading.Lock()  # one fallocate at a time: the space check holds
        #: bytes of the pool's file system to leave free (what engines' KV caches need)
        self.keep_free: Callable[[], int] = lambda: 0
        self.space_short = False  # the last reservation found no space
        self._retry_at = 0.0  # monotonic time before which reserve_to does not try again
        self._space_log = RateLimitedLog(log, interval=30.0)

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
    def attach(cls, path: str, warm_limit: Callable[[], int] | None = None) -> PoolFile:
        """Map an existing pool (workers). With ``warm_limit`` a background thread fills this
        process's page tables for the pool's first ``warm_limit()`` bytes as that bound grows
        (the server's warm progress); without it pages are mapped by faults on first use."""
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            pool = cls(path, mmap.mmap(fd, size, flags=mmap.MAP_SHARED), size)
        finally:
            os.close(fd)
        if warm_limit is not None:
            pool._start(pool._follow, warm_limit)
        return pool

    def warm_in_background(
        self,
        lock: bool,
        progress: Callable[[int], None] | None = None,
        high_water: Callable[[], int] | None = None,
        engine_started: Callable[[], bool] | None = None,
    ) -> None:
        """Start warming (creator: reserve, then lock or populate), chunk by chunk.

        ``high_water()`` is the end of the highest slot the allocator has handed out. The
        pool is warmed lowest first: up to :data:`WARM_URGENT` beyond it at normal priority
        (a copy into a fresh slot must not pay the first touch: 0.05-0.3 GB/s on a VM), the
        lowest :data:`WARM_AHEAD` bytes at nice 10 (mostly the CPU vLLM leaves free while it
        starts, yet some CPU even next to vLLM on the CPU, which busy-polls a core when idle
        and so starves an idle-priority thread), and the rest from the top down at idle
        priority. The nice-10 tier does not follow the high-water mark: warming 2 GiB ahead
        of the saves of a cold prefill took a quarter of the CPU samples of that prefill (7B
        shape, 8192 tokens, perf). Until ``engine_started()`` is true (an engine registered
        its KV cache or took a slot) only the idle-priority thread runs, and only for the
        lowest :data:`WARM_AHEAD` bytes: an engine that is still starting gets every busy
        CPU, and its own allocation of its KV cache is not slowed by ours (2 GiB took 7 s
        instead of 1.5 s next to the warmer). ``progress(n)``: the first ``n`` bytes are ready."""
        self._lo, self._hi = 0, self.size  # [lo, hi) is not warm yet
        self._claim = threading.Lock()
        self._locking = lock
        self._progress = progress
        self._t0 = time.monotonic()
        hw = high_water or (lambda: 0)
        started = engine_started or (lambda: True)
        self._start(self._warm_up_to, lambda: hw() + WARM_URGENT if started() else 0, 0)
        self._start(self._warm_up_to, lambda: WARM_AHEAD if started() else 0, WARM_AHEAD_NICE)
        self._start(self._warm_rest, started)

    def _start(self, target: Callable[..., None], *args: object) -> None:
        t = threading.Thread(target=target, args=args, name="pool-warm", daemon=True)
        self._warmers.append(t)
        t.start()

    def _warm_up_to(self, bound: Callable[[], int], nice: int) -> None:
        if nice:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)  # this thread
        while not self._stop.is_set():
            with self._claim:
                if self._lo >= self._hi:
                    return
                if self._lo >= bound():
                    start = None
                else:
                    start, self._lo = self._lo, min(self._lo + WARM_CHUNK, self._hi)
            if start is None:
                self._stop.wait(WARM_POLL_S)
            elif not self._warm_range(start, min(start + WARM_CHUNK, self.size)):
                return

    def _warm_rest(self, engine_started: Callable[[], bool]) -> None:
        _idle_priority()
        while not self._stop.is_set():
            with self._claim:
                if self._lo >= self._hi:
                    return
                if engine_started():  # the other tiers warm the bottom: take the top
                    end, self._hi = self._hi, max(self._hi - WARM_CHUNK, self._lo)
                    start = self._hi
                elif self._lo < WARM_AHEAD:  # what the first hits will need
                    start, self._lo = self._lo, min(self._lo + WARM_CHUNK, self._hi)
                    end = self._lo
                else:  # no more now: warming slows the engine's own KV-cache allocation 5x
                    start = None
            if start is None:
                self._stop.wait(WARM_POLL_S)
                continue
            if not self._warm_range(start, end):
                return

    def _warm_range(self, start: int, end: int) -> bool:
        """Reserve and lock (or populate) ``[start, end)``; False when warming must stop.

        With the file system full (or down to what engines need) this waits and retries:
        warming resumes once space returns."""
        n = end - start
        try:
            while self._fd is not None and not self._reserve(start, end, "warming"):
                if self._stop.wait(SPACE_RETRY_S):
                    return False
            addr = ctypes.c_void_p(self.address + start)
            if self._locking and _libc.mlock(addr, ctypes.c_size_t(n)) != 0:
                with self._claim:
                    if self._locking:
                        self._locking = False
                        self._lock_failed(ctypes.get_errno())
            if not self._locking and not populate(self.address + start, n):
                return False  # an older kernel: pages are faulted in on first use instead
        except ValueError:
            return False  # the mapping was closed under us at shutdown
        self._warmed(start, end)
        return True

    def reserve_to(self, end: int) -> bool:
        """Make the pool's memory below ``end`` exist before a slot ending there is handed out
        (tmpfs pages that cannot be allocated are a SIGBUS in whoever touches them). Reserves
        whole warm chunks; False when the file system has no room for them (logged). Cheap
        when ``end`` is below :attr:`backed` (the caller checks that first)."""
        if end <= self.backed:
            return True
        if time.monotonic() < self._retry_at:  # full a moment ago: the hot path pays nothing
            return False
        start = self.backed  # reserving part of it again (another thread's) costs little
        return self._reserve(start, min(-(-end // WARM_CHUNK) * WARM_CHUNK, self.size), "a slot")

    def _reserve(self, start: int, end: int, purpose: str) -> bool:
        """fallocate ``[start, end)`` if the file system can spare it beyond ``keep_free()``.
        One at a time: the free-space check must still hold when the fallocate runs."""
        with self._reserve_lock:
            if end <= self.backed:
                return True
            if self._fd is None:
                return False  # shut down
            keep = max(int(self.keep_free()), 0)
            # What is not reserved yet (the top-down warmer may have reserved part of it)
            need = (end - start) - sum(
                max(min(e, end) - max(s, start), 0) for s, e in self._backed_ranges.items()
            )
            free = 0
            try:
                st = os.fstatvfs(self._fd)
                free = st.f_bavail * st.f_frsize
                # Checked first: a fallocate that fails allocates, then frees, what it could.
                if free < need:
                    err = os.strerror(errno.ENOSPC)
                elif keep and free - need < keep:
                    err = f"{keep} bytes are kept free for engines' KV caches"
                else:
                    os.posix_fallocate(self._fd, start, end - start)
                    err = ""
            except OSError as exc:
                err = exc.strerror or str(exc)
            if not err:
                self._mark_backed(start, end)
        if err:
            self.space_short = True
            self._retry_at = time.monotonic() + SPACE_RETRY_S
            self._space_log.log(
                logging.ERROR,
                "pool-full",
                "pool %s: the file system of %s is full (%s): %d bytes needed at offset %d "
                "for %s, %d free. Saves into new pool slots are skipped and promotes miss, and "
                "warming waits, until space is freed there; or lower HPKV_KV_MEM_POOL_SIZE",
                self.path,
                os.path.dirname(self.path),
                err,
                need,
                start,
                purpose,
                free,
            )
            return False
        if self.space_short:
            self.space_short = False
            log.info("pool %s: memory can be reserved again (%d bytes free)", self.path, free - need)
        return True

    def _mark_backed(self, start: int, end: int) -> None:
        """``[start, end)`` is reserved; advance :attr:`backed` (under ``_reserve_lock``)."""
        if start <= self.backed:
            backed = max(self.backed, end)
        else:
            self._backed_ranges[start] = max(end, self._backed_ranges.get(start, end))
            backed = self.backed
        merged = True
        while merged:  # ranges reserved in any order join the prefix
            merged = False
            for s, e in list(self._backed_ranges.items()):
                if s <= backed:
                    del self._backed_ranges[s]
                    backed = max(backed, e)
                    merged = True
        self.backed = backed  # one store: readers without the lock see the old or the new value

    def _warmed(self, start: int, end: int) -> None:
        with self._claim:
            self._done_ranges[start] = end
            while self._ready in self._done_ranges:  # chunks end in any order
                self._ready = self._done_ranges.pop(self._ready)
            ready = self._ready
        if self._progress is not None:
            self._progress(ready)
        if ready >= self.size:  # the ranges tile the pool: the prefix reaches the end last
            self.locked = self._locking
            log.info(
                "pool %s: %d bytes allocated%s in %.1fs (background)",
                self.path,
                self.size,
                " and locked" if self._locking else "",
                time.monotonic() - self._t0,
            )
            self._close_fd()

    def _close_fd(self) -> None:
        with self._reserve_lock:  # never under a reservation that is using it
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _follow(self, warm_limit: Callable[[], int]) -> None:
        """Fill page tables up to ``warm_limit()`` (memory the server already allocated)."""
        done = 0
        while done < self.size and not self._stop.is_set():
            limit = min(int(warm_limit()), self.size)
            if done >= limit:
                self._stop.wait(WARM_POLL_S)
                continue
            n = min(WARM_CHUNK, limit - done)
            try:
                if not populate(self.address + done, n):
                    return
            except ValueError:
                return
            done += n

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
        deadline = time.monotonic() + timeout
        for t in self._warmers:
            t.join(max(deadline - time.monotonic(), 0.0))
        if not any(t.is_alive() for t in self._warmers):
            self._close_fd()

    def close(self) -> None:
        self.stop_warming()
        del self.array
        try:
            self.mm.close()
        except BufferError:
            pass  # views are still alive (e.g. a copier): unmapped when they go

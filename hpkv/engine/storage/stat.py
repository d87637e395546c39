"""The stat threads: the file system calls of a lookup (and the few unlinks the request loop
used to make), run off the request loop and without the server's lock.

Why: a stat on a hung or slow mount (a hard NFS mount whose server is gone, a stopped FUSE
daemon) blocks for as long as the mount does. Made in the request loop under the server's
lock, it froze every client's calls, DRAM hits included. Here a lookup that needs the file
system submits one :class:`StatBatch` (the storage hits due for re-verification, then the
unknown keys after the prefix, in order) and is parked; a thread stats the files and puts
the batch on the done list, and the doorbell wakes the request loop, whose poll applies the
results under the lock.

The pool is bounded: at most ``max_batches`` batches submitted and not yet taken back. When
every thread is stuck in a hung mount the queue fills and :meth:`StatPool.submit` refuses at
once: the tier answers from what it knows (the keys to check are misses) and the DRAM pool
keeps serving; when the stats return, the batches drain and submitting works again.

Threads are daemons and :meth:`StatPool.shutdown` joins them with a bound: a thread stuck in
the kernel never holds up a stop.
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from hpkv.engine.index import Namespace
from hpkv.engine.storage.scan import stat_block
from hpkv.io_workers.tree import StorageTree
from hpkv.ring import Doorbell

log = logging.getLogger("hpkv.storage")

STAT_THREADS = 4
MAX_BATCHES = 16  # submitted and not taken back: beyond this the pool is saturated
JOIN_S = 0.5  # per thread at shutdown (a thread stuck in a hung mount is left behind)

# A check's outcome: the files are all there, gone (ENOENT, ESTALE: another server's
# eviction, an operator), or unknown (any other error: no proof either way).
THERE, GONE, UNKNOWN = 1, 0, -1


def check_block(
    tree: StorageTree, ns: Namespace, key: bytes, by_open: bool = False
) -> tuple[int, OSError | None]:
    """Whether all of ``key``'s files are there (``by_open``: see :func:`stat_block`); ESTALE
    (a file handle of a file another NFS client removed) means gone, like ENOENT."""
    try:
        return (THERE if stat_block(tree, ns, key, by_open) else GONE), None
    except OSError as exc:
        if exc.errno == errno.ESTALE:
            return GONE, None
        return UNKNOWN, exc


@dataclass
class StatBatch:
    """The checks of one lookup. ``verify``: storage hits whose files were not seen lately
    (each checked); ``extend``: unknown keys after the prefix, checked in order until the first
    whose files are not all there; ``each``: unknown keys each checked (a FLAG_EACH lookup's
    keys past its prefix while the journals are read). ``reopen``: keys a promote found gone
    lately, checked by opening their files (a caching mount's stat may still show them).
    ``results`` (key → THERE / GONE / UNKNOWN) and ``errors`` are written by the stat thread,
    read by the request loop once the batch is done."""

    ns: Namespace
    verify: list[bytes]
    extend: list[bytes]
    each: list[bytes] = field(default_factory=list)
    reopen: frozenset[bytes] = frozenset()
    submitted: float = 0.0
    results: dict[bytes, int] = field(default_factory=dict)
    errors: list[OSError] = field(default_factory=list)
    finished: float = 0.0
    late: bool = False  # counted once as a stat that outlived the lookup bound

    def checked(self) -> list[bytes]:
        return self.verify + self.extend + self.each

    def unknown(self) -> list[bytes]:
        """The keys nobody knew when the batch was made (``extend`` then ``each``)."""
        return self.extend + self.each

    def run(self, tree: StorageTree) -> None:
        for key in self.verify + self.each:
            self.results[key], exc = check_block(tree, self.ns, key, key in self.reopen)
            if exc is not None:
                self.errors.append(exc)
        for key in self.extend:
            found, exc = check_block(tree, self.ns, key, key in self.reopen)
            self.results[key] = found
            if exc is not None:
                self.errors.append(exc)
            if found != THERE:
                break


Task = StatBatch | Callable[[], None]


class StatPool:
    """A few daemon threads doing stats (and other small file system calls) for the request
    loop. ``submit`` and ``take`` are called by the request loop (under the server's lock);
    the threads never take that lock."""

    def __init__(
        self,
        tree: StorageTree,
        doorbell: Doorbell | None,
        threads: int = STAT_THREADS,
        max_batches: int = MAX_BATCHES,
    ):
        self.tree = tree
        self.doorbell = doorbell
        self.n_threads = threads
        self.max_batches = max_batches
        self._q: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._done: deque[StatBatch] = deque()  # appended by the threads, taken by the loop
        self._lock = threading.Lock()  # guards _pending and _outstanding (threads and the loop)
        self._pending: dict[int, StatBatch] = {}  # id -> batches submitted and not finished
        self._calls: dict[int, float] = {}  # id -> when a callable submitted and not finished was
        self._outstanding = 0  # submitted, not yet taken back (the bound)
        self._stopped = False
        self._threads = [
            threading.Thread(target=self._run, name=f"storage-stat{i}", daemon=True) for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def submit(self, task: Task) -> bool:
        """Queue a batch (or a callable); False, and nothing queued, when the pool is saturated."""
        with self._lock:
            if self._stopped or self._outstanding >= self.max_batches:
                return False
            self._outstanding += 1
            if isinstance(task, StatBatch):
                task.submitted = time.monotonic()
                self._pending[id(task)] = task
            else:
                self._calls[id(task)] = time.monotonic()
        self._q.put(task)
        return True

    @property
    def saturated(self) -> bool:
        return self._outstanding >= self.max_batches

    def take(self) -> list[StatBatch]:
        """The batches finished since the last call (request loop)."""
        done = []
        while self._done:
            done.append(self._done.popleft())
        with self._lock:
            self._outstanding -= len(done)
        return done

    def running(self) -> list[StatBatch]:
        """The batches submitted and not finished, oldest first."""
        with self._lock:
            return sorted(self._pending.values(), key=lambda b: b.submitted)

    def oldest(self, now: float) -> float:
        """Seconds the oldest task submitted and not finished has waited (0 when none)."""
        with self._lock:
            since = [b.submitted for b in self._pending.values()] + list(self._calls.values())
        return now - min(since) if since else 0.0

    def shutdown(self) -> None:
        self._stopped = True
        for _ in self._threads:
            self._q.put(None)
        deadline = time.monotonic() + JOIN_S * max(1, len(self._threads))
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        stuck = sum(t.is_alive() for t in self._threads)
        if stuck:
            log.warning(
                "%d storage stat thread(s) still stuck in the file system at shutdown: left behind", stuck
            )

    def _run(self) -> None:
        while True:
            task = self._q.get()
            if task is None:
                return
            if not isinstance(task, StatBatch):
                try:
                    task()
                except Exception:  # noqa: BLE001 - a thread of the pool must keep running
                    log.exception("storage file system task failed")
                finally:
                    self._done_callable(task)
                continue
            try:
                task.run(self.tree)
            except Exception as exc:  # noqa: BLE001 - the batch still ends (its keys unknown)
                log.exception("storage stat batch failed")
                task.errors.append(OSError(errno.EIO, str(exc)))
            task.finished = time.monotonic()
            with self._lock:
                self._pending.pop(id(task), None)
            self._done.append(task)
            if self.doorbell is not None:
                self.doorbell.ring()

    def _done_callable(self, task: Callable[[], None]) -> None:
        # a callable counts against the bound until it ends; the loop's take() never sees it
        with self._lock:
            self._outstanding -= 1
            self._calls.pop(id(task), None)

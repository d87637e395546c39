"""The storage tier as the server runs it: IO workers, write-through, promotes, the file
catalog, directory scans, capacity and free-space limits.

Threads and ownership (everything below runs in the server process, under the
server's one lock):

* the *request loop* issues every IO job and consumes every completion. Each IO
  worker has a request ring (server → worker, SPILL / PROMOTE) and a completion
  ring bound to the server's doorbell, so a completion wakes the loop like a
  client's request does. Nothing here waits for IO: a PROMOTE hot call is parked
  (:class:`PromoteCall`) and answered when its jobs complete or its deadline passes;
* the *maintenance thread* checks free space, evicts files above the capacity
  limit (unlinks happen outside the lock) and decides when a paused spill resumes;
* one *scan thread* per attached namespace lists ``<storage>/<fingerprint>/`` and
  adds complete blocks (every rank's file present) to the index, in batches;
* the *supervisor* only flags a dead IO worker; the request loop fails the jobs the
  worker had taken (the ring's FIFO order says which), removes its temporary file
  and restarts it on the same rings. Queued jobs survive for the replacement.

Write-through: a block that becomes READY is spilled once per rank unless it
already has files; it stays unevictable while the spill runs. Spilling pauses
while free space is under ``HPKV_STORAGE_MIN_FREE`` and after ENOSPC (backing off
1 s → 30 s); meanwhile READY blocks are evictable without files and are remembered
for a retry when spilling resumes. Reads keep working throughout.

The catalog is an LRU of the blocks whose files are known (spilled here, found by
a scan or by a stat on a lookup miss), used for ``HPKV_KV_STORAGE_SIZE``. Files
found by a scan enter at the cold end, in directory order.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from hpkv.common.proc import pid_alive
from hpkv.common.ratelimit import RateLimitedLog
from hpkv.config import Config
from hpkv.engine.index import Block, Index, Namespace, State
from hpkv.engine.storage.probe import DirectIoProbe, probe_o_direct, virtio_disk
from hpkv.engine.workers import WorkerProcess
from hpkv.io_workers import kvfile
from hpkv.io_workers.tree import StorageTree
from hpkv.protocol import wire as P
from hpkv.protocol.errors import Status, status_message
from hpkv.protocol.stats import G, NsCounter, StatsSegment
from hpkv.ring import Doorbell, Ring, RingError


class Client(Protocol):
    """What the storage tier needs of the server's record of a connected client."""

    cid: int
    alive: bool


log = logging.getLogger("hpkv.storage")

# Jobs queued per worker. Promotes may queue deep, so a worker keeps reading while the
# server waits for a CPU; spills stay shallow, so a promote never waits behind many.
MAX_INFLIGHT_PER_WORKER = 16
MAX_SPILLS_PER_WORKER = 4
# On a virtio-blk disk two 4 MiB O_DIRECT reads at once took 7.2 ms each, one alone 2.5 ms
# (the dev VM, IO worker traces): files that large are read by one worker at a time.
VIRTIO_READ_INFLIGHT = 4 << 20
SCAN_BATCH = 1024  # blocks added to the index per lock hold
MAINT_INTERVAL_S = 0.5
ENOSPC_BACKOFF_S = (1.0, 30.0)
MAX_SPILL_ATTEMPTS = 3  # for errors other than ENOSPC / a dead worker
MAX_RETRY_BLOCKS = 100_000
STALE_TMP_AGE_S = 3600.0  # another host's temporary file older than this is abandoned
VERIFY_TTL_S = 2.0  # a storage hit's files are stat-ed again at most this often
QUARANTINE_MAX_FILES = 1000  # corrupt files kept for inspection: the newest this many ...
QUARANTINE_MAX_AGE_S = 7 * 86400  # ... and none older than a week
QUARANTINE_CHECK_S = 60.0


# ------------------------------------------------------------------ job bookkeeping
class _BlockOp:
    """The jobs of all ranks of one block: one spill or one promote."""

    __slots__ = ("kind", "block", "remaining", "status", "written", "waiters")

    def __init__(self, kind: int, block: Block):
        self.kind = kind
        self.block = block
        self.remaining = block.ns.world_size
        self.status = 0  # first failure, 0 while all succeeded
        self.written: list[int] = []  # spill: ranks whose file we wrote
        self.waiters: list[tuple[PromoteCall, int]] = []  # promote: (call, row)


@dataclass
class _Job:
    op: _BlockOp
    rank: int


@dataclass
class PromoteCall:
    """A client's PROMOTE waiting for IO; answered once, when done or at its deadline."""

    client: Client
    seq: int
    ns: Namespace
    keys: list[bytes]
    rows: np.ndarray
    deadline: float
    outstanding: int = 0
    done: bool = False


@dataclass
class _Link:
    """The server's ends of one IO worker's rings and the jobs it holds, in push order."""

    worker: WorkerProcess
    req: Ring
    resp: Ring
    inflight: OrderedDict[int, _Job] = field(default_factory=OrderedDict)
    spills: int = 0  # of which spills; the rest are promotes
    dead: bool = False


class StorageTier:
    """Everything the server does for the storage tier (see the module docstring)."""

    def __init__(
        self,
        cfg: Config,
        server_dir: str,
        stats: StatsSegment,
        index: Index,
        lock: threading.RLock,
        doorbell: Doorbell,
        pool_path: str,
        answer: Callable[[Any, int, np.ndarray], None],  # the server's Client (a subtype of ours)
    ):
        self.cfg = cfg
        self.root: str = cfg.storage_path  # type: ignore[assignment]
        self.tree: StorageTree  # opened and verified by start(); every path below goes through it
        self.dir = server_dir
        self.stats = stats
        self.g = stats.glob
        self.index = index
        self.lock = lock
        self.doorbell = doorbell
        self.pool_path = pool_path
        self._answer = answer
        self.capacity = int(cfg["HPKV_KV_STORAGE_SIZE"])
        self.min_free_pct = float(cfg["HPKV_STORAGE_MIN_FREE"])
        self.probe: DirectIoProbe | None = None
        self.bounce_reads = False
        self.read_inflight = 0  # bytes of promote reads spread over workers at once; 0: no limit
        self.o_direct_reason: str | None = None
        self.links: list[_Link] = []
        self._seq = 0
        self._spill_q: deque[_Job] = deque()
        self._promote_q: deque[_Job] = deque()
        self._promoting: dict[bytes, _BlockOp] = {}
        self._calls: list[PromoteCall] = []
        self._lru: OrderedDict[bytes, Namespace] = OrderedDict()  # known blocks with files, LRU first
        self._deleting: set[bytes] = set()
        self._retry: OrderedDict[bytes, int] = OrderedDict()  # key -> failed spill attempts
        self._ns_raw: dict[int, bytes] = {}
        self._scans: dict[int, threading.Thread] = {}
        self.scan_done: dict[int, bool] = {}
        self.files = 0
        self.bytes = 0
        # Spill pause: free space under the minimum, or ENOSPC (with back-off).
        self._low_space = False
        self._enospc_until = 0.0
        self._enospc_backoff = ENOSPC_BACKOFF_S[0]
        self._enospc_episode = 0  # ENOSPC failures since the last successful spill
        self._paused = False
        self._resume = False  # the maintenance thread saw the pause end
        self.catalog_dirty = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._errors = RateLimitedLog(log)

    # ================================================================ life cycle
    def start(self, slots: list[int]) -> list[WorkerProcess]:
        """Probe O_DIRECT, start the IO workers (one per stats row in ``slots``, see
        ``HPKV_NUM_IO_WORKERS``) and the maintenance thread; returns the workers."""
        # KV files hold prompts: the root must be this user's and closed to writers (0700 when
        # hpkv creates it), and no other user may rename it away (its ancestors are checked);
        # everything under it is created 0700 / 0600 and opened relative to the root's
        # descriptor, which the IO workers check they share (device, inode).
        self.tree = StorageTree.open(self.root)
        with self.tree.dir(kvfile.QUARANTINE_DIR, create=True):
            pass
        self._quarantine_checked = 0.0
        self._clean_quarantine()
        self.probe = probe_o_direct(self.root, dir_fd=self.tree.root_fd)
        self.o_direct_reason = self.probe.reason
        (log.info if self.probe.ok else log.warning)("%s", self.probe.describe(self.root))
        self.g[G.STORAGE_O_DIRECT] = int(self.probe.ok)
        self.g[G.STORAGE_CAPACITY] = self.capacity
        self._check_free_space()
        disk = virtio_disk(self.root)  # the auto settings below are for virtio-blk disks
        self.bounce_reads = bool(
            self._auto_on_virtio(
                "HPKV_STORAGE_READ_BOUNCE",
                disk if self.probe.ok else None,
                True,
                False,
                "promotes read into a private buffer and copy into the pool, faster there than "
                "DMA into the shared pool",
            )
        )
        self.read_inflight = int(
            self._auto_on_virtio(
                "HPKV_STORAGE_READ_INFLIGHT",
                disk,
                VIRTIO_READ_INFLIGHT,
                0,
                "promotes of files over 2 MiB are read by one IO worker at a time, faster there "
                "than two at once",
            )
        )
        spec = {
            "pool": self.pool_path,
            "storage": self.root,
            "storage_id": list(self.tree.identity),
            "fs_type": self.probe.fs_type,
            "o_direct": self.probe.ok,
            "fsync": bool(self.cfg["HPKV_STORAGE_FSYNC"]),
            "bounce_reads": self.bounce_reads,
            "log_level": self.cfg["HPKV_LOG_LEVEL"],
        }
        workers = []
        for i, slot in enumerate(slots):
            w, req, resp = WorkerProcess.start_io(self.dir, f"io{i}", slot, spec, self.stats, self.doorbell)
            self.links.append(_Link(w, req, resp))
            workers.append(w)
        threading.Thread(target=self._maintenance_loop, name="storage-maint", daemon=True).start()
        log.info(
            "storage tier %s: %d IO worker(s), capacity %s, spilling pauses under %g%% free",
            self.root,
            len(workers),
            self.capacity or "unlimited",
            self.min_free_pct,
        )
        return workers

    def _auto_on_virtio(self, key: str, disk: str | None, on_virtio: Any, elsewhere: Any, effect: str) -> Any:
        """The setting ``key``, or for ``auto`` its value on a virtio-blk disk (logged) or elsewhere."""
        setting = self.cfg[key]
        if setting is not None:
            return setting
        if disk is None:
            return elsewhere
        log.info("storage is on virtio disk %s: %s (%s=0 turns this off)", disk, effect, key)
        return on_virtio

    def shutdown(self) -> None:
        """Stop the threads and close the rings (after the server stopped the workers)."""
        self._stop.set()
        self._wake.set()
        for t in list(self._scans.values()):
            t.join(timeout=5.0)
        for link in self.links:
            for ring in (link.req, link.resp):
                ring.close()  # never raises; safe twice

    def describe(self) -> dict[str, Any]:
        """The strings of the stats snapshot's ``storage`` section (the numbers are in G)."""
        return {
            "path": self.root,
            "o_direct_reason": self.o_direct_reason,
            "fs_type": self.probe.fs_type if self.probe else None,
            "read_bounce": self.bounce_reads,
            "scans_done": sorted(k for k, v in self.scan_done.items() if v),
        }

    # ================================================================ namespaces
    def attach_namespace(self, ns: Namespace) -> None:
        """Start learning the namespace's files: a background scan (stat on miss covers the rest)."""
        self._ns_raw[ns.ns_id] = kvfile.fingerprint_bytes(ns.fingerprint)
        old = self._scans.get(ns.ns_id)
        if old is not None and old.name == f"scan-ns{ns.ns_id}-{id(ns)}":
            return
        self.scan_done[ns.ns_id] = False
        t = threading.Thread(target=self._scan, args=(ns,), name=f"scan-ns{ns.ns_id}-{id(ns)}", daemon=True)
        self._scans[ns.ns_id] = t
        t.start()

    def detach_namespace(self, ns: Namespace) -> None:
        """The server released ``ns`` (its id will be reused): stop its scan and forget its
        catalog entries (the files stay; a later attach scans them again)."""
        ns.released = True
        self._ns_raw.pop(ns.ns_id, None)
        self._scans.pop(ns.ns_id, None)
        self.scan_done.pop(ns.ns_id, None)
        for key in [k for k, n in self._lru.items() if n is ns]:
            del self._lru[key]
            self.files -= ns.world_size
            self.bytes -= ns.world_size * kvfile.file_size(ns.shard_bytes)
        self._publish()

    # ================================================================ hot path (request loop, lock held)
    def verify_lookup(self, ns: Namespace, keys: list[bytes], hit: int, tiers: list[int]) -> int:
        """Cut a lookup's prefix at the first storage hit whose files are gone (deleted from
        outside): the index forgets it, so no load is promised that a promote cannot keep.
        Each block is stat-ed at most every VERIFY_TTL_S."""
        now = time.monotonic()
        for i in range(hit):
            if tiers[i] != 2:
                continue
            b = self.index.blocks.get(keys[i])
            if b is None or b.ns is not ns or b.state != State.STORED or now - b.verified < VERIFY_TTL_S:
                continue
            if self._files_exist(ns, keys[i]):
                b.verified = now
                continue
            self._forget(keys[i])
            del tiers[i:]
            return i
        return hit

    def _files_exist(self, ns: Namespace, key: bytes) -> bool:
        want = kvfile.file_size(ns.shard_bytes)
        rel = kvfile.rel_dir(ns.fingerprint, key)
        for rank in range(ns.world_size):
            try:
                if not _is_kv_file(self.tree.stat(rel, kvfile.file_name(key, rank)), want):
                    return False
            except FileNotFoundError:
                return False
            except OSError:
                return True  # an IO error is not proof it is gone: the promote will tell
        return True

    def extend_lookup(self, ns: Namespace, keys: list[bytes], hit: int, tiers: list[int]) -> int:
        """Continue a lookup's prefix past keys the index does not know but whose files exist
        (scan not there yet, or written by another server on the same storage); extends ``tiers``."""
        while hit < len(keys) and self._stat_block(ns, keys[hit]):
            more, more_tiers = self.index.lookup(ns.ns_id, keys[hit:])
            if not more:  # its files exist but the index did not take it (another namespace's key)
                break
            tiers.extend(more_tiers)
            hit += more
        return hit

    def spill(self, blocks: Iterable[Block]) -> None:
        """Write-through of blocks that just became READY."""
        for b in blocks:
            if b.on_storage:
                self._touch(b.key)
                continue
            if self._paused:
                self.index.skip_spill(b)
                self._remember_retry(b.key, 0)
                continue
            self._start_spill(b)
        self._dispatch()

    def pending_spills(self) -> int:
        """Blocks whose write-through is queued or running (what a stop drains first)."""
        ops = {id(job.op) for job in self._spill_q}
        ops.update(
            id(job.op)
            for link in self.links  # a dead worker's jobs are retried
            for job in link.inflight.values()
            if job.op.kind == P.SPILL
        )
        return len(ops) + (len(self._retry) if self._resume else 0)

    def touch(self, keys: Iterable[bytes]) -> None:
        """The blocks were used (pinned for loading): their files are recent too."""
        for k in keys:
            self._touch(k)

    def promote(
        self, c: Client, seq: int, ns: Namespace, keys: list[bytes], timeout: float
    ) -> np.ndarray | None:
        """A PROMOTE hot call: rows of pinned pool offsets, now (no IO needed) or None (parked)."""
        world = ns.world_size
        rows = np.full((len(keys), world), -1, np.int64)
        call = PromoteCall(c, seq, ns, keys, rows, time.monotonic() + timeout)
        idx = self.index
        dram = 0
        for i, k in enumerate(keys):
            b = idx.blocks.get(k)
            if b is None and self._stat_block(ns, k):
                b = idx.blocks.get(k)
            if b is None or b.ns is not ns:
                continue
            slots = idx.pin(ns, [k], owner=c.cid)[0] if b.state == State.READY else None
            if slots is not None:
                rows[i] = slots
                dram += 1
                self._touch(k)
            elif b.state == State.PROMOTING:
                self._promoting[k].waiters.append((call, i))
                call.outstanding += 1
            elif b.state == State.STORED:
                if idx.begin_promote(k) is None:
                    continue  # pool full of pinned blocks: this one fails
                op = _BlockOp(P.PROMOTE, b)
                op.waiters.append((call, i))
                self._promoting[k] = op
                call.outstanding += 1
                self._promote_q.extend(_Job(op, r) for r in range(world))
        ns.counters[NsCounter.LOADS_DRAM] += dram
        if call.outstanding == 0:
            return rows
        self._calls.append(call)
        self._dispatch()
        return None

    def client_gone(self, c: Client) -> None:
        """Forget a dropped client's parked call (its pins are released by the server)."""
        for call in self._calls:
            if call.client is c:
                call.done = True
        self._calls = [call for call in self._calls if not call.done]

    # ================================================================ request loop: completions
    def poll(self) -> None:
        """Consume completions, recover dead workers, issue queued jobs, answer due calls."""
        with self.lock:
            for link in self.links:
                while True:
                    try:
                        d = link.resp.try_pop()
                    except RingError:
                        break
                    if d is None:
                        break
                    job = link.inflight.pop(d.seq, None)
                    if job is not None:
                        link.spills -= job.op.kind == P.SPILL
                        self._complete(job, d.status, d.a0, d.flags)
                if link.dead:
                    self._recover(link)
            if self._resume:
                self._resume = False
                self._retry_spills()
            self._dispatch()
            self.g[G.STORAGE_SPILLS_PENDING] = len(self._spill_q) + sum(lk.spills for lk in self.links)
            if self._calls:
                now = time.monotonic()
                for call in self._calls:
                    if not call.done and now >= call.deadline:
                        self._errors.log(
                            logging.WARNING,
                            "promote-timeout",
                            "promote of %d block(s) for client %d not finished by its "
                            "deadline: answered with %d loaded, the rest reported failed",
                            len(call.keys),
                            call.client.cid,
                            int((call.rows[:, 0] >= 0).sum()),
                        )
                        self._finish_call(call)  # whatever is not loaded yet stays -1
                self._calls = [call for call in self._calls if not call.done]
            self._publish()

    def worker_died(self, w: WorkerProcess) -> None:
        """Supervisor: an IO worker exited. The request loop recovers its jobs and restarts it."""
        for link in self.links:
            if link.worker is w and not link.dead:
                link.dead = True
                self.doorbell.ring()

    def _recover(self, link: _Link) -> None:
        # Completions were drained just before: every job still listed was either taken by
        # the dead worker (lost) or is still in the request ring, the newest `depth` ones.
        queued = link.req.depth
        jobs = list(link.inflight.items())
        lost = jobs[: max(0, len(jobs) - queued)]
        dead_pid = link.worker.proc.pid if link.worker.proc else None
        for seq, job in lost:
            del link.inflight[seq]
            link.spills -= job.op.kind == P.SPILL
            if job.op.kind == P.SPILL and dead_pid:
                b = job.op.block
                name = kvfile.tmp_name(kvfile.file_name(b.key, job.rank), pid=dead_pid)
                self._unlink_quietly(kvfile.rel_dir(b.ns.fingerprint, b.key), name)
            self._complete(job, Status.WORKER_DIED, 0, 0)
        self.g[G.WORKER_RESTARTS] += 1
        link.dead = False
        log.error(
            "IO worker %s died with %d job(s) taken: reported failed (spills are retried)",
            link.worker.base,
            len(lost),
        )
        link.worker.respawn()
        self.catalog_dirty = True

    def _complete(self, job: _Job, status: int, nbytes: int, flags: int) -> None:
        op = job.op
        g = self.g
        if flags & P.IO_DIRECT_FALLBACK and g[G.STORAGE_O_DIRECT]:
            g[G.STORAGE_O_DIRECT] = 0
            g[G.STORAGE_IO_ERRORS] += 1
            self.o_direct_reason = f"EINVAL on {self.probe.fs_type if self.probe else '?'} (at run time)"
            self.catalog_dirty = True
            log.warning("O_DIRECT refused at run time on %s: IO workers fall back to buffered IO", self.root)
        if status == 0:
            if op.kind == P.SPILL:
                if not flags & P.IO_EXISTED:
                    g[G.STORAGE_BYTES_WRITTEN] += nbytes
                    g[G.STORAGE_SPILLS] += 1
                    op.written.append(job.rank)
            else:
                g[G.STORAGE_BYTES_READ] += nbytes
                g[G.STORAGE_PROMOTES] += 1
        else:
            op.status = op.status or status
            self._count_failure(op, job.rank, status)
        op.remaining -= 1
        if op.remaining == 0:
            if op.kind == P.SPILL:
                self._finish_spill(op)
            else:
                self._finish_promote(op)

    def _count_failure(self, op: _BlockOp, rank: int, status: int) -> None:
        b = op.block
        path = kvfile.file_path(self.root, b.ns.fingerprint, b.key, rank)
        g = self.g
        if status == Status.CORRUPT:
            g[G.STORAGE_IO_ERRORS] += 1
            g[G.STORAGE_QUARANTINED] += 1  # the worker logged why and where it went
        elif status == -errno.ENOSPC and op.kind == P.SPILL:
            g[G.STORAGE_IO_ERRORS] += 1
            self._on_enospc(path)
        elif status == Status.WORKER_DIED:
            g[G.STORAGE_IO_ERRORS] += 1  # logged once by _recover
        else:
            what = "spill" if op.kind == P.SPILL else "promote"
            self._io_error(
                what, -status if status < 0 and -status < 1000 else errno.EIO, path, status_message(status)
            )

    def _io_error(self, what: str, err: int, path: str, text: str | None = None) -> None:
        """Count a storage IO error and log it (rate-limited per kind)."""
        self.g[G.STORAGE_IO_ERRORS] += 1
        name = errno.errorcode.get(err, str(err))
        self._errors.log(
            logging.ERROR,
            f"{what}-{name}",
            "storage %s failed: %s (%s) on %s",
            what,
            name,
            text or os.strerror(err),
            path,
        )

    # ================================================================ spills
    def _start_spill(self, b: Block) -> None:
        b.no_spill = False
        self.index.set_io(b, +1)
        op = _BlockOp(P.SPILL, b)
        self._spill_q.extend(_Job(op, r) for r in range(b.ns.world_size))

    def _finish_spill(self, op: _BlockOp) -> None:
        b = op.block
        self.index.set_io(b, -1)
        if op.status == 0:
            self._retry.pop(b.key, None)
            self._add_known(b.ns, b.key, recent=True)
            if self._enospc_episode:
                log.warning("spilling works again after %d ENOSPC failure(s)", self._enospc_episode)
                self._enospc_episode = 0
                self._enospc_backoff = ENOSPC_BACKOFF_S[0]
            if self.capacity and self.bytes > self.capacity:
                self._wake.set()
            return
        self.index.skip_spill(b)  # evictable without files; retried later if still in DRAM
        transient = op.status in (-errno.ENOSPC, Status.WORKER_DIED)
        attempts = self._retry.get(b.key, 0) + (0 if transient else 1)
        if attempts < MAX_SPILL_ATTEMPTS:
            self._remember_retry(b.key, attempts)
            if op.status == Status.WORKER_DIED:
                self._resume = True  # not a storage problem: retry on the next round
        else:
            self._retry.pop(b.key, None)
            # give up: the ranks we did write are orphans nobody will complete
            for rank in op.written:
                self._unlink_quietly(kvfile.rel_dir(b.ns.fingerprint, b.key), kvfile.file_name(b.key, rank))

    def _remember_retry(self, key: bytes, attempts: int) -> None:
        self._retry[key] = attempts
        self._retry.move_to_end(key)
        while len(self._retry) > MAX_RETRY_BLOCKS:
            self._retry.popitem(last=False)

    def _retry_spills(self) -> None:
        n = 0
        for key in list(self._retry):
            b = self.index.blocks.get(key)
            if b is None or b.state != State.READY or b.on_storage or b.io:
                self._retry.pop(key, None)
                continue
            if self._paused:
                break
            self._start_spill(b)
            n += 1
        if n:
            log.info("retrying the spill of %d block(s)", n)

    def _on_enospc(self, path: str) -> None:
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

    def _set_paused(self) -> None:
        paused = self._low_space or time.monotonic() < self._enospc_until
        if paused and not self._paused:
            # Queued spills would only fail: they end now as failed (retried on resume). A
            # block with a rank still in flight finishes when that job completes.
            queued, self._spill_q = self._spill_q, deque()
            for job in queued:
                op = job.op
                op.status = op.status or -errno.ENOSPC
                op.remaining -= 1
                if op.remaining == 0:
                    self._finish_spill(op)
        elif self._paused and not paused:
            self._resume = True
            self.doorbell.ring()
        self._paused = paused
        self.g[G.STORAGE_SPILL_PAUSED] = int(paused)

    # ================================================================ promotes
    def _finish_promote(self, op: _BlockOp) -> None:
        b = op.block
        key = b.key
        ok = op.status == 0
        self._promoting.pop(key, None)
        self.index.finish_promote(key, ok)
        if ok:
            self._touch(key)
        elif op.status in (Status.CORRUPT, -errno.ENOENT):
            self._forget(key)  # the file is gone or quarantined: the index forgets it
        loaded = 0
        for call, row in op.waiters:
            if ok and not call.done and call.client.alive:
                call.rows[row] = self.index.pin(b.ns, [key], owner=call.client.cid)[0]
                loaded += 1
            call.outstanding -= 1
            if call.outstanding == 0 and not call.done:
                self._finish_call(call)
        b.ns.counters[NsCounter.LOADS_STORAGE] += loaded

    def _finish_call(self, call: PromoteCall) -> None:
        call.done = True
        if call.client.alive:
            self._answer(call.client, call.seq, call.rows)

    # ================================================================ dispatch
    def _dispatch(self) -> None:
        """Push queued jobs to the least busy live workers, promotes first."""
        live = [link for link in self.links if not link.dead]
        if not live:
            return
        for q, spill in ((self._promote_q, False), (self._spill_q, True)):
            while q:
                job = q[0]
                b = job.op.block
                room = [
                    lk
                    for lk in live
                    if len(lk.inflight) < MAX_INFLIGHT_PER_WORKER
                    and not (spill and lk.spills >= MAX_SPILLS_PER_WORKER)
                ]
                if not spill and self.read_inflight:
                    readers = [lk for lk in live if len(lk.inflight) > lk.spills]
                    if len(readers) >= max(1, self.read_inflight // b.ns.shard_bytes):
                        room = [lk for lk in room if lk in readers]  # no further reader
                if not room:
                    break
                link = min(room, key=lambda lk: len(lk.inflight))
                assert b.slots is not None, "an IO job's block keeps its slots until the job ends"
                self._seq += 1
                flags, args = P.io_job(
                    self._ns_raw[b.ns.ns_id],
                    b.key,
                    job.rank,
                    b.ns.world_size,
                    b.slots[job.rank],
                    b.ns.shard_bytes,
                )
                try:
                    pushed = link.req.try_push(job.op.kind, self._seq, *args, flags=flags)
                except RingError as exc:
                    log.error("IO worker %s request ring failed: %s", link.worker.base, exc)
                    pushed = False
                if not pushed:
                    return  # ring full (a stuck worker): try again on the next wake-up
                q.popleft()
                link.inflight[self._seq] = job
                link.spills += spill

    # ================================================================ catalog
    def _touch(self, key: bytes) -> None:
        if key in self._lru:
            self._lru.move_to_end(key)

    def _add_known(self, ns: Namespace, key: bytes, recent: bool) -> None:
        known = self._lru.get(key)
        if known is not None:
            if recent and known is ns:
                self._lru.move_to_end(key)
            return
        if self.index.add_stored(ns, key) is None:
            return  # the key is another namespace's block: these files are not a hit
        self._lru[key] = ns
        if not recent:
            self._lru.move_to_end(key, last=False)  # found on disk: older than anything used here
        self.files += ns.world_size
        self.bytes += ns.world_size * kvfile.file_size(ns.shard_bytes)

    def _forget(self, key: bytes) -> None:
        ns = self._lru.pop(key, None)
        if ns is not None:
            self.files -= ns.world_size
            self.bytes -= ns.world_size * kvfile.file_size(ns.shard_bytes)
        self.index.forget_storage(key)

    def _stat_block(self, ns: Namespace, key: bytes) -> bool:
        """Are all ranks' files of ``key`` on storage? If so the index learns it (STORED)."""
        if key in self._deleting or key in self.index.blocks:
            return False
        want = kvfile.file_size(ns.shard_bytes)
        rel = kvfile.rel_dir(ns.fingerprint, key)
        for rank in range(ns.world_size):
            name = kvfile.file_name(key, rank)
            try:
                if not _is_kv_file(self.tree.stat(rel, name), want):
                    return False
            except FileNotFoundError:
                return False
            except OSError as exc:
                self._io_error("stat", exc.errno or errno.EIO, self.tree.rel_path(rel, name))
                return False
        self._add_known(ns, key, recent=True)
        return True

    def _publish(self) -> None:
        self.g[G.STORAGE_FILES] = self.files
        self.g[G.STORAGE_BYTES] = self.bytes

    # ================================================================ scan (one thread per namespace)
    def _scan(self, ns: Namespace) -> None:
        top = ns.fingerprint
        t0 = time.monotonic()
        found = files = 0
        host = kvfile.this_host()
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
        except OSError as exc:
            self._io_error("scan", exc.errno or errno.EIO, self.tree.rel_path(top))
        finally:
            self.scan_done[ns.ns_id] = True
            self.catalog_dirty = True
        log.info(
            "scan of namespace %d (%s): %d complete block(s) from %d file(s) in %.2fs",
            ns.ns_id,
            ns.fingerprint[:12],
            found,
            files,
            time.monotonic() - t0,
        )
        if self.capacity and self.bytes > self.capacity:
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
        """Make scanned blocks known (storage hits), in batches under the lock; None if the
        namespace was released meanwhile."""
        found = 0
        for i in range(0, len(complete), SCAN_BATCH):
            with self.lock:
                if ns.released:
                    return None
                for k in complete[i : i + SCAN_BATCH]:
                    if k in self._lru or k in self._deleting:
                        continue
                    b = self.index.blocks.get(k)
                    if b is not None and b.state == State.PROMOTING:
                        continue
                    self._add_known(ns, k, recent=False)
                    found += 1
                self._publish()
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

    # ================================================================ maintenance thread
    def _maintenance_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(MAINT_INTERVAL_S)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._check_free_space()
                self._evict_over_capacity()
                if time.monotonic() - self._quarantine_checked > QUARANTINE_CHECK_S:
                    self._clean_quarantine()
            except Exception:  # noqa: BLE001 - maintenance must keep running
                log.exception("storage maintenance step failed")

    def _check_free_space(self) -> None:
        try:
            st = os.statvfs(self.tree.root_fd)
        except OSError as exc:
            with self.lock:
                self._io_error("statvfs", exc.errno or errno.EIO, self.root)
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

    def _evict_over_capacity(self) -> None:
        if not self.capacity:
            return
        victims: list[tuple[Namespace, bytes]] = []
        with self.lock:
            skipped: list[tuple[bytes, Namespace]] = []
            while self.bytes > self.capacity and self._lru:
                key, ns = next(iter(self._lru.items()))
                b = self.index.blocks.get(key)
                if b is not None and (b.state == State.PROMOTING or b.io):
                    self._lru.popitem(last=False)  # in use: keep it, look further
                    skipped.append((key, ns))
                    continue
                self._forget(key)
                self._deleting.add(key)
                victims.append((ns, key))
            for key, ns in reversed(skipped):
                self._lru[key] = ns
                self._lru.move_to_end(key, last=False)
            self._publish()
        if not victims:
            return
        removed = 0
        for ns, key in victims:
            rel = kvfile.rel_dir(ns.fingerprint, key)
            for rank in range(ns.world_size):
                if self._unlink_quietly(rel, kvfile.file_name(key, rank)):
                    removed += 1
        with self.lock:
            self._deleting.difference_update(k for _, k in victims)
            self.g[G.STORAGE_EVICTED_FILES] += removed
        log.debug("capacity limit: evicted %d block(s), %d file(s)", len(victims), removed)

    def _clean_quarantine(self) -> None:
        """Keep the quarantine bounded: the newest QUARANTINE_MAX_FILES files, none older
        than QUARANTINE_MAX_AGE_S (maintenance thread, no lock needed)."""
        self._quarantine_checked = time.monotonic()
        qdir = kvfile.QUARANTINE_DIR
        entries = []
        with self.tree.entries(qdir) as found:
            for e in found:
                with _suppress_os():
                    if e.is_file(follow_symlinks=False) or e.is_symlink():
                        entries.append((e.stat(follow_symlinks=False).st_mtime, e.name))
        entries.sort(reverse=True)
        now = time.time()
        doomed = [
            p
            for i, (mtime, p) in enumerate(entries)
            if i >= QUARANTINE_MAX_FILES or now - mtime > QUARANTINE_MAX_AGE_S
        ]
        removed = sum(self._unlink_quietly(qdir, p) for p in doomed)
        if removed:
            log.info(
                "quarantine %s: removed %d old corrupt file(s) (keeps the newest %d, none older "
                "than %d days)",
                self.tree.rel_path(qdir),
                removed,
                QUARANTINE_MAX_FILES,
                QUARANTINE_MAX_AGE_S // 86400,
            )

    def _unlink_quietly(self, rel: str, name: str) -> bool:
        try:
            self.tree.unlink(rel, name)
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            self._io_error("unlink", exc.errno or errno.EIO, self.tree.rel_path(rel, name))
            return False

    def _subdirs(self, rel: str) -> list[str]:
        """The two-character subdirectories of ``rel`` (symlinks are not directories here)."""
        with self.tree.entries(rel) as entries:
            return [
                f"{rel}/{e.name}" for e in entries if len(e.name) == 2 and e.is_dir(follow_symlinks=False)
            ]


class _suppress_os:
    def __enter__(self) -> None:
        return None

    def __exit__(self, typ, exc, tb) -> bool:
        return typ is not None and issubclass(typ, OSError)


def _is_kv_file(st: os.stat_result, size: int) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_size == size

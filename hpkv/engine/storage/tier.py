"""The file tier: KV blocks in files under ``HPKV_STORAGE_PATH``, the first implementation
of the tier contract (:class:`hpkv.engine.tiers.LowerTier`).

This module is the facade the server talks to (spill, promote, lookup, poll, attach,
detach, describe); the parts live beside it, one concern each:

* :mod:`~hpkv.engine.storage.catalog`: which blocks have files (the one owner of that
  fact; the index asks it), in LRU order for the capacity limit;
* :mod:`~hpkv.engine.storage.links`: the IO workers' rings, job queues and dispatch, and
  the recovery of a dead worker's jobs; completions come back as values;
* :mod:`~hpkv.engine.storage.scan`: the scan of a namespace's directory at attach and
  the stat of one block on a lookup miss;
* :mod:`~hpkv.engine.storage.upkeep`: the maintenance thread: free space, the spill pause
  after ENOSPC, the quarantine;
* :mod:`~hpkv.engine.storage.shared`: the journals through which servers sharing the
  directory find each other's files, and the one evictor per directory that keeps it under
  the capacity limit.

Threads: everything here runs under the server's one lock. The *request loop* issues
every IO job and consumes every completion (:meth:`FileTier.poll`); nothing waits for
IO: a PROMOTE is parked and its answer returned by a later poll, when its jobs complete
or its deadline passes. The *supervisor* only flags a dead IO worker; the request loop
fails the jobs it had taken, removes its temporary file and restarts it.

Write-through: a block that becomes READY is spilled once per rank unless it already has
files; it stays unevictable while the spill runs. While spilling is paused (low free
space, ENOSPC) READY blocks are evictable without files and are remembered for a retry
when spilling resumes. Reads keep working throughout.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np

from hpkv.config import Config
from hpkv.engine.index import Block, Index, Namespace
from hpkv.engine.storage.catalog import FileCatalog
from hpkv.engine.storage.journal import node_id
from hpkv.engine.storage.links import BlockOp, Completion, IoLinks
from hpkv.engine.storage.probe import DirectIoProbe, probe_o_direct, virtio_disk
from hpkv.engine.storage.scan import Scanner, stat_block
from hpkv.engine.storage.shared import SharedDir
from hpkv.engine.storage.upkeep import IoErrorLog, Upkeep, unlink_quietly
from hpkv.engine.tiers import Client, ParkedPromote, Presence, PromoteAnswer
from hpkv.engine.workers import WorkerProcess
from hpkv.io_workers import kvfile
from hpkv.io_workers.tree import StorageTree
from hpkv.protocol import wire as P
from hpkv.protocol.errors import Status, status_message
from hpkv.protocol.stats import G, NsCounter, StatsSegment
from hpkv.ring import Doorbell

log = logging.getLogger("hpkv.storage")

# On a virtio-blk disk two 4 MiB O_DIRECT reads at once took 7.2 ms each, one alone 2.5 ms
# (the dev VM, IO worker traces): files that large are read by one worker at a time.
VIRTIO_READ_INFLIGHT = 4 << 20
MAX_SPILL_ATTEMPTS = 3  # for errors other than ENOSPC / a dead worker
MAX_RETRY_BLOCKS = 100_000


class FileTier:
    """The file tier as the server drives it (see the module docstring)."""

    name = "storage"

    def __init__(
        self,
        cfg: Config,
        server_dir: str,
        stats: StatsSegment,
        index: Index,
        lock: threading.RLock,
        doorbell: Doorbell,
        pool_path: str,
        links: IoLinks | None = None,
    ):
        self.cfg = cfg
        self.root: str = cfg.storage_path  # type: ignore[assignment]
        self.dir = server_dir
        self.g = stats.glob
        self.index = index
        self.lock = lock
        self.doorbell = doorbell
        self.pool_path = pool_path
        self.capacity = int(cfg["HPKV_KV_STORAGE_SIZE"])
        self.min_free_pct = float(cfg["HPKV_STORAGE_MIN_FREE"])
        self.probe: DirectIoProbe | None = None
        self.bounce_reads = False
        self.o_direct_reason: str | None = None
        self.catalog = FileCatalog(index)
        self.errors = IoErrorLog(self.g)
        self.links = links if links is not None else IoLinks(stats, doorbell)
        # opened by start(); every path goes through the tree
        self.tree: StorageTree
        self.upkeep: Upkeep
        self.scanner: Scanner
        self.shared: SharedDir
        self._promoting: dict[bytes, BlockOp] = {}  # key -> its promote's op
        self._calls: list[ParkedPromote] = []
        self._answers: list[PromoteAnswer] = []  # finished calls, returned by the next poll
        self._retry: OrderedDict[bytes, int] = OrderedDict()  # key -> failed spill attempts
        self._ns_raw: dict[int, bytes] = {}
        self._catalog_dirty = False

    # ================================================================ life cycle
    def start(self, slots: list[int], maintenance: bool = True) -> list[WorkerProcess]:
        """Probe O_DIRECT, start the IO workers (one per stats row in ``slots``, see
        ``HPKV_NUM_IO_WORKERS``) and the maintenance thread; returns the workers."""
        # KV files hold prompts: the root must be this user's and closed to writers (0700 when
        # hpkv creates it), and no other user may rename it away (its ancestors are checked);
        # everything under it is created 0700 / 0600 and opened relative to the root's
        # descriptor, which the IO workers check they share (device, inode).
        self.tree = StorageTree.open(self.root)
        with self.tree.dir(kvfile.QUARANTINE_DIR, create=True):
            pass
        self.upkeep = Upkeep(
            self.root,
            self.tree,
            self.lock,
            self.g,
            self.doorbell,
            self.errors,
            self.min_free_pct,
        )
        self.shared = SharedDir(
            self.tree,
            self.catalog,
            self.lock,
            self.g,
            self.errors,
            node_id(self.pool_path),
            self.capacity,
            evictor=self.cfg["HPKV_STORAGE_EVICTOR"],
            poll_s=float(self.cfg["HPKV_STORAGE_JOURNAL_POLL"]),
            grace_s=float(self.cfg["HPKV_STORAGE_READ_GRACE"]),
            lease_s=float(self.cfg["HPKV_STORAGE_EVICTOR_LEASE"]),
            in_use=lambda key: key in self._promoting or self.index.in_io(key),
        )
        self.scanner = Scanner(
            self.tree,
            self.catalog,
            self.lock,
            self.g,
            self.errors.io_error,
            skip=lambda key: key in self._promoting,
            wake=self.upkeep.wake,
            shared=self.shared,
        )
        self.upkeep.clean_quarantine()
        self.probe = probe_o_direct(self.root, dir_fd=self.tree.root_fd)
        self.o_direct_reason = self.probe.reason
        (log.info if self.probe.ok else log.warning)("%s", self.probe.describe(self.root))
        self.g[G.STORAGE_O_DIRECT] = int(self.probe.ok)
        self.g[G.STORAGE_CAPACITY] = self.capacity
        self.upkeep.check_free_space()
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
        self.links.read_inflight = int(
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
        workers = self.links.start(self.dir, slots, spec)
        if maintenance:
            self.upkeep.start()
            self.shared.start()
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
        self.upkeep.stop()
        self.scanner.stop()
        self.shared.stop()
        self.links.close()

    def describe(self) -> dict[str, Any]:
        """The strings of the stats snapshot's ``storage`` section (the numbers are in G)."""
        return {
            "path": self.root,
            "o_direct_reason": self.o_direct_reason,
            "fs_type": self.probe.fs_type if self.probe else None,
            "read_bounce": self.bounce_reads,
            "scans_done": sorted(k for k, v in self.scanner.done.items() if v),
        }

    def take_catalog_dirty(self) -> bool:
        dirty = self._catalog_dirty or self.scanner.finished
        self._catalog_dirty = self.scanner.finished = False
        return dirty

    def worker_died(self, worker: Any) -> bool:
        """Supervisor: an IO worker exited. The request loop recovers its jobs and restarts it."""
        return self.links.worker_died(worker)

    # ================================================================ namespaces
    def attach(self, ns: Namespace) -> None:
        """Start learning the namespace's files: a background scan (stat on miss covers the rest)."""
        self._ns_raw[ns.ns_id] = kvfile.fingerprint_bytes(ns.fingerprint)
        self.scanner.start(ns)

    def detach(self, ns: Namespace) -> None:
        """The server released ``ns`` (its id will be reused): stop its scan and forget its
        catalog entries (the files stay; a later attach scans them again)."""
        ns.released = True
        self._ns_raw.pop(ns.ns_id, None)
        self.scanner.forget(ns)
        self.shared.detach(ns)
        self.catalog.detach(ns)
        self.catalog.publish(self.g)

    # ================================================================ hot path (request loop, lock held)
    def lookup(self, ns: Namespace, keys: list[bytes], hit: int, tiers: list[int]) -> Presence:
        """Cut the prefix at the first storage hit whose files are gone (deleted from outside),
        then continue it past keys nobody knew but whose files exist (the scan is not there
        yet, or another server wrote them)."""
        if P.Tier.STORAGE in tiers:
            hit = self._verify(ns, keys, hit, tiers)
        while hit < len(keys) and self._stat_unknown(ns, keys[hit]):
            more, more_tiers = self.index.lookup(ns.ns_id, keys[hit:])
            if not more:  # its files exist but the index did not take it (another namespace's key)
                break
            tiers.extend(more_tiers)
            hit += more
        return Presence(hit)

    def _verify(self, ns: Namespace, keys: list[bytes], hit: int, tiers: list[int]) -> int:
        """The catalog forgets a storage hit whose files are gone, so no load is promised that
        a promote cannot keep. Each block is stat-ed at most every VERIFY_TTL_S."""
        now = time.monotonic()
        for i in range(hit):
            if tiers[i] != P.Tier.STORAGE or not self.catalog.needs_verify(ns, keys[i], now):
                continue
            try:
                there = stat_block(self.tree, ns, keys[i])
            except OSError:
                there = True  # an IO error is not proof it is gone: the promote will tell
            if there:
                self.catalog.verified(keys[i], now)
                continue
            self.catalog.forget(keys[i])
            del tiers[i:]
            return i
        return hit

    def _stat_unknown(self, ns: Namespace, key: bytes) -> bool:
        """Does a key nobody knows have all its files? If so the catalog learns it."""
        if not self.catalog.unknown(key):
            return False
        try:
            there = stat_block(self.tree, ns, key)
        except OSError as exc:
            self.errors.io_error("stat", exc.errno or errno.EIO, str(exc.filename))
            return False
        if there:
            self.catalog.add(ns, key, recent=True)
        return there

    def spill(self, blocks: Iterable[Block]) -> None:
        """Write-through of blocks that just became READY."""
        for b in blocks:
            if b.key in self.catalog:
                self.catalog.touch(b.key)
                continue
            if self.upkeep.paused:
                self.index.skip_spill(b)
                self._remember_retry(b.key, 0)
                continue
            self._start_spill(b)
        self._dispatch()

    def pending_spills(self) -> int:
        """Blocks whose write-through is queued or running (what a stop drains first)."""
        return self.links.spills_pending() + (len(self._retry) if self.upkeep.resume_pending() else 0)

    def touch(self, keys: Iterable[bytes]) -> None:
        """The blocks were used (pinned for loading): their files are recent too."""
        for k in keys:
            self.catalog.touch(k)
            ns = self.catalog.owner(k)
            if ns is not None:
                self.shared.used(ns, k)  # the evictor orders by use on every node

    def promote(
        self, client: Client, seq: int, ns: Namespace, keys: list[bytes], timeout: float
    ) -> np.ndarray | None:
        """A PROMOTE hot call: rows of pinned pool offsets, now (no IO needed) or None (parked)."""
        world = ns.world_size
        rows = np.full((len(keys), world), -1, np.int64)
        call = ParkedPromote(client, seq, ns, keys, rows, time.monotonic() + timeout)
        idx = self.index
        dram = 0
        for i, k in enumerate(keys):
            slots = idx.pin(ns, [k], owner=client.cid)[0]
            running = self._promoting.get(k)
            if slots is not None:
                rows[i] = slots
                dram += 1
                self.catalog.touch(k)
            elif running is not None:
                if running.block.ns is ns:
                    running.waiters.append((call, i))
                    call.outstanding += 1
            elif self.catalog.owner(k) is ns or self._stat_unknown(ns, k):
                b = idx.begin_promote(ns, k)
                if b is None:
                    continue  # reserved (being written), or the pool is full of pinned blocks
                op = BlockOp(P.PROMOTE, b)
                op.waiters.append((call, i))
                self._promoting[k] = op
                call.outstanding += 1
                self.links.promote_q.extend(op.jobs())
        ns.counters[NsCounter.LOADS_DRAM] += dram
        if call.outstanding == 0:
            return rows
        self._calls.append(call)
        self._dispatch()
        return None

    def client_gone(self, client: Client) -> None:
        """Forget a dropped client's parked call (its pins are released by the server)."""
        for call in self._calls:
            if call.client is client:
                call.done = True
        self._calls = [call for call in self._calls if not call.done]

    # ================================================================ request loop: completions
    def poll(self) -> list[PromoteAnswer]:
        """Consume completions, recover dead workers, issue queued jobs; returns the answers of
        parked promotes that finished or reached their deadline."""
        with self.lock:
            completions = self.links.collect()
            if self.links.restarted:
                self.links.restarted = False
                self._catalog_dirty = True
            for done in completions:
                self._complete(done)
            if self.upkeep.take_pause_began():
                self._end_queued_spills()
            if self.upkeep.take_resumed():
                self._retry_spills()
            self._dispatch()
            self.g[G.STORAGE_SPILLS_PENDING] = self.links.spill_jobs()
            if self._calls:
                now = time.monotonic()
                for call in self._calls:
                    if not call.done and now >= call.deadline:
                        self.errors.log(
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
            self.catalog.publish(self.g)
            answers, self._answers = self._answers, []
        return answers

    def _dispatch(self) -> None:
        self.links.dispatch(self._ns_raw, spills=not self.upkeep.paused)

    def _complete(self, done: Completion) -> None:
        op, rank, status, flags = done.job.op, done.job.rank, done.status, done.flags
        g = self.g
        if done.dead_pid and op.kind == P.SPILL:  # its temporary file is nobody's now
            b = op.block
            name = kvfile.tmp_name(kvfile.file_name(b.key, rank), pid=done.dead_pid)
            unlink_quietly(self.tree, self.errors, kvfile.rel_dir(b.ns.fingerprint, b.key), name)
        if flags & P.IO_DIRECT_FALLBACK and g[G.STORAGE_O_DIRECT]:
            g[G.STORAGE_O_DIRECT] = 0
            g[G.STORAGE_IO_ERRORS] += 1
            self.o_direct_reason = f"EINVAL on {self.probe.fs_type if self.probe else '?'} (at run time)"
            self._catalog_dirty = True
            log.warning("O_DIRECT refused at run time on %s: IO workers fall back to buffered IO", self.root)
        if status == 0:
            if op.kind == P.SPILL:
                if not flags & P.IO_EXISTED:
                    g[G.STORAGE_BYTES_WRITTEN] += done.nbytes
                    g[G.STORAGE_SPILLS] += 1
                    op.written.append(rank)
            else:
                g[G.STORAGE_BYTES_READ] += done.nbytes
                g[G.STORAGE_PROMOTES] += 1
        else:
            op.status = op.status or status
            self._count_failure(op, rank, status)
        op.remaining -= 1
        if op.remaining == 0:
            if op.kind == P.SPILL:
                self._finish_spill(op)
            else:
                self._finish_promote(op)

    def _count_failure(self, op: BlockOp, rank: int, status: int) -> None:
        b = op.block
        path = kvfile.file_path(self.root, b.ns.fingerprint, b.key, rank)
        g = self.g
        if status == Status.CORRUPT:
            g[G.STORAGE_IO_ERRORS] += 1
            g[G.STORAGE_QUARANTINED] += 1  # the worker logged why and where it went
        elif status == -errno.ENOSPC and op.kind == P.SPILL:
            g[G.STORAGE_IO_ERRORS] += 1
            self.upkeep.on_enospc(path)
        elif status == Status.WORKER_DIED:
            g[G.STORAGE_IO_ERRORS] += 1  # logged once by the recovery
        else:
            what = "spill" if op.kind == P.SPILL else "promote"
            err = -status if status < 0 and -status < 1000 else errno.EIO
            self.errors.io_error(what, err, path, status_message(status))

    # ================================================================ spills
    def _start_spill(self, b: Block) -> None:
        self.index.spill_started(b)
        self.links.spill_q.extend(BlockOp(P.SPILL, b).jobs())

    def _end_queued_spills(self) -> None:
        """Spilling paused: queued spills would only fail, so they end now as failed (retried
        on resume). A block with a rank still in flight finishes when that job completes."""
        for job in self.links.take_queued_spills():
            op = job.op
            op.status = op.status or -errno.ENOSPC
            op.remaining -= 1
            if op.remaining == 0:
                self._finish_spill(op)

    def _finish_spill(self, op: BlockOp) -> None:
        b = op.block
        self.index.set_io(b, -1)
        if op.status == 0:
            self._retry.pop(b.key, None)
            self.catalog.add(b.ns, b.key, recent=True)
            self.shared.added(b.ns, b.key)  # other nodes find it in this node's journal
            self.upkeep.spill_succeeded()
            return
        self.index.skip_spill(b)  # evictable without files; retried later if still in DRAM
        transient = op.status in (-errno.ENOSPC, Status.WORKER_DIED)
        attempts = self._retry.get(b.key, 0) + (0 if transient else 1)
        if attempts < MAX_SPILL_ATTEMPTS:
            self._remember_retry(b.key, attempts)
            if op.status == Status.WORKER_DIED:
                self.upkeep.retry_soon()  # not a storage problem: retry on the next round
        else:
            self._retry.pop(b.key, None)
            # give up: the ranks we did write are orphans nobody will complete
            rel = kvfile.rel_dir(b.ns.fingerprint, b.key)
            for rank in op.written:
                unlink_quietly(self.tree, self.errors, rel, kvfile.file_name(b.key, rank))

    def _remember_retry(self, key: bytes, attempts: int) -> None:
        self._retry[key] = attempts
        self._retry.move_to_end(key)
        while len(self._retry) > MAX_RETRY_BLOCKS:
            self._retry.popitem(last=False)

    def _retry_spills(self) -> None:
        n = 0
        for key in list(self._retry):
            b = self.index.spillable(key)
            if b is None or key in self.catalog:
                self._retry.pop(key, None)
                continue
            if self.upkeep.paused:
                break
            self._start_spill(b)
            n += 1
        if n:
            log.info("retrying the spill of %d block(s)", n)

    # ================================================================ promotes
    def _finish_promote(self, op: BlockOp) -> None:
        b = op.block
        key = b.key
        ok = op.status == 0
        self._promoting.pop(key, None)
        self.index.finish_promote(key, ok)
        if ok:
            self.catalog.touch(key)
            self.shared.used(b.ns, key)
        elif op.status in (Status.CORRUPT, -errno.ENOENT):
            self.catalog.forget(key)  # the file is gone or quarantined
        loaded = 0
        for call, row in op.waiters:
            if ok and not call.done and call.client.alive:
                call.rows[row] = self.index.pin(b.ns, [key], owner=call.client.cid)[0]
                loaded += 1
            call.outstanding -= 1
            if call.outstanding == 0 and not call.done:
                self._finish_call(call)
        b.ns.counters[NsCounter.LOADS_STORAGE] += loaded

    def _finish_call(self, call: ParkedPromote) -> None:
        call.done = True
        if call.client.alive:
            self._answers.append(PromoteAnswer(call.client, call.seq, call.rows))

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
from hpkv.engine.index import Block, Index, Namespace, State
from hpkv.engine.storage.catalog import FileCatalog
from hpkv.engine.storage.health import Health
from hpkv.engine.storage.journal import node_id
from hpkv.engine.storage.links import BlockOp, Completion, IoLinks
from hpkv.engine.storage.probe import DirectIoProbe, probe_o_direct, virtio_disk
from hpkv.engine.storage.scan import Scanner
from hpkv.engine.storage.shared import SharedDir
from hpkv.engine.storage.stat import GONE, THERE, StatBatch, StatPool
from hpkv.engine.storage.upkeep import IoErrorLog, Upkeep, unlink_quietly
from hpkv.engine.tiers import (
    CatalogTier,
    Client,
    ParkedLookup,
    ParkedPromote,
    Presence,
    PromoteAnswer,
    settle_waiters,
)
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
MAX_STAT_KEYS = 256  # unknown keys after a lookup's prefix checked by one stat batch
MAX_UNADMITTED = 1 << 20  # blocks remembered waiting for HPKV_STORAGE_ADMIT's reuse (~100 MB at most)
NEGATIVE_TTL_S = 1.0  # a key whose files a stat found missing is not stat-ed again for this long
MAX_NEGATIVE = 65_536  # keys remembered missing (the oldest are forgotten first)
# A key whose files a promote found gone is checked by opening them, not by a stat, for this
# long: a caching mount (NFS's attribute cache, up to 60 s by default; a FUSE attr_timeout)
# may still show deleted files to a stat, and a lookup would bring the key back.
REOPEN_TTL_S = 300.0
MAX_WAITERS = 64  # parked lookups on one stat batch before those answered already are dropped
SPILL_QUEUE_SHARE = 4  # degraded: queued spills hold at most 1/this of the pool (beyond: dropped)
SLOW_STAT_S = 1.0  # a stat outstanding this long marks the tier degraded
GONE_STATUSES = (-errno.ENOENT, -errno.ESTALE)  # a promote's file vanished: gone, not an error
SLOW_IO_S = 5.0  # an IO job (spill or promote) outstanding this long marks the tier degraded


class ExpiringKeys:
    """Keys remembered for ``ttl_s`` after they were added, at most ``limit`` of them (the
    oldest are forgotten first). Request loop only."""

    def __init__(self, ttl_s: float, limit: int = MAX_NEGATIVE):
        self.ttl_s = ttl_s
        self.limit = limit
        self._until: OrderedDict[bytes, float] = OrderedDict()  # in adding order = expiry order

    def add(self, key: bytes, now: float) -> None:
        self._until[key] = now + self.ttl_s
        self._until.move_to_end(key)
        while len(self._until) > self.limit:
            self._until.popitem(last=False)

    def has(self, key: bytes, now: float) -> bool:
        until = self._until.get(key)
        if until is None:
            return False
        if until > now:
            return True
        del self._until[key]
        return False

    def prune(self, now: float) -> None:
        """Drop the expired ones (oldest first) rather than keep them until asked about."""
        until = self._until
        while until and next(iter(until.values())) <= now:
            until.popitem(last=False)


class FileTier(CatalogTier):
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
        # lookups' stats (off the request loop): see lookup() and hpkv.engine.storage.stat
        self.lookup_wait = float(cfg["HPKV_STORAGE_LOOKUP_WAIT_MS"]) / 1000.0
        self.stats_pool: StatPool
        self._checking: dict[bytes, StatBatch] = {}  # key -> the batch stat-ing it
        self._waiters: dict[int, list[ParkedLookup]] = {}  # id(batch) -> lookups waiting for it
        self._missing = ExpiringKeys(NEGATIVE_TTL_S)  # keys a stat found missing
        self._gone_lately = ExpiringKeys(REOPEN_TTL_S)  # keys a promote found gone
        self._spill_limit = max(index.alloc.capacity // SPILL_QUEUE_SHARE, 1)  # bytes of queued spills
        # HPKV_STORAGE_ADMIT=reuse:N (0: always): blocks saved but not yet hit N times from DRAM
        self.admit_uses = int(cfg["HPKV_STORAGE_ADMIT"])
        self._unadmitted: OrderedDict[bytes, int] = OrderedDict()  # key -> DRAM hits so far
        self.health = Health(self.g)

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
            skip=lambda key: key in self._promoting or self._gone_lately.has(key, time.monotonic()),
            wake=self.upkeep.wake,
            shared=self.shared,
        )
        self.stats_pool = StatPool(self.tree, self.doorbell)
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
            "storage tier %s: %d IO worker(s), capacity %s, spilling pauses under %g%% free, %s",
            self.root,
            len(workers),
            self.capacity or "unlimited",
            self.min_free_pct,
            f"a block is written at its {self.admit_uses}. DRAM hit (HPKV_STORAGE_ADMIT=reuse:{self.admit_uses})"
            if self.admit_uses
            else "every saved block is written (HPKV_STORAGE_ADMIT=always)",
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
        self.stats_pool.shutdown()
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
            **self.health.describe(),
        }

    @property
    def degraded(self) -> bool:
        return self.health.degraded

    def take_catalog_dirty(self) -> bool:
        dirty = self._catalog_dirty or self.scanner.finished or self.health.take_changed()
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
    def lookup(
        self,
        ns: Namespace,
        keys: list[bytes],
        hit: int,
        tiers: list[int],
        call: ParkedLookup | None = None,
    ) -> Presence:
        """Cut the prefix at the first storage hit whose files are gone (deleted from outside),
        then continue it past keys nobody knew but whose files exist (the scan is not there
        yet, or another server wrote them). The stats run on the stat threads: with ``call``
        the lookup is parked until they end (at most ``HPKV_STORAGE_LOOKUP_WAIT_MS``); without
        it, or when the stat threads are saturated, a key not confirmed is a miss now."""
        if self.health.degraded:  # no load promised that the mount would not keep: all misses
            if self.stats_pool.saturated and self._to_discover(keys, hit):
                self.g[G.STORAGE_STAT_SATURATED] += 1  # a stat was due and no thread is free
            return self._cut_at_storage(tiers, hit)
        now = time.monotonic()
        due = [i for i in self.catalog.to_verify(ns, keys[:hit], now) if tiers[i] == P.Tier.STORAGE]
        verify = [keys[i] for i in due]
        extend = self._to_discover(keys, hit)
        if not verify and not extend:
            return Presence(hit)
        if call is not None:
            if self._park_on_checks(ns, verify, extend, call, now):
                return Presence(hit, True)
        else:
            self._check(ns, verify, extend)  # for the next lookup, if the threads have room
        # Answer now: a hit due for a check that is not done is a miss for this lookup.
        if due:  # checks were sent, not answered: the first one cuts the prefix
            hit = due[0]
            del tiers[hit:]
        # Without ``call`` (a parked lookup answered at its bound): the key after the prefix
        # still being checked is unconfirmed, not missing; the engine may ask again.
        unconfirmed = call is None and hit < len(keys) and keys[hit] in self._checking
        if unconfirmed:
            self.g[G.STORAGE_LOOKUPS_BOUNDED] += 1
        return Presence(hit, unconfirmed)

    def learning(self, ns: Namespace) -> bool:
        """The namespace's journals are still read (or its directory scanned), and the mount
        answers: a key nobody knows may be a file the catalog has not reached yet."""
        return not self.health.degraded and not self.scanner.done.get(ns.ns_id, True)

    def discover(self, ns: Namespace, keys: list[bytes], call: ParkedLookup | None = None) -> bool:
        """Keys a FLAG_EACH lookup found nowhere past its leading prefix, while the namespace's
        files are still being learned (its journals read or its directory scanned after a
        restart): they may be files the catalog has not reached yet, so they are stat-ed as
        the prefix's unknown keys are (at most MAX_STAT_KEYS a lookup). Once the namespace is
        learned such keys are misses without a stat (the sliding-window rule). True while a
        check of them is due: ``call`` parked on it (or, when the stat threads are saturated,
        answered at once), and without ``call`` the answer is unconfirmed: the engine asks
        again rather than take these keys as misses."""
        if not self.learning(ns):
            return False
        now = time.monotonic()
        todo = [k for k in keys if self.catalog.unknown(k) and not self._known_missing(k)][:MAX_STAT_KEYS]
        if not todo:
            return False
        if call is None or not self._park_on_checks(ns, [], [], call, now, each=todo):
            self._check(ns, [], [], each=todo)  # (none when saturated: still unconfirmed)
        return True

    def _park_on_checks(
        self,
        ns: Namespace,
        verify: list[bytes],
        extend: list[bytes],
        call: ParkedLookup,
        now: float,
        each: list[bytes] | None = None,
    ) -> bool:
        """Start (or join) the stats of these keys and park ``call`` on them, its deadline at
        the lookup bound; False (counted) when the stat threads are saturated."""
        batches = self._check(ns, verify, extend, each)
        if not batches:
            self.g[G.STORAGE_STAT_SATURATED] += 1
            return False
        for b in batches:
            waiting = self._waiters.setdefault(id(b), [])
            if len(waiting) >= MAX_WAITERS:  # a stuck batch: drop the calls answered already
                waiting[:] = [c for c in waiting if not c.done]
            waiting.append(call)
        call.outstanding += len(batches)
        call.deadline = max(call.deadline, now + self.lookup_wait)
        return True

    def _cut_at_storage(self, tiers: list[int], hit: int) -> Presence:
        """While degraded: the prefix ends at its first storage block (counted), and nothing
        is stat-ed (the stat threads are stuck, or the IO workers are)."""
        for i in range(hit):
            if tiers[i] == P.Tier.STORAGE:
                self.g[G.STORAGE_DEGRADED_MISSES] += 1
                del tiers[i:]
                return Presence(i)
        return Presence(hit)

    def _to_discover(self, keys: list[bytes], hit: int) -> list[bytes]:
        """The keys after the prefix whose files a stat may find: nobody knows them and no
        stat found them missing within NEGATIVE_TTL_S (the first such key ends the list)."""
        out: list[bytes] = []
        if hit >= len(keys) or not self.catalog.unknown(keys[hit]) or self._known_missing(keys[hit]):
            return out
        for k in keys[hit : hit + MAX_STAT_KEYS]:
            if not self.catalog.unknown(k):
                continue  # in DRAM or known here: a hit of the index by itself
            if self._known_missing(k):
                break
            out.append(k)
        return out

    def _known_missing(self, key: bytes) -> bool:
        return self._missing.has(key, time.monotonic())

    def _check(
        self, ns: Namespace, verify: list[bytes], extend: list[bytes], each: list[bytes] | None = None
    ) -> list[StatBatch]:
        """The stat batches these keys wait on: the ones running for some of them, and one new
        batch for the rest. Empty when a new batch was needed and the pool is saturated."""
        waiting: dict[int, StatBatch] = {}

        def not_running(keys: list[bytes]) -> list[bytes]:
            """The keys no batch is checking; the batches checking the others are waited on."""
            new = []
            for k in keys:
                b = self._checking.get(k)
                if b is not None:
                    waiting[id(b)] = b
                else:
                    new.append(k)
            return new

        new_verify, new_extend, new_each = not_running(verify), not_running(extend), not_running(each or [])
        if new_verify or new_extend or new_each:
            batch = StatBatch(ns, new_verify, new_extend, new_each)
            now = time.monotonic()
            batch.reopen = frozenset(k for k in batch.checked() if self._gone_lately.has(k, now))
            if not self.stats_pool.submit(batch):
                return []
            for k in batch.checked():
                self._checking[k] = batch
            waiting[id(batch)] = batch
        return list(waiting.values())

    def _stats_done(self, now: float) -> None:
        """Apply finished stat batches (request loop, lock held) and take them off the parked
        lookups waiting for them."""
        gone = 0
        for b in self.stats_pool.take():
            for k in b.checked():
                if self._checking.get(k) is b:
                    del self._checking[k]
            for call in self._waiters.pop(id(b), ()):
                call.outstanding -= 1
            for exc in b.errors:
                self.errors.io_error("stat", exc.errno or errno.EIO, str(exc.filename))
            if not b.ns.released:
                gone += self._apply_verify(b)
                self._apply_extend(b, now)
        if gone:
            self._gone(gone, "a lookup's check")

    def _apply_verify(self, b: StatBatch) -> int:
        """Storage hits checked: gone ones leave the catalog (returns how many), the others were
        seen (an error is no proof they are gone)."""
        gone = 0
        for k in b.verify:
            found = b.results.get(k)
            if found is None or self.catalog.owner(k) is not b.ns:
                continue
            if found == GONE and self.index.owner(k) is None and k not in self._promoting:
                self.catalog.forget(k)
                gone += 1
            else:
                self.catalog.verified(k, b.finished)
        return gone

    def _apply_extend(self, b: StatBatch, now: float) -> None:
        """Unknown keys checked: found files join the catalog, missing keys are remembered for
        NEGATIVE_TTL_S. A key a promote found gone comes back only when its files were opened
        (a stat made before that promote, or through a caching mount, may still show them)."""
        self._missing.prune(now)
        self._gone_lately.prune(now)
        for k in b.unknown():
            found = b.results.get(k)
            if found == THERE:
                if k not in b.reopen and self._gone_lately.has(k, now):
                    continue
                if self.catalog.unknown(k) and self.catalog.add(b.ns, k, recent=True):
                    self.catalog.verified(k, b.finished)
            elif found == GONE:
                self._missing.add(k, now)

    def _gone(self, n: int, where: str) -> None:
        """Files of known blocks vanished: another server's capacity eviction or an operator,
        normal on a shared directory. Counted and logged at INFO, never an IO error."""
        self.g[G.STORAGE_GONE] += n
        self.errors.log(
            logging.INFO,
            "gone",
            "%d block(s) whose files another server or an operator removed (found by %s): "
            "forgotten, recomputed when needed",
            n,
            where,
        )

    def spill(self, blocks: Iterable[Block], admitted: bool = False) -> None:
        """Write-through of blocks that just became READY. Spills queued behind a hung mount
        keep their blocks' slots unevictable: while the tier is degraded, new ones beyond a
        quarter of the pool are dropped (counted; the block stays in DRAM, evictable without
        files). A healthy tier queues any burst: the workers drain it. Under
        HPKV_STORAGE_ADMIT=reuse:N a new block waits for its reuse (:meth:`_admit_reused`),
        evictable without files meanwhile, unless ``admitted``."""
        queued = self.links.spill_queue_bytes()
        for b in blocks:
            if b.key in self.catalog:
                self.catalog.touch(b.key)
                continue
            if self.admit_uses and not admitted:
                self.index.skip_spill(b)
                self._unadmitted[b.key] = 0
                self._unadmitted.move_to_end(b.key)
                while len(self._unadmitted) > MAX_UNADMITTED:  # long since evicted, most of them
                    self._unadmitted.popitem(last=False)
                self.g[G.STORAGE_ADMIT_DEFERRED] += 1
                continue
            if self.upkeep.paused:
                self.index.skip_spill(b)
                self._remember_retry(b.key, 0)
                continue
            size = b.ns.world_size * b.ns.shard_bytes
            if self.health.degraded and queued + size > self._spill_limit:
                self.index.skip_spill(b)
                self.g[G.STORAGE_SPILLS_DROPPED] += 1
                self.errors.log(
                    logging.WARNING,
                    "spill-dropped",
                    "storage degraded and %d bytes of writes queued (a quarter of the pool): new "
                    "blocks are not written to storage (counted in spills_dropped) until it recovers",
                    queued,
                )
                continue
            queued += size
            self._start_spill(b)
        self._dispatch()

    def pending_spills(self) -> int:
        """Blocks whose write-through is queued or running (what a stop drains first)."""
        return self.links.spills_pending() + (len(self._retry) if self.upkeep.resume_pending() else 0)

    def touch(self, keys: Iterable[bytes]) -> None:
        """The blocks were used (pinned for loading): their files are recent too."""
        keys = list(keys)
        for k in keys:
            self.catalog.touch(k)
            ns = self.catalog.owner(k)
            if ns is not None:
                self.shared.used(ns, k)  # the evictor orders by use on every node
        self._admit_reused(keys)

    def _admit_reused(self, keys: list[bytes]) -> None:
        """DRAM hits of blocks waiting for admission (HPKV_STORAGE_ADMIT=reuse:N): the N-th
        hit writes the block to storage (if it is still in DRAM, READY and not being copied)."""
        if not self._unadmitted:
            return
        admitted = []
        for k in keys:
            uses = self._unadmitted.get(k)
            if uses is None:
                continue
            if uses + 1 < self.admit_uses:
                self._unadmitted[k] = uses + 1
                continue
            del self._unadmitted[k]
            b = self.index.spillable(k)
            if b is not None:
                admitted.append(b)
        if admitted:
            self.g[G.STORAGE_ADMITTED] += len(admitted)
            self.spill(admitted, admitted=True)

    def promote(
        self, client: Client, seq: int, ns: Namespace, keys: list[bytes], timeout: float
    ) -> np.ndarray | None:
        """A PROMOTE hot call: rows of pinned pool offsets, now (no IO needed) or None (parked)."""
        world = ns.world_size
        rows = np.full((len(keys), world), -1, np.int64)
        call = ParkedPromote(client, seq, ns, keys, rows, time.monotonic() + timeout)
        idx = self.index
        dram = 0
        reused: list[bytes] = []
        for i, k in enumerate(keys):
            slots = idx.pin(ns, [k], owner=client.cid)[0]
            running = self._promoting.get(k)
            if slots is not None:
                rows[i] = slots
                dram += 1
                self.catalog.touch(k)
                reused.append(k)
            elif running is not None:
                if running.block.ns is ns:
                    running.waiters.append((call, i))
                    call.outstanding += 1
            elif self.catalog.owner(k) is ns:
                if self.health.degraded:  # the read would wait on the mount till the deadline
                    self.g[G.STORAGE_DEGRADED_MISSES] += 1
                    continue
                b = idx.begin_promote(ns, k)
                if b is None:
                    continue  # reserved (being written), or the pool is full of pinned blocks
                op = BlockOp(P.PROMOTE, b)
                op.waiters.append((call, i))
                self._promoting[k] = op
                call.outstanding += 1
                self.links.promote_q.extend(op.jobs())
            else:
                # nobody knows its files: missing now (a stat on the request loop could hang
                # on the mount); the stat threads look, so a later lookup finds them
                self._check(ns, [], self._to_discover([k], 0))
        ns.counters[NsCounter.LOADS_DRAM] += dram
        self._admit_reused(reused)
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
            now = time.monotonic()
            self._stats_done(now)
            if self.upkeep.take_pause_began():
                self._end_queued_spills()
            if self.upkeep.take_resumed():
                self._retry_spills()
            self._dispatch()
            self.g[G.STORAGE_SPILLS_PENDING] = self.links.spill_jobs()
            if self._calls:
                for call in self._calls:
                    if not call.done and now >= call.deadline:
                        self.g[G.STORAGE_PROMOTE_TIMEOUTS] += 1
                        self.errors.log(
                            logging.WARNING,
                            "promote-timeout",
                            "promote of %d block(s) for client %d not finished by its "
                            "deadline: answered with %d loaded, the rest reported failed",
                            len(call.keys),
                            call.client.cid,
                            int((call.rows[:, 0] >= 0).sum()),
                        )
                        call.finish(self._answers)  # whatever is not loaded yet stays -1
                self._calls = [call for call in self._calls if not call.done]
            self.health.update(self._degraded_reason(now))
            self.catalog.publish(self.g)
            answers, self._answers = self._answers, []
        return answers

    def _degraded_reason(self, now: float) -> str | None:
        """Why the storage tier is degraded now (None: it is not). Counts each stat batch that
        outlives the lookup bound once (G.STORAGE_STAT_TIMEOUTS)."""
        running = self.stats_pool.running()
        for b in running:
            if not b.late and now - b.submitted > self.lookup_wait:
                b.late = True
                self.g[G.STORAGE_STAT_TIMEOUTS] += 1
        waited = self.stats_pool.oldest(now)
        if self.stats_pool.saturated and waited > self.lookup_wait:  # not a burst of quick stats
            return "every storage stat thread is stuck (the file system does not answer)"
        if waited > SLOW_STAT_S:
            return f"a stat in the storage directory has not returned for over {SLOW_STAT_S:g}s"
        oldest = self.links.oldest_job(now)
        if oldest > SLOW_IO_S:
            return f"an IO worker's read or write has not returned for over {SLOW_IO_S:g}s"
        return None

    def _dispatch(self) -> None:
        self.links.dispatch(self._ns_raw, spills=not self.upkeep.paused)

    def _complete(self, done: Completion) -> None:
        op, rank, status, flags = done.job.op, done.job.rank, done.status, done.flags
        g = self.g
        if done.dead_pid and op.kind == P.SPILL:  # its temporary file is nobody's now
            b = op.block
            name = kvfile.tmp_name(kvfile.file_name(b.key, rank), pid=done.dead_pid)
            self._unlink_later(kvfile.rel_dir(b.ns.fingerprint, b.key), [name])
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
        elif status in GONE_STATUSES and op.kind == P.PROMOTE:
            pass  # counted once per block by _finish_promote: not an IO error
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
            if self.catalog.add(b.ns, b.key, recent=True):
                self.catalog.verified(b.key, time.monotonic())  # just written: no stat needed yet
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
            self._unlink_later(rel, [kvfile.file_name(b.key, rank) for rank in op.written])

    def _unlink_later(self, rel: str, names: list[str]) -> None:
        """Unlink files on a stat thread (never on the request loop: the mount may hang). With
        the threads saturated they stay: a scan removes a dead writer's temporary file later."""

        def unlink() -> None:
            for name in names:
                unlink_quietly(self.tree, self.errors, rel, name)  # counted as the upkeep thread does

        if names:
            self.stats_pool.submit(unlink)

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
        elif op.status == Status.CORRUPT:
            self.catalog.forget(key)  # quarantined
        elif op.status in GONE_STATUSES:
            self._gone_lately.add(key, time.monotonic())
            if self.catalog.forget(key) is not None:
                self._gone(1, "a promote")  # another server's evictor, an operator
        settle_waiters(self.index, b, ok, op.waiters, self._answers)

    # ================================================================ operator calls
    def file_victims(self, ns: Namespace) -> tuple[list[bytes], dict[str, int]]:
        """``ns``'s keys with files `hpkv evict` may delete (server lock held): not being
        promoted, written or read, their block neither pinned nor reserved; the rest counted."""
        out: list[bytes] = []
        skipped = {"pinned": 0, "reserved": 0, "in_io": 0, "recent": 0, "in_use": 0}
        for k in self.catalog.keys_of(ns):
            b = self.index.blocks.get(k)
            if k in self._promoting or (b is not None and b.state != State.READY):
                skipped["reserved"] += 1
            elif b is not None and b.pins:
                skipped["pinned"] += 1
            elif b is not None and b.io:
                skipped["in_io"] += 1
            else:
                out.append(k)
        return out, skipped

    def last_used_ns(self, ns: Namespace, key: bytes) -> int:
        """When the block's files were last written or read (wall-clock ns: the newest mtime or
        atime of its ranks' files; IO workers leave the access time of a read). File system
        calls: never on the request loop, never under the server lock. 0 when none is there."""
        rel = kvfile.rel_dir(ns.fingerprint, key)
        newest = 0
        for rank in range(ns.world_size):
            try:
                st = self.tree.stat(rel, kvfile.file_name(key, rank))
            except OSError:
                continue
            newest = max(newest, st.st_mtime_ns, st.st_atime_ns)
        return newest

    def delete_files(self, ns: Namespace, keys: list[bytes]) -> tuple[list[bytes], int]:
        """Delete these blocks' files as the capacity evictor does (caller's thread, not the
        request loop; takes the server lock only to change the catalog): each is forgotten and
        marked being deleted (a stat must not find it meanwhile) unless it came into use since
        it was chosen, unlinked, then journaled as deleted. Returns (keys deleted, files)."""
        doomed: list[bytes] = []
        with self.lock:
            for k in keys:
                b = self.index.blocks.get(k)
                busy = k in self._promoting or (b is not None and (b.state != State.READY or b.pins or b.io))
                if not busy and self.catalog.owner(k) is ns and self.catalog.begin_delete(k) is not None:
                    doomed.append(k)
            self.catalog.publish(self.g)
            self._catalog_dirty = True
        files = 0
        try:
            for k in doomed:
                rel = kvfile.rel_dir(ns.fingerprint, k)
                for rank in range(ns.world_size):
                    files += unlink_quietly(self.tree, self.errors, rel, kvfile.file_name(k, rank))
        finally:
            with self.lock:
                self.catalog.deleted(doomed)
                self.g[G.STORAGE_EVICTED_FILES] += files
            self.shared.deleted_here(ns, doomed)
        return doomed, files

    def prefetch(self, ns: Namespace, budget: int, newest: int | None) -> list[bytes]:
        """Queue promotes of ``ns``'s files-only blocks, most recently used first, while they fit
        in ``budget`` bytes of the pool (at most ``newest`` blocks); server lock held. Nothing is
        pinned: a prefetched block is an ordinary DRAM block. The request loop issues the reads
        (its next poll) and finishes them; returns the keys whose promote was queued."""
        size = ns.slot_bytes * ns.world_size
        started: list[bytes] = []
        if self.health.degraded:
            return started
        for k in self.catalog.keys_of(ns):
            if newest is not None and len(started) >= newest:
                break
            if budget < size:
                break
            if k in self.index.blocks or k in self._promoting:
                continue  # in DRAM already, being written or read
            b = self.index.begin_promote(ns, k)
            if b is None:
                break  # the pool is full of blocks that cannot be evicted
            op = BlockOp(P.PROMOTE, b)
            self._promoting[k] = op
            self.links.promote_q.extend(op.jobs())
            budget -= size
            started.append(k)
        if started:
            self.doorbell.ring()
        return started

    def promoting(self, key: bytes) -> bool:
        return key in self._promoting

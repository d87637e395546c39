"""The remote tier: blocks in a store shared by several nodes (Mooncake Store), the second
implementation of :class:`hpkv.engine.tiers.LowerTier`.

The store is used only by the remote worker process (:mod:`hpkv.io_workers.remote_worker`);
this is the server's side of it, under the server's lock, and it never waits on the store:

* **lookup**: a key nobody here knows is asked about off the request loop (one LOOKUP job
  per key; the worker asks about every rank's object of the keys queued at once in one
  ``batch_is_exist``), the call parked for at most ``HPKV_REMOTE_LOOKUP_WAIT_MS``;
  found keys join the catalog (so the index answers them as remote hits, the wire's
  ``Tier.REMOTE``: a background load like a file's, unless the file tier has the key too),
  the first missing one is remembered as missing for :data:`NEGATIVE_TTL_S`;
* **promote**: fresh slots, one PROMOTE job per rank; the worker verifies the object as a KV
  file before it answers, and the call is parked as a file promote is;
* **spill** (write-through of committed blocks): one SPILL job per rank, bounded
  (:data:`MAX_QUEUED_SPILLS`; beyond it a block is not published, counted in ``dropped``);
  an object already in the store is not written again. With ``HPKV_REMOTE_WRITE_POLICY=evict``
  a committed block is not published then: it is evictable at once, and when the pool picks
  it as a victim (:attr:`Index.before_evict`) it is published instead of evicted (its slots
  unevictable until the put ended, then the next to go, the store holding it); the
  allocation takes the next victim meanwhile, never waiting. An allocation that meets only
  victims not yet published thus starts their puts until a quarter of the pool waits for
  them, then evicts the next one unpublished (it needs a slot now): counted in ``dropped``,
  logged once. So is a victim while the store is down, and one whose put failed (the failure
  counted in ``errors``) at its next turn.

Which keys the store holds (as far as this node knows) is a
:class:`~hpkv.engine.storage.catalog.FileCatalog` of its own (``Tier.REMOTE``), the index's
owner of "has a copy in the store" beside the file tier's.

A circuit breaker guards the store: ``HPKV_REMOTE_DOWN_AFTER`` failures of it in a row (not a
missing object, not a lost peer), or one call the master did not answer, mark the tier DOWN:
lookups stop asking, spills are dropped (counted), promotes of remote blocks miss; the worst
case is recompute. While DOWN, one cheap probe (an exists of :data:`PROBE_KEY`) every
``HPKV_REMOTE_PROBE_S`` decides: the first the store answers marks it UP again. Each change is
logged once. Going DOWN, what this node knew the store held is forgotten (no lookup promises
a remote block meanwhile; a restarted master starts empty); :data:`GONE_TTL_S` after coming
back UP (the store's liveness window: the clients' segments are mounted on a restarted master
again by then) the blocks it published that are still in the pool are published again (at
most :data:`MAX_QUEUED_SPILLS`; a put of an object that is still there is skipped). The same
after a restart of a remote worker that held a segment (the objects in it went with it). A
worker that dies has its jobs failed and is restarted on the same rings, as an IO worker is.

With HPKV_KV_STORAGE_PATH set too, the remote tier is the second tier below the pool: DRAM →
files → remote, or the first with HPKV_TIER_ORDER=remote,files
(:class:`~hpkv.engine.tiers.TierList` routes each promote to the first tier in the order that
holds the key; a committed block is written to files and published).
"""

from __future__ import annotations

import errno
import heapq
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpkv.config import Config, ConfigError
from hpkv.engine.index import Block, Index, Namespace
from hpkv.engine.storage.catalog import FileCatalog
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
from hpkv.protocol import wire as P
from hpkv.protocol.errors import Status, status_message
from hpkv.protocol.stats import REMOTE_COUNTERS, G, NsCounter, RemoteState, StatsSegment
from hpkv.ring import Doorbell, Ring, RingError

log = logging.getLogger("hpkv.remote")

NEGATIVE_TTL_S = 1.0  # a key the store did not have is not asked about again for this long
# A key whose object was gone or corrupt at a get: the master lists the objects of a dead
# segment holder for ~10 s (its client_ttl), so it is not asked about again for longer.
GONE_TTL_S = 12.0
# A remote hit is asked about again when the store last said it holds it longer ago than this
# (another node's capacity eviction or remove; a dead holder's objects are listed for ~10 s
# anyway): the lookup parks for one batched exists, rather than the promote failing.
PRESENT_TTL_S = 10.0
MAX_NEGATIVE = 65536  # keys remembered as missing
PROBE_KEY = b"hpkv-probe".ljust(16, b"\0")  # the key the breaker's probe asks about (any answer will do)
MAX_CHECK_KEYS = 64  # keys one lookup asks about
MAX_CHECKS = 8  # lookups' questions in flight at once (beyond: answered from what is known)
MAX_QUEUED_SPILLS = 256  # blocks waiting to be published (beyond: not published, counted)
FORGET_SLICE = 4096  # stale catalog entries forgotten a poll (_forget_known)
GONE = (-errno.ENOENT, Status.CORRUPT)
# A get whose object's holder (the node whose segment it is in) is gone: the worker then
# answers that node's other objects missing (remote_worker.DEAD_HOLDER_S), and every remote hit
# known here is asked about again (_holder_gone): which node holds what is not known here.
HOLDER_GONE = -errno.EHOSTUNREACH
# Failures of one object or one peer, not of the store (the tier stays up): a worker that died,
# a put placed in the segment of a node that is gone, a put no segment had room for.
NOT_THE_STORE = (Status.WORKER_DIED, -errno.EHOSTUNREACH, -errno.ENOSPC)


def check_config(cfg: Config) -> None:
    """Refuse a remote tier that cannot work, naming the key to set."""
    if not cfg["HPKV_REMOTE_BACKEND"]:
        return
    for key in ("HPKV_REMOTE_MASTER", "HPKV_REMOTE_METADATA", "HPKV_REMOTE_LOCAL_HOSTNAME"):
        if not cfg[key]:
            raise ConfigError(f"HPKV_REMOTE_BACKEND={cfg['HPKV_REMOTE_BACKEND']} needs {key} (it is empty)")
    from hpkv.io_workers import mooncake_api

    try:
        mooncake_api.store_class()
    except mooncake_api.MooncakeUnavailable as exc:
        raise ConfigError(f"HPKV_REMOTE_BACKEND=mooncake: {exc}") from None


@dataclass
class _Op:
    """All ranks of one block: one spill or one promote."""

    kind: int
    block: Block
    remaining: int
    status: int = 0
    waiters: list[tuple[ParkedPromote, int]] = field(default_factory=list)
    evicting: int = 0  # a publish on eviction: the pool bytes its slots hold until it ends


@dataclass
class _Check:
    """A lookup's question: which of these keys (in order) does the store hold?"""

    ns: Namespace
    keys: list[bytes]
    found: list[int | None]
    remaining: int
    waiters: list[ParkedLookup] = field(default_factory=list)
    verify: bool = False  # hits known here, asked again (PRESENT_TTL_S): not new keys


@dataclass
class _Probe:
    """The circuit breaker's question while the tier is down: does the store answer at all?"""


@dataclass
class _Job:
    kind: int
    what: _Op | _Check | _Probe
    index: int  # the rank (ops) or the key's position (checks)
    sent: float = (
        0.0  # when it went to the worker (a failure of a job sent before the tier came up is old news)
    )


class _Counts:
    """The remote tier's counters, live in the stats segment's global row (one writer: the
    server), read and written by their snapshot names (:data:`REMOTE_COUNTERS`)."""

    def __init__(self, glob: np.ndarray):
        self._g = glob

    def __getitem__(self, name: str) -> int:
        return int(self._g[REMOTE_COUNTERS[name]])

    def __setitem__(self, name: str, value: int) -> None:
        self._g[REMOTE_COUNTERS[name]] = value


class RemoteTier(CatalogTier):
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
    ):
        self.cfg = cfg
        self.dir = server_dir
        self.stats = stats
        self.index = index
        self.lock = lock
        self.doorbell = doorbell
        self.pool_path = pool_path
        self.catalog = FileCatalog(index, P.Tier.REMOTE)
        self.lookup_wait = float(cfg["HPKV_REMOTE_LOOKUP_WAIT_MS"]) / 1000.0
        self.down_after = int(cfg["HPKV_REMOTE_DOWN_AFTER"])
        self.probe_s = float(cfg["HPKV_REMOTE_PROBE_S"])
        # HPKV_REMOTE_WRITE_POLICY=evict: blocks are published when the pool evicts them
        self.on_evict = cfg["HPKV_REMOTE_WRITE_POLICY"] == "evict"
        self._evicting = 0  # pool bytes of victims waiting for their publish
        # Victims waiting for their put hold at most this much of the pool; no count bound
        # (MAX_QUEUED_SPILLS, write-through's: it evicted 1 victim in 257 unpublished in a burst)
        self._evicting_limit = index.alloc.capacity // 4
        self._told_bound = False  # that bound was met (logged once)
        self._put_failed: OrderedDict[bytes, None] = OrderedDict()  # victims whose publish failed
        if self.on_evict:
            index.before_evict = self._publish_victim
        self.worker: WorkerProcess | None = None
        self._req: Ring | None = None
        self._resp: Ring | None = None
        self._dead = False
        self._seq = 0
        self._inflight: OrderedDict[int, _Job] = OrderedDict()
        self._checks_q: deque[_Job] = deque()
        self._promote_q: deque[_Job] = deque()
        self._spill_q: deque[_Job] = deque()
        self._spills = 0  # spill ops not finished
        self._checking: dict[bytes, _Check] = {}
        self._checks = 0  # checks not finished
        self._missing: OrderedDict[bytes, float] = OrderedDict()  # key -> asked, missing until
        self._promoting: dict[bytes, _Op] = {}
        self._calls: list[ParkedPromote] = []
        self._answers: list[PromoteAnswer] = []
        self._ns_raw: dict[int, bytes] = {}
        # the circuit breaker
        self._state = RemoteState.UP
        self._fails = 0  # store failures in a row
        self._up_since = 0.0  # (monotonic) jobs sent before it do not count against the breaker
        self._down_since = 0.0  # (monotonic) and the wall-clock time and reason, for `hpkv status`
        self._down_wall: float | None = None
        self._down_reason: str | None = None
        self._next_probe = 0.0
        self._probing = False
        self._republish_at: float | None = None  # when to publish again what _forget_known kept
        self._republish_keys: list[bytes] = []
        self._forgotten = 0  # stale entries forgotten since the last _forget_known
        self._holder_gone_until = 0.0  # (monotonic) a lost holder was acted on (_holder_gone)
        self._dirty = False
        stats.glob[G.REMOTE_STATE] = RemoteState.UP
        self.counts = _Counts(stats.glob)

    # ================================================================ life cycle
    def start(self, slot: int) -> list[WorkerProcess]:
        cfg = self.cfg
        spec = {
            "pool": self.pool_path,
            "master": cfg["HPKV_REMOTE_MASTER"],
            "metadata": cfg["HPKV_REMOTE_METADATA"],
            "local_hostname": cfg["HPKV_REMOTE_LOCAL_HOSTNAME"],
            "protocol": cfg["HPKV_REMOTE_PROTOCOL"],
            "devices": cfg["HPKV_REMOTE_DEVICES"],
            "segment": int(cfg["HPKV_REMOTE_SEGMENT_SIZE"]),
            "log_level": cfg["HPKV_LOG_LEVEL"],
        }
        self.worker, self._req, self._resp = WorkerProcess.start_io(
            self.dir, "remote0", slot, spec, self.stats, self.doorbell, kind="remote"
        )
        log.info(
            "remote tier: Mooncake Store, master %s, this node %s, contributes %d bytes",
            spec["master"],
            spec["local_hostname"],
            spec["segment"],
        )
        return [self.worker]

    def shutdown(self) -> None:
        for ring in (self._req, self._resp):
            if ring is not None:
                ring.close()

    def describe(self) -> dict[str, Any]:
        # the state and the counters are live in the stats segment (G.REMOTE_*): this is the rest
        return {
            "path": f"mooncake://{self.cfg['HPKV_REMOTE_MASTER']}",
            "remote": {
                "master": self.cfg["HPKV_REMOTE_MASTER"],
                "down_since": self._down_wall,
                "down_reason": self._down_reason,
                "write_policy": self.cfg["HPKV_REMOTE_WRITE_POLICY"],
                "tier_order": ",".join(self.cfg["HPKV_TIER_ORDER"]),
            },
        }

    @property
    def degraded(self) -> bool:
        return self._is_down()

    def take_catalog_dirty(self) -> bool:
        dirty, self._dirty = self._dirty, False
        return dirty

    def worker_died(self, worker: Any) -> bool:
        if worker is not self.worker:
            return False
        self._dead = True
        self.doorbell.ring()
        return True

    def attach(self, ns: Namespace) -> None:
        self._ns_raw[ns.ns_id] = kvfile.fingerprint_bytes(ns.fingerprint)

    def detach(self, ns: Namespace) -> None:
        ns.released = True
        self._ns_raw.pop(ns.ns_id, None)
        self.catalog.detach(ns)

    # ================================================================ hot path (lock held)
    def lookup(
        self,
        ns: Namespace,
        keys: list[bytes],
        hit: int,
        tiers: list[int],
        call: ParkedLookup | None = None,
    ) -> Presence:
        """Remote hits of the prefix not confirmed for PRESENT_TTL_S are asked about again (one
        batched exists; the prefix ends at one the store no longer holds); unknown keys after
        the prefix are asked about (found ones extend it)."""
        if self._is_down():  # no remote hit can be promoted now
            if P.Tier.REMOTE in tiers:
                del tiers[tiers.index(P.Tier.REMOTE) :]
            return Presence(min(hit, len(tiers)))
        now = time.monotonic()
        verdict = self._verify_hits(ns, keys, hit, tiers, call, now)
        if isinstance(verdict, Presence):
            return verdict
        pending = verdict
        if hit >= len(keys) or not self._unknown(keys[hit], now):
            return Presence(hit, pending)
        running = self._checking.get(keys[hit])
        if running is None:
            if call is None or self._checks >= MAX_CHECKS:
                return Presence(hit, pending)
            ask: list[bytes] = []
            for k in keys[hit : hit + MAX_CHECK_KEYS]:
                if not self._unknown(k, now) or k in self._checking:
                    break
                ask.append(k)
            running = self._start_check(ns, ask)
        if call is None:
            return Presence(hit, True)
        self._wait(running, call)
        return Presence(hit, True)

    def _verify_hits(
        self,
        ns: Namespace,
        keys: list[bytes],
        hit: int,
        tiers: list[int],
        call: ParkedLookup | None,
        now: float,
    ) -> Presence | bool:
        """:meth:`lookup`'s remote hits of the prefix not confirmed for PRESENT_TTL_S (or stale:
        :meth:`_forget_known`) asked about again: True when ``call`` is parked on that, or the
        answer now when the prefix ends at one of them (still being asked about, or stale and
        not asked: the checks are saturated), else False."""
        if P.Tier.REMOTE not in tiers:  # (no remote hit: no native call over the prefix)
            return False
        due = [
            i for i in self.catalog.to_verify(ns, keys[:hit], now, PRESENT_TTL_S) if tiers[i] == P.Tier.REMOTE
        ]
        if not due:
            return False
        rechecks = self._recheck(ns, [keys[i] for i in due[:MAX_CHECK_KEYS]], call)
        if rechecks and call is not None:
            return True
        if rechecks:  # answered at its bound: a hit still being asked about is none yet
            first = next(i for i in due if keys[i] in self._checking)
            del tiers[first:]
            return Presence(first, True)
        if self.catalog.retiring:  # not asked (checks saturated): a stale entry is no hit
            del tiers[due[0] :]
            return Presence(due[0])
        return False

    def _recheck(self, ns: Namespace, keys: list[bytes], call: ParkedLookup | None) -> bool:
        """Ask again about hits known here; with ``call``, park it on the checks. True while a
        check of one of them is outstanding."""
        running = {id(c): c for k in keys if (c := self._checking.get(k)) is not None}
        new = [k for k in keys if k not in self._checking]
        if new and call is not None and self._checks < MAX_CHECKS:
            c = self._start_check(ns, new, verify=True)
            running[id(c)] = c
        if call is not None:
            for c in running.values():
                self._wait(c, call)
        return bool(running)

    def _start_check(self, ns: Namespace, keys: list[bytes], verify: bool = False) -> _Check:
        check = _Check(ns, keys, [None] * len(keys), len(keys), verify=verify)
        for i, k in enumerate(keys):
            self._checking[k] = check
            self._checks_q.append(_Job(P.LOOKUP, check, i))
        self._checks += 1
        self.counts["asked"] += len(keys)
        self._dispatch()
        return check

    def _wait(self, check: _Check, call: ParkedLookup) -> None:
        check.waiters.append(call)
        call.outstanding += 1
        call.deadline = max(call.deadline, time.monotonic() + self.lookup_wait)

    def learning(self, ns: Namespace) -> bool:
        return False  # nothing to learn at attach: presence is asked of the store per lookup

    def discover(self, ns: Namespace, keys: list[bytes], call: ParkedLookup | None = None) -> bool:
        return False

    def _unknown(self, key: bytes, now: float) -> bool:
        if not self.catalog.unknown(key):
            return False
        until = self._missing.get(key)
        if until is None:
            return True
        if now < until:
            return False
        del self._missing[key]
        return True

    def promote(
        self, client: Client, seq: int, ns: Namespace, keys: list[bytes], timeout: float
    ) -> np.ndarray | None:
        idx = self.index
        rows = np.full((len(keys), ns.world_size), -1, np.int64)
        call = ParkedPromote(client, seq, ns, keys, rows, time.monotonic() + timeout)
        dram = 0
        down = self._is_down()
        for i, k in enumerate(keys):
            slots = idx.pin(ns, [k], owner=client.cid)[0]
            if slots is not None:
                rows[i] = slots
                dram += 1
                self.catalog.touch(k)
                continue
            running = self._promoting.get(k)
            if running is not None:
                if running.block.ns is ns:
                    running.waiters.append((call, i))
                    call.outstanding += 1
                continue
            if down or self.catalog.owner(k) is not ns:
                continue
            b = idx.begin_promote(ns, k)
            if b is None:
                continue
            op = _Op(P.PROMOTE, b, ns.world_size, waiters=[(call, i)])
            self._promoting[k] = op
            self._promote_q.extend(_Job(P.PROMOTE, op, r) for r in range(ns.world_size))
            call.outstanding += 1
        ns.counters[NsCounter.LOADS_DRAM] += dram
        if call.outstanding == 0:
            return rows
        self._calls.append(call)
        self._dispatch()
        return None

    def spill(self, blocks: Iterable[Block]) -> None:
        if not self.on_evict:
            self._publish(blocks)
            return
        for b in blocks:  # published when the pool evicts them (_publish_victim)
            if b.key in self.catalog:
                self.catalog.touch(b.key)
            else:
                self.index.skip_spill(b)  # evictable now, as far as this tier is concerned

    def _publish(self, blocks: Iterable[Block]) -> None:
        for b in blocks:
            if b.key in self.catalog:
                self.catalog.touch(b.key)
                continue
            if self._is_down() or self._spills >= MAX_QUEUED_SPILLS:
                self.index.skip_spill(b)  # evictable without a copy below
                self.counts["dropped"] += 1
                continue
            self._start_publish(b)
        self._dispatch()

    def _start_publish(self, b: Block, evicting: int = 0) -> None:
        self.index.spill_started(b)
        op = _Op(P.SPILL, b, b.ns.world_size, evicting=evicting)
        self._spills += 1
        self._spill_q.extend(_Job(P.SPILL, op, r) for r in range(b.ns.world_size))

    def _publish_victim(self, b: Block) -> bool:
        """:attr:`Index.before_evict` under HPKV_REMOTE_WRITE_POLICY=evict: publish the pool's
        victim ``b`` first (True: its slots stay until the put ended), unless the store holds
        it already (evicted now: False), or, counted as dropped, its put failed before, the
        store is down or the victims' puts hold a quarter of the pool (evicted now, unpublished)."""
        if b.key in self.catalog:
            return False
        size = b.ns.slot_bytes * b.ns.world_size
        failed_before = b.key in self._put_failed  # tried once: not again
        if failed_before:
            del self._put_failed[b.key]
        if failed_before or self._is_down() or b.ns.ns_id not in self._ns_raw:
            self.counts["dropped"] += 1
            return False
        if self._evicting + size > self._evicting_limit:
            # every victim this allocation met before waits for its put, and it needs a slot
            # now: this one goes unpublished (the bound that keeps the pool from waiting)
            self.counts["dropped"] += 1
            if not self._told_bound:
                self._told_bound = True
                log.warning(
                    "remote tier: victims waiting for their publish hold a quarter of the pool "
                    "(%d bytes): a victim was evicted unpublished (counted in dropped; logged once)",
                    self._evicting,
                )
            return False
        self._evicting += size
        self._start_publish(b, evicting=size)
        self._dispatch()
        return True

    def touch(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            self.catalog.touch(k)

    def pending_spills(self) -> int:
        return self._spills

    def client_gone(self, client: Client) -> None:
        for call in self._calls:
            if call.client is client:
                call.done = True
        self._calls = [c for c in self._calls if not c.done]

    def poll(self) -> list[PromoteAnswer]:
        with self.lock:
            self._collect()
            if self._dead:
                self._recover()
            now = time.monotonic()
            self._breaker(now)
            for call in self._calls:
                if not call.done and now >= call.deadline:
                    call.finish(self._answers)  # whatever is not loaded yet stays -1
            self._calls = [c for c in self._calls if not c.done]
            self._dispatch()
            answers, self._answers = self._answers, []
        return answers

    # ================================================================ the worker's rings
    def _dispatch(self) -> None:
        if self._dead or self._req is None:
            return
        for q in (self._checks_q, self._promote_q, self._spill_q):
            while q:
                job = q[0]
                ns_raw, key, rank, world, offset, length = self._job_args(job)
                self._seq += 1
                flags, args = P.io_job(ns_raw, key, rank, world, offset, length)
                try:
                    pushed = self._req.try_push(job.kind, self._seq, *args, flags=flags)
                except RingError as exc:
                    log.error("remote worker request ring failed: %s", exc)
                    pushed = False
                if not pushed:
                    return  # full (a stuck worker): again on the next wake-up
                q.popleft()
                job.sent = time.monotonic()
                self._inflight[self._seq] = job

    def _job_args(self, job: _Job) -> tuple[bytes, bytes, int, int, int, int]:
        w = job.what
        if isinstance(w, _Probe):
            return bytes(16), PROBE_KEY, 0, 1, 0, 0
        if isinstance(w, _Check):
            ns = w.ns
            return self._ns_raw.get(ns.ns_id, bytes(16)), w.keys[job.index], 0, ns.world_size, 0, 0
        b = w.block
        assert b.slots is not None, "a remote job's block keeps its slots until the job ends"
        raw = self._ns_raw.get(b.ns.ns_id, bytes(16))
        return raw, b.key, job.index, b.ns.world_size, b.slots[job.index], b.ns.shard_bytes

    def _collect(self) -> None:
        if self._resp is None:
            return
        while True:
            try:
                d = self._resp.try_pop()
            except RingError:
                break
            if d is None:
                break
            job = self._inflight.pop(d.seq, None)
            if job is not None:
                self._complete(job, d.status, d.a0, d.flags)

    def _recover(self) -> None:
        """The worker died: the jobs it had taken fail (those still in the ring stay), and a
        new worker starts on the same rings."""
        assert self._req is not None and self.worker is not None
        queued = self._req.depth
        jobs = list(self._inflight.items())
        lost = jobs[: max(0, len(jobs) - queued)]
        for seq, job in lost:
            del self._inflight[seq]
            self._complete(job, Status.WORKER_DIED, 0, 0)
        self._dead = False
        self._dirty = True
        log.error("remote worker died with %d job(s) taken: reported failed", len(lost))
        self.worker.respawn()
        if int(self.cfg["HPKV_REMOTE_SEGMENT_SIZE"]) > 0:
            # the objects in its segment went with it; the master lists them for ~10 s more
            # (exists says yes, gets fail), so they are published again after that
            self._forget_known()
            self._republish_at = time.monotonic() + GONE_TTL_S

    def _complete(self, job: _Job, status: int, a0: int, flags: int) -> None:
        w = job.what
        lost = status in GONE or (status == HOLDER_GONE and isinstance(w, _Op) and w.kind == P.PROMOTE)
        if status < 0 and not lost:
            self._failed(job, status)
        elif job.sent >= self._up_since:
            self._fails = 0  # the store answered
        if isinstance(w, _Probe):
            self._probe_done(status)
            return
        if isinstance(w, _Check):
            w.found[job.index] = a0 if status == 0 else -1
            w.remaining -= 1
            if w.remaining == 0:
                self._check_done(w)
            return
        if status != 0:
            w.status = w.status or status
        elif w.kind == P.SPILL:
            self.counts["existed" if flags & P.IO_EXISTED else "published"] += 1
            self.counts["bytes_put"] += a0
        else:
            self.counts["bytes_got"] += a0
        w.remaining -= 1
        if w.remaining == 0:
            (self._spill_done if w.kind == P.SPILL else self._promote_done)(w)

    def _failed(self, job: _Job, status: int) -> None:
        """A store failure (not a missing object): counted, and the breaker opens after
        HPKV_REMOTE_DOWN_AFTER of them in a row, or at once when the master did not answer."""
        self.counts["errors"] += 1
        if status in NOT_THE_STORE or self._state == RemoteState.DOWN or job.sent < self._up_since:
            return
        self._fails += 1
        if status == -errno.ETIMEDOUT:
            self._go_down(f"the master did not answer ({status_message(status)})")
        elif self._fails >= self.down_after:
            self._go_down(f"{self._fails} store failures in a row, the last: {status_message(status)}")

    def _go_down(self, reason: str) -> None:
        now = time.monotonic()
        self._state = RemoteState.DOWN
        self.stats.glob[G.REMOTE_STATE] = RemoteState.DOWN
        self._down_since, self._down_wall, self._down_reason = now, time.time(), reason
        self._next_probe = now + self.probe_s
        self.counts["down_events"] += 1
        self._dirty = True
        log.warning(
            "remote store down: %s; not asked, blocks recomputed, probed every %gs",
            reason,
            self.probe_s,
        )
        # No lookup promises a remote block meanwhile (its promote would miss), and what the
        # store held may be gone when it is back (a restarted master starts empty).
        self._forget_known()

    def _breaker(self, now: float) -> None:
        """While down: one probe at a time, every HPKV_REMOTE_PROBE_S. Up: a publish again
        that a restarted worker's lost segment asked for, once it is due."""
        if self._state == RemoteState.DOWN:
            if not self._probing and now >= self._next_probe and not self._dead and self._req is not None:
                self._probing = True
                self.counts["probes"] += 1
                self._checks_q.appendleft(_Job(P.LOOKUP, _Probe(), 0))
        elif self._republish_at is not None and now >= self._republish_at:
            self._republish_at = None
            self._republish()
        if self.catalog.retiring:
            gone, done = self.catalog.retire_step(FORGET_SLICE, self._promoting.__contains__)
            self._forgotten += gone
            if done:
                log.info("remote tier: %d stale block(s) forgotten", self._forgotten)
            elif self.doorbell is not None:
                self.doorbell.ring()  # the next slice on the next turn of the loop
        self.counts["blocks"] = len(self.catalog)

    def _probe_done(self, status: int) -> None:
        self._probing = False
        now = time.monotonic()
        if status < 0 or self._state != RemoteState.DOWN:
            self._next_probe = now + self.probe_s
            return
        self._state = RemoteState.UP
        self.stats.glob[G.REMOTE_STATE] = RemoteState.UP
        self._up_since, self._fails = now, 0
        self._down_wall = self._down_reason = None
        self._dirty = True
        log.warning("remote store up again after %.1fs down", now - self._down_since)
        # A restarted master starts empty, and the clients' segments are mounted on it again
        # within its liveness window: then what this node published is published again.
        self._republish_at = now + GONE_TTL_S

    def _forget_known(self) -> None:
        """What this node knew the store held is stale (a restarted master starts empty; a
        restarted worker's segment is gone): retired at once (no hit any more; lookups ask
        again, and what the store confirms is known again), forgotten :data:`FORGET_SLICE`
        entries a poll (never the whole catalog under the lock at once). The most recently
        used of those blocks still in the pool (a walk of the pool's blocks, not of the
        catalog) are kept to publish again later."""
        cat, idx = self.catalog, self.index
        held = [b for b in idx.blocks.values() if b.key in cat]
        cat.retire_all(time.monotonic())
        self._forgotten = 0
        for b in held:  # as for a forgotten entry: the DRAM copy stays, evictable without one below
            idx.files_gone(b.key)
        spillable = [b for b in held if idx.spillable(b.key) is b]
        again = [b.key for b in heapq.nlargest(MAX_QUEUED_SPILLS, spillable, key=lambda b: b.used)]
        fresh = set(again)
        self._republish_keys = again + [k for k in self._republish_keys if k not in fresh]
        del self._republish_keys[MAX_QUEUED_SPILLS:]
        log.info(
            "remote tier: %d block(s) known to the store are stale (forgotten %d a poll); "
            "%d still in the pool to publish again",
            len(cat),
            FORGET_SLICE,
            len(again),
        )

    def _holder_gone(self) -> None:
        """A get failed because the node holding its object is gone: the other objects that
        node held are lost too, and the worker answers them missing now, but which they are is
        not known here: every remote hit is asked about again before it is promised (once per
        GONE_TTL_S), and what this node published that is still in the pool is published again
        once the store has dropped the dead node's objects (some were in its segment)."""
        now = time.monotonic()
        if now < self._holder_gone_until:
            return
        self._holder_gone_until = now + GONE_TTL_S
        log.warning("remote tier: a node holding objects is gone: every remote hit is asked about again")
        self._forget_known()
        self._republish_at = now + GONE_TTL_S

    def _republish(self) -> None:
        """Publish again the blocks :meth:`_forget_known` kept that are still in the pool (the
        worker skips objects that are still there: counted as existed)."""
        keys, self._republish_keys = self._republish_keys, []
        room = max(0, MAX_QUEUED_SPILLS - self._spills)
        blocks = [b for k in keys if (b := self.index.spillable(k)) is not None][:room]
        blocks = [b for b in blocks if b.key not in self.catalog]
        self._publish(blocks)
        self.counts["republished"] += len(blocks)

    def _is_down(self) -> bool:
        return self._state == RemoteState.DOWN

    def _check_done(self, check: _Check) -> None:
        now = time.monotonic()
        for k in check.keys:
            self._checking.pop(k, None)
        if check.verify:
            self._rechecked(check, now)
        else:
            self._found(check, now)
        self._checks -= 1
        for call in check.waiters:
            call.outstanding -= 1

    def _found(self, check: _Check, now: float) -> None:
        """Keys after a prefix asked about: those the store holds, up to the first it does not,
        are known here (confirmed now); that first one is remembered missing."""
        for k, found in zip(check.keys, check.found, strict=True):
            if found != 1:
                if found == 0:
                    self.counts["missed"] += 1
                    self._remember_missing(k, now + NEGATIVE_TTL_S)
                break
            if self.catalog.add(check.ns, k, recent=False):
                self.catalog.verified(k, now)
                self.counts["found"] += 1

    def _rechecked(self, check: _Check, now: float) -> None:
        """Hits asked about again: those the store no longer holds are no hits any more (their
        promote would fail), the others are confirmed for PRESENT_TTL_S; a failed ask proves
        nothing either way."""
        gone = 0
        for k, found in zip(check.keys, check.found, strict=True):
            if self.catalog.owner(k, retired=True) is not check.ns:
                continue
            if found == 0 and k not in self._promoting:
                self.catalog.forget(k)
                self._remember_missing(k, now + NEGATIVE_TTL_S)
                gone += 1
            elif found == 1:
                self.catalog.verified(k, now)
        if gone:
            self.counts["gone"] += gone
            log.info("remote tier: %d known block(s) no longer in the store: forgotten", gone)

    def _remember_missing(self, key: bytes, until: float) -> None:
        self._missing[key] = until
        self._missing.move_to_end(key)
        while len(self._missing) > MAX_NEGATIVE:
            self._missing.popitem(last=False)

    def _spill_done(self, op: _Op) -> None:
        b = op.block
        self._spills -= 1
        self._evicting -= op.evicting
        self.index.set_io(b, -1)
        if op.status == 0:
            if self.catalog.add(b.ns, b.key, recent=True):
                self.catalog.verified(b.key, time.monotonic())
        else:
            if op.evicting:
                self._put_failed[b.key] = None
                while len(self._put_failed) > MAX_NEGATIVE:  # (blocks dropped otherwise meanwhile)
                    self._put_failed.popitem(last=False)
            self.index.skip_spill(b)  # evictable without a copy below

    def _promote_done(self, op: _Op) -> None:
        b = op.block
        key = b.key
        ok = op.status == 0
        self._promoting.pop(key, None)
        self.index.finish_promote(key, ok)
        if ok:
            self.counts["loaded"] += 1
            self.catalog.touch(key)
            self.catalog.verified(key, time.monotonic())
        else:
            if op.status == Status.CORRUPT:
                self.counts["corrupt"] += 1
            elif op.status in (-errno.ENOENT, HOLDER_GONE):
                self.counts["gone"] += 1
            if op.status in GONE or op.status == HOLDER_GONE:
                self._remember_missing(key, time.monotonic() + GONE_TTL_S)
            self.catalog.forget(key)  # no hit any more; a later lookup asks the store again
            if op.status == HOLDER_GONE:
                self._holder_gone()
        settle_waiters(self.index, b, ok, op.waiters, self._answers, NsCounter.LOADS_REMOTE)

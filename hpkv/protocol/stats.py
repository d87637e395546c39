"""The stats segment: counters and gauges in shared memory, read without locks or RPC.

Layout of the file ``stats`` in the pool directory (all little-endian int64)::

    header    [16]                 magic, version, server pid, start time (ns), heartbeat (ns),
                                   catalog generation (seqlock), catalog length
    global    [GLOBAL_SLOTS]       server-wide counters (:class:`G`)
    ns        [MAX_NS][NS_SLOTS]   per-namespace counters (:class:`NsCounter`), row = ns id
    worker    [MAX_WORKERS][W_SLOTS] per-worker counters (:class:`W`), written by the worker itself
    catalog   CATALOG_BYTES        JSON: namespaces, workers, clients, rings (names, pids, CPUs…)

Counters are written by exactly one process each (the server, or the worker owning
the row) with aligned 8-byte stores, so a reader sees each value whole. The JSON
catalog changes rarely; its writer bumps the generation to odd, writes, bumps to
even, and readers retry while it is odd or changed under them.
"""

from __future__ import annotations

import json
import mmap
import os
import time
from enum import IntEnum
from typing import Any

import numpy as np


# Per-namespace counters, kept in a numpy int64 vector (a view into the stats
# segment in the server, so monitors read them live).
class NsCounter(IntEnum):
    BLOCKS_DRAM = 0  # gauge: READY blocks with pool slots
    BYTES_DRAM = 1  # gauge
    BLOCKS_PINNED = 2  # gauge
    BLOCKS_STORAGE = 3  # gauge: blocks known to have files
    HITS_DRAM = 4  # blocks
    HITS_STORAGE = 5
    MISSES = 6  # lookups that stopped at a missing key (one per lookup)
    LOOKUPS = 7
    EVICTIONS = 8
    RESERVE_FAILED = 9  # pool full of unevictable blocks
    COMMITS = 10  # blocks that became READY
    BLOCKS_RESERVED = 11  # gauge
    LOADS_DRAM = 12  # blocks pinned for loading from the pool (connector loads)
    LOADS_STORAGE = 13  # blocks promoted from storage for loading
    BYTES_STORAGE = 14  # gauge: bytes of the KV files of BLOCKS_STORAGE (every rank's file)
    # Prefill time saved (:func:`time_saved`), as the engines' connectors report it
    # (control call ``time_saved``): tokens they loaded instead of computing, the prefill
    # those tokens would have cost at the engine's measured prefill rate, the loads' time.
    LOADED_TOKENS_DRAM = 15
    LOADED_TOKENS_STORAGE = 16
    PREFILL_SAVED_US_DRAM = 17  # microseconds
    PREFILL_SAVED_US_STORAGE = 18
    LOAD_US_DRAM = 19
    LOAD_US_STORAGE = 20
    BYTES_PINNED_OPERATOR = 21  # gauge: bytes of DRAM blocks pinned by `hpkv pin`
    # The remote tier (Mooncake Store, below the files): as the storage counters above
    BLOCKS_REMOTE = 22  # gauge: blocks known to be in the store (every rank's object)
    BYTES_REMOTE = 23  # gauge: bytes of their objects (every rank's)
    HITS_REMOTE = 24  # blocks a lookup found in the store only
    LOADS_REMOTE = 25  # blocks promoted from the store for loading


NS_COUNTERS = len(NsCounter)

MAGIC = 0x53544154564B5048  # "HPKVTATS"
# 2: GLOBAL_SLOTS 32 -> 48 (the storage tier's health counters); 3: NS_SLOTS 16 -> 32;
# 4: GLOBAL_SLOTS 48 -> 80 (the remote tier's state and counters, 48..64)
VERSION = 4
HEADER_SLOTS = 16
GLOBAL_SLOTS = 80
MAX_NS = 64
NS_SLOTS = 32
MAX_WORKERS = 64
W_SLOTS = 16
CATALOG_BYTES = 256 * 1024
assert NS_COUNTERS <= NS_SLOTS


class H(IntEnum):
    MAGIC = 0
    VERSION = 1
    SERVER_PID = 2
    START_NS = 3
    HEARTBEAT_NS = 4
    CATALOG_GEN = 5
    CATALOG_LEN = 6


class G(IntEnum):
    """Server-wide counters and gauges."""

    POOL_CAPACITY = 0
    POOL_USED = 1
    POOL_PINNED = 2
    CLIENTS = 3
    REQUESTS = 4
    ERRORS = 5
    WORKER_RESTARTS = 6
    BLOCKS = 7
    POOL_WARM = 8  # gauge: pool bytes allocated (and locked) by the background warmer
    # The storage tier (hpkv/io_workers), slots 16.. so other counters can grow below.
    STORAGE_FILES = 16  # gauge: KV files known (all ranks of known blocks)
    STORAGE_BYTES = 17  # gauge: their bytes on disk
    STORAGE_CAPACITY = 18  # HPKV_KV_STORAGE_SIZE (0 = unlimited)
    STORAGE_FREE = 19  # gauge: free bytes of the storage file system
    STORAGE_O_DIRECT = 20  # 1 when the IO workers use O_DIRECT
    STORAGE_IO_ERRORS = 21  # failed spills/promotes/unlinks (ENOSPC included), corrupt files too
    STORAGE_QUARANTINED = 22  # corrupt files moved to <storage>/quarantine
    STORAGE_SPILL_PAUSED = 23  # gauge: 1 while spilling is paused (free space, ENOSPC)
    STORAGE_BYTES_WRITTEN = 24
    STORAGE_BYTES_READ = 25
    STORAGE_SPILLS = 26  # files written
    STORAGE_PROMOTES = 27  # files read into the pool
    STORAGE_EVICTED_FILES = 28  # files removed by the capacity limit
    STORAGE_SPILLS_PENDING = 29  # gauge: spill jobs queued or running (the write-through still to do)
    # The storage tier's health (a hung or slow mount degrades it, never stalls the server).
    STORAGE_DEGRADED = 32  # gauge: 1 while the file system answers late or not at all
    STORAGE_LOOKUPS_BOUNDED = 33  # lookups answered at HPKV_STORAGE_LOOKUP_WAIT_MS, keys unconfirmed
    STORAGE_STAT_TIMEOUTS = 34  # stat batches still running at the lookup bound
    STORAGE_STAT_SATURATED = 35  # lookups answered at once: every stat thread busy
    STORAGE_GONE = 36  # blocks whose files vanished (another server's eviction: ENOENT, ESTALE)
    STORAGE_SPILLS_DROPPED = 37  # blocks not spilled: storage degraded, a quarter of the pool queued
    STORAGE_PROMOTE_TIMEOUTS = 38  # promotes answered at their deadline with reads outstanding
    STORAGE_DEGRADED_MISSES = 39  # storage blocks answered missing at once while degraded
    # HPKV_STORAGE_ADMIT=reuse:N: blocks kept off storage until reused, and those written then
    STORAGE_ADMIT_DEFERRED = 40
    STORAGE_ADMITTED = 41
    # The remote tier (HPKV_REMOTE_BACKEND, hpkv/engine/remote.py), written by the server.
    REMOTE_STATE = 48  # gauge: RemoteState
    REMOTE_BLOCKS = 49  # gauge: blocks this node knows the store holds
    REMOTE_ASKED = 50  # keys asked about (lookups of keys nobody here knows)
    REMOTE_FOUND = 51  # of those, keys the store held (remote hits)
    REMOTE_MISSED = 52  # of those, keys it did not hold
    REMOTE_PUBLISHED = 53  # objects put (one per rank)
    REMOTE_EXISTED = 54  # objects not put: the store had them already
    REMOTE_DROPPED = 55  # blocks not published: tier down, or the publish queue full
    REMOTE_LOADED = 56  # blocks read from the store into the pool (remote gets)
    REMOTE_BYTES_PUT = 57
    REMOTE_BYTES_GOT = 58
    REMOTE_CORRUPT = 59  # objects that did not verify (removed, recomputed)
    REMOTE_GONE = 60  # blocks whose objects were gone at a get (their holder died)
    REMOTE_ERRORS = 61  # store failures (not a missing object)
    REMOTE_DOWN_EVENTS = 62  # times the tier went down
    REMOTE_PROBES = 63  # probes sent while down
    REMOTE_REPUBLISHED = 64  # blocks published again (the store came back up, a lost segment)


class W(IntEnum):
    """Per-worker counters (written by the worker) and state (written by the server)."""

    PID = 0
    STATE = 1  # WorkerState
    JOBS = 2
    JOBS_FAILED = 3
    BYTES_SAVED = 4  # device -> pool (transfer) / pool -> file (io)
    BYTES_LOADED = 5  # pool -> device (transfer) / file -> pool (io)
    BUSY_NS = 6
    INFLIGHT_SEQ = 7  # seq of the batch being executed, 0 when idle
    HEARTBEAT_NS = 8
    RESTARTS = 9
    HANGS = 10  # times the server found it hung (no heartbeat for HPKV_WORKER_HANG_S) and killed it
    BAD_JOBS = 11  # jobs refused as malformed (unaligned or out-of-range slot offsets, bad sizes)
    STALE_SAVES = 12  # saves refused: a slot's reservation was released (new generation)


class RemoteState(IntEnum):
    OFF = 0  # no remote tier
    UP = 1
    DOWN = 2  # the circuit breaker is open: not asked, re-probed every HPKV_REMOTE_PROBE_S


#: The remote tier's counters as snapshots name them (``storage.remote``), in slot order.
REMOTE_COUNTERS = {
    "blocks": G.REMOTE_BLOCKS,
    "asked": G.REMOTE_ASKED,
    "found": G.REMOTE_FOUND,
    "missed": G.REMOTE_MISSED,
    "published": G.REMOTE_PUBLISHED,
    "existed": G.REMOTE_EXISTED,
    "dropped": G.REMOTE_DROPPED,
    "loaded": G.REMOTE_LOADED,
    "bytes_put": G.REMOTE_BYTES_PUT,
    "bytes_got": G.REMOTE_BYTES_GOT,
    "corrupt": G.REMOTE_CORRUPT,
    "gone": G.REMOTE_GONE,
    "errors": G.REMOTE_ERRORS,
    "down_events": G.REMOTE_DOWN_EVENTS,
    "probes": G.REMOTE_PROBES,
    "republished": G.REMOTE_REPUBLISHED,
}


class WorkerState(IntEnum):
    EMPTY = 0
    STARTING = 1
    RUNNING = 2
    DEAD = 3
    STOPPED = 4
    BACKOFF = 5  # died soon after starting: restarted after a growing delay
    HUNG = 6  # no heartbeat for HPKV_WORKER_HANG_S: being killed, its jobs failed, then restarted


_OFF_GLOBAL = HEADER_SLOTS
_OFF_NS = _OFF_GLOBAL + GLOBAL_SLOTS
_OFF_W = _OFF_NS + MAX_NS * NS_SLOTS
_N_INT = _OFF_W + MAX_WORKERS * W_SLOTS
FILE_SIZE = _N_INT * 8 + CATALOG_BYTES

STATS_FILE = "stats"


class StatsVersionError(FileNotFoundError):
    """The stats segment was written by a server of another hpkv version (a node upgraded while
    its server runs): this hpkv cannot read its counters."""

    def __init__(self, path: str, found: int):
        self.found = found
        super().__init__(
            f"{path} is an hpkv stats segment of version {found}, and this hpkv reads version "
            f"{VERSION}: the running server is of another hpkv version. Use that version's "
            "`hpkv status`/`hpkv-top`, or restart the server with this one"
        )


class StatsSegment:
    """A mapping of the stats file; the server creates it, everyone else attaches."""

    def __init__(self, path: str, mm: mmap.mmap, writable: bool):
        self.path = path
        self.mm = mm
        self.writable = writable
        ints = np.frombuffer(mm, dtype=np.int64, count=_N_INT)
        self.header = ints[:HEADER_SLOTS]
        self.glob = ints[_OFF_GLOBAL:_OFF_NS]
        self.ns = ints[_OFF_NS:_OFF_W].reshape(MAX_NS, NS_SLOTS)
        self.workers = ints[_OFF_W:_N_INT].reshape(MAX_WORKERS, W_SLOTS)
        self._catalog = np.frombuffer(mm, dtype=np.uint8, count=CATALOG_BYTES, offset=_N_INT * 8)

    @classmethod
    def create(cls, directory: str) -> StatsSegment:
        path = os.path.join(directory, STATS_FILE)
        tmp = f"{path}.tmp{os.getpid()}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(fd, 0, FILE_SIZE)
            mm = mmap.mmap(fd, FILE_SIZE, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        seg = cls(path, mm, writable=True)
        seg.header[H.VERSION] = VERSION
        seg.header[H.SERVER_PID] = os.getpid()
        seg.header[H.START_NS] = time.time_ns()
        seg.header[H.HEARTBEAT_NS] = time.time_ns()
        seg.header[H.MAGIC] = MAGIC
        os.rename(tmp, path)
        return seg

    @classmethod
    def attach(cls, directory: str, writable: bool = False) -> StatsSegment:
        """Raises FileNotFoundError when no server has created the segment, and its subclass
        :class:`StatsVersionError` when a server of another hpkv version did."""
        path = os.path.join(directory, STATS_FILE)
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            if os.fstat(fd).st_size != FILE_SIZE:
                head = np.frombuffer(os.pread(fd, 16, 0).ljust(16, b"\0"), np.int64)
                if int(head[H.MAGIC]) == MAGIC and int(head[H.VERSION]) != VERSION:
                    raise StatsVersionError(path, int(head[H.VERSION]))
                raise FileNotFoundError(f"{path} is not an hpkv stats segment of this version")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mm = mmap.mmap(fd, FILE_SIZE, flags=mmap.MAP_SHARED, prot=prot)
        finally:
            os.close(fd)
        seg = cls(path, mm, writable)
        magic, version = int(seg.header[H.MAGIC]), int(seg.header[H.VERSION])
        if magic != MAGIC or version != VERSION:
            seg.close()
            if magic == MAGIC:
                raise StatsVersionError(path, version)
            raise FileNotFoundError(f"{path} is not an hpkv stats segment of version {VERSION}")
        return seg

    # ---------------------------------------------------------------- catalog (seqlock)
    def write_catalog(self, catalog: dict[str, Any]) -> None:
        data = json.dumps(catalog, separators=(",", ":")).encode()
        if len(data) > CATALOG_BYTES:
            raise ValueError(f"stats catalog of {len(data)} bytes exceeds {CATALOG_BYTES}")
        self.header[H.CATALOG_GEN] += 1  # odd: writing
        self._catalog[: len(data)] = np.frombuffer(data, np.uint8)
        self.header[H.CATALOG_LEN] = len(data)
        self.header[H.CATALOG_GEN] += 1  # even: stable

    def read_catalog(self, retries: int = 1000) -> dict[str, Any]:
        for _ in range(retries):
            gen = int(self.header[H.CATALOG_GEN])
            if gen % 2:
                time.sleep(0)
                continue
            n = int(self.header[H.CATALOG_LEN])
            data = self._catalog[:n].tobytes()
            if int(self.header[H.CATALOG_GEN]) == gen:
                return json.loads(data) if data else {}
        raise TimeoutError(f"the stats catalog in {self.path} kept changing while being read")

    # ---------------------------------------------------------------- snapshot
    def snapshot(self) -> dict[str, Any]:
        """Everything as one JSON-able dict (used by ``hpkv status`` and monitors)."""
        cat = self.read_catalog()
        g = self.glob.copy()
        out: dict[str, Any] = {
            "server": {
                "pid": int(self.header[H.SERVER_PID]),
                "start_time": self.header[H.START_NS] / 1e9,
                "heartbeat_age_s": max(0.0, (time.time_ns() - int(self.header[H.HEARTBEAT_NS])) / 1e9),
                **cat.get("server", {}),
            },
            "pool": {
                "capacity_bytes": int(g[G.POOL_CAPACITY]),
                "used_bytes": int(g[G.POOL_USED]),
                "pinned_bytes": int(g[G.POOL_PINNED]),
                "blocks": int(g[G.BLOCKS]),
                "warm_bytes": int(g[G.POOL_WARM]),
            },
            "requests": int(g[G.REQUESTS]),
            "errors": int(g[G.ERRORS]),
            "worker_restarts": int(g[G.WORKER_RESTARTS]),
            "namespaces": [],
            "workers": [],
            "clients": cat.get("clients", []),
            "holds": cat.get("holds", []),
            "rings": cat.get("rings", []),
            # Beyond the server's cap, clients and holds are counted, not listed.
            "clients_omitted": int(cat.get("clients_omitted", 0)),
            "holds_omitted": int(cat.get("holds_omitted", 0)),
            "storage": _storage_snapshot(g, cat.get("storage") or {}),
        }
        for ns in cat.get("namespaces", []):
            row = self.ns[ns["id"]]
            counters = {c.name.lower(): int(row[c]) for c in NsCounter}
            out["namespaces"].append({**ns, **counters, "tiers": _tiers(counters)})
        for w in cat.get("workers", []):
            row = self.workers[w["slot"]]
            out["workers"].append(
                {
                    **w,
                    "pid": int(row[W.PID]),
                    "state": WorkerState(int(row[W.STATE])).name.lower(),
                    **{c.name.lower(): int(row[c]) for c in W if c not in (W.PID, W.STATE)},
                }
            )
        return out

    def close(self) -> None:
        del self.header, self.glob, self.ns, self.workers, self._catalog
        try:
            self.mm.close()
        except BufferError:
            pass  # a caller still holds a row view: the mapping goes when that view does


def spills_pending(directory: str) -> int:
    """Spill jobs queued or running in the server of ``directory`` (0 without one), read from
    its stats segment in this process. A poll that starts ``hpkv status`` instead costs about
    0.35 s of CPU per call: enough to slow the engine it was meant to watch."""
    try:
        seg = StatsSegment.attach(directory)
    except FileNotFoundError:
        return 0
    try:
        return int(seg.glob[G.STORAGE_SPILLS_PENDING])
    finally:
        seg.close()


#: The tiers a namespace's blocks live in, as snapshots and monitors name them.
TIERS = ("dram", "storage")


def _tiers(c: dict[str, int]) -> dict[str, dict[str, Any]]:
    """A namespace's ``"tiers"`` section: per tier its blocks and bytes now, and the prefill
    time its hits saved. ``prefill_saved_s`` is what computing the loaded tokens would have
    cost at the engine's measured prefill rate, ``load_s`` what loading them took, and
    ``time_saved_s`` the difference (negative where loading was slower than computing)."""
    out = {}
    for tier in TIERS:
        saved_s = c[f"prefill_saved_us_{tier}"] / 1e6
        load_s = c[f"load_us_{tier}"] / 1e6
        out[tier] = {
            "blocks": c[f"blocks_{tier}"],
            "bytes": c[f"bytes_{tier}"],
            "hits": c[f"hits_{tier}"],
            "loaded_tokens": c[f"loaded_tokens_{tier}"],
            "prefill_saved_s": saved_s,
            "load_s": load_s,
            "time_saved_s": saved_s - load_s,
        }
    if c["blocks_remote"] or c["hits_remote"] or c["loads_remote"]:
        # The remote store (below the files), once the namespace has anything there: what it
        # holds and its hits; its loads' time is in the storage tier's (the engines report
        # loads from below the pool as one).
        out["remote"] = {
            "blocks": c["blocks_remote"],
            "bytes": c["bytes_remote"],
            "hits": c["hits_remote"],
            "loads": c["loads_remote"],
            "loaded_tokens": 0,
            "prefill_saved_s": 0.0,
            "load_s": 0.0,
            "time_saved_s": 0.0,
        }
    return out


#: The storage tier's health counters as monitors show them: (snapshot key, short label, help).
STORAGE_HEALTH_COUNTERS = (
    (
        "lookups_bounded",
        "lookups at bound",
        "Lookups answered at HPKV_STORAGE_LOOKUP_WAIT_MS with keys unconfirmed.",
    ),
    ("stat_timeouts", "stat timeouts", "Stat batches still running at the lookup bound."),
    ("stat_saturated", "stats saturated", "Lookups answered at once because every stat thread was busy."),
    ("gone", "gone", "Blocks whose files another server or an operator removed (ENOENT, ESTALE)."),
    ("spills_dropped", "spills dropped", "Blocks not spilled: storage degraded and its spill queue full."),
    ("promote_timeouts", "promote timeouts", "Promotes answered at their deadline with reads outstanding."),
    ("degraded_misses", "degraded misses", "Storage blocks answered missing at once while degraded."),
)


#: The remote tier's counters as monitors show them: (snapshot key, short label, help); the
#: Prometheus names are ``hpkv_remote_<key>`` (``blocks`` a gauge, the rest counters).
REMOTE_COUNTER_HELP = (
    ("blocks", "blocks", "Blocks this node knows the remote store holds."),
    ("asked", "asked", "Keys nobody here knew, asked about in the remote store."),
    ("found", "hits", "Keys asked about that the remote store held (remote hits)."),
    ("missed", "misses", "Keys asked about that the remote store did not hold."),
    ("published", "puts", "Objects published to the remote store (one per rank)."),
    ("existed", "existed", "Objects not published: the remote store held them already."),
    ("dropped", "dropped", "Blocks not published: the tier was down or the publish queue full."),
    ("loaded", "gets", "Blocks read from the remote store into the pool."),
    ("bytes_put", "put", "Bytes published to the remote store."),
    ("bytes_got", "got", "Bytes read from the remote store."),
    ("corrupt", "corrupt", "Remote objects that did not verify (removed; the blocks recomputed)."),
    ("gone", "gone", "Remote blocks whose objects were gone at a read (their holder died)."),
    ("errors", "errors", "Remote store failures (not a missing object)."),
    ("down_events", "down events", "Times the remote tier's circuit breaker opened (tier down)."),
    ("probes", "probes", "Probes of the remote store sent while the tier was down."),
    ("republished", "republished", "Blocks published again (the store came back, or a lost segment)."),
)
assert [k for k, _, _ in REMOTE_COUNTER_HELP] == list(REMOTE_COUNTERS)


def _storage_snapshot(g: np.ndarray, cat: dict[str, Any]) -> dict[str, Any]:
    """The ``"storage"`` section of a snapshot (monitors and Prometheus read exactly these)."""
    degraded = bool(g[G.STORAGE_DEGRADED]) and bool(cat.get("degraded_reason"))
    return {
        "path": cat.get("path"),
        "files": int(g[G.STORAGE_FILES]),
        "bytes": int(g[G.STORAGE_BYTES]),
        "capacity_bytes": int(g[G.STORAGE_CAPACITY]),
        "free_bytes": int(g[G.STORAGE_FREE]),
        "o_direct": bool(g[G.STORAGE_O_DIRECT]),
        "o_direct_reason": cat.get("o_direct_reason"),
        "io_errors": int(g[G.STORAGE_IO_ERRORS]),
        "quarantined": int(g[G.STORAGE_QUARANTINED]),
        "spill_paused": bool(g[G.STORAGE_SPILL_PAUSED]),
        "bytes_written": int(g[G.STORAGE_BYTES_WRITTEN]),
        "bytes_read": int(g[G.STORAGE_BYTES_READ]),
        "spills": int(g[G.STORAGE_SPILLS]),
        "promotes": int(g[G.STORAGE_PROMOTES]),
        "evicted_files": int(g[G.STORAGE_EVICTED_FILES]),
        "spills_pending": int(g[G.STORAGE_SPILLS_PENDING]),
        # The gauge is live; the reason and the time come with the catalog (within 0.2 s):
        # degraded once both say so, so a snapshot never shows the state without its reason.
        "state": "degraded" if degraded else "ok",
        "degraded_reason": cat.get("degraded_reason") if degraded else None,
        "degraded_since": cat.get("degraded_since") if degraded else None,
        "lookups_bounded": int(g[G.STORAGE_LOOKUPS_BOUNDED]),
        "stat_timeouts": int(g[G.STORAGE_STAT_TIMEOUTS]),
        "stat_saturated": int(g[G.STORAGE_STAT_SATURATED]),
        "gone": int(g[G.STORAGE_GONE]),
        "spills_dropped": int(g[G.STORAGE_SPILLS_DROPPED]),
        "promote_timeouts": int(g[G.STORAGE_PROMOTE_TIMEOUTS]),
        "degraded_misses": int(g[G.STORAGE_DEGRADED_MISSES]),
        "admit_deferred": int(g[G.STORAGE_ADMIT_DEFERRED]),
        "admitted": int(g[G.STORAGE_ADMITTED]),
        "remote": _remote_snapshot(g, cat.get("remote")),
    }


def _remote_snapshot(g: np.ndarray, cat: dict[str, Any] | None) -> dict[str, Any] | None:
    """The remote tier's section (``storage.remote``): None when it is off. The counters are
    live; ``master``, ``down_since``/``down_reason``, the write policy and the tier order come
    with the catalog."""
    state = int(g[G.REMOTE_STATE])
    if state == RemoteState.OFF:
        return None
    cat = cat or {}
    # The gauge is live; the reason and the time come with the catalog (within 0.2 s): down
    # once both say so, so a snapshot never shows the state without its reason.
    down = state == RemoteState.DOWN and bool(cat.get("down_reason"))
    return {
        "state": "down" if down else "up",
        "down": down,
        "master": cat.get("master"),
        "down_since": cat.get("down_since") if down else None,
        "down_reason": cat.get("down_reason") if down else None,
        "write_policy": cat.get("write_policy"),
        "tier_order": cat.get("tier_order"),
        **{k: int(g[slot]) for k, slot in REMOTE_COUNTERS.items()},
    }

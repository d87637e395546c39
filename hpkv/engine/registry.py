"""The server's registry of clients: their attach (rings and mailbox), their namespaces, their
devices and transfer workers, and their leaving; and the engines' KV-cache files beside the
pool, whose space the pool must leave free.

:class:`Registry` is a part of :class:`hpkv.engine.server.Server` (its base class), not an
object of its own: registering a client or a device touches the index, the storage tier, the
pool, the stats and the workers the server owns, under the server's lock (the control thread
calls it; the supervisor drops clients whose process exited).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from hpkv.common import shm
from hpkv.common.checks import free_bytes
from hpkv.common.numa import device_cpus, format_cpulist
from hpkv.common.pool import PoolFile
from hpkv.common.proc import pid_running
from hpkv.common.ratelimit import RateLimitedLog
from hpkv.common.text import printable
from hpkv.config import Config, format_size
from hpkv.engine.devices import int_arg, validate_cuda, validate_device
from hpkv.engine.index import Index, Namespace
from hpkv.engine.tiers import TierList
from hpkv.engine.workers import WorkerProcess
from hpkv.protocol import wire as P
from hpkv.protocol.errors import HpkvError
from hpkv.protocol.keys import KEY_BYTES
from hpkv.protocol.stats import MAX_NS, MAX_WORKERS, NS_COUNTERS, G, StatsSegment
from hpkv.ring import Doorbell, Ring
from hpkv.runtime.fence import SlotFence

log = logging.getLogger("hpkv.server")

MAX_NAME = 96  # characters of a client-chosen name (printable: see hpkv.common.text)
RETIRE_GRACE_S = 2.0  # a dead owner's pins: time for loads its peers were told to make
_FINGERPRINT_RE = re.compile(rf"[0-9a-f]{{{2 * KEY_BYTES}}}")


@dataclass
class Device:
    """One registered device of one client: its transfer workers and their rings."""

    dev_id: int
    client_id: int
    ns_id: int
    rank: int
    spec: dict[str, Any]
    workers: list[WorkerProcess] = field(default_factory=list)


@dataclass
class Client:
    cid: int
    pid: int
    conn: socket.socket
    req: Ring
    resp: Ring
    mbox_path: str
    mbox: np.ndarray
    name: str = ""
    uid: int = -1
    namespaces: set[int] = field(default_factory=set)
    ranks: set[int] = field(default_factory=set)
    writer_ranks: set[tuple[int, int]] = field(default_factory=set)  # (ns_id, rank) it writes
    devices: list[Device] = field(default_factory=list)
    alive: bool = True
    busy: bool = False  # a hot call (promote) is parked until its IO completes: no other is taken


class Registry:
    """Clients, namespaces, devices and KV-cache files: the server's methods that register and
    drop them (see the module docstring)."""

    # The server's state these methods use (made by Server.__init__ and Server.start).
    cfg: Config
    dir: str
    lock: threading.RLock
    clients: dict[int, Client]
    namespaces_by_fp: dict[str, Namespace]
    workers: list[WorkerProcess]
    tiers: TierList
    index: Index
    pool: PoolFile
    fence: SlotFence
    stats: StatsSegment
    doorbell: Doorbell
    _errors: RateLimitedLog
    _closing: list[Client]
    _detached: dict[int, float]
    _next_cid: int
    _next_dev: int
    _device_registered: bool
    _catalog_dirty: bool
    _last_client_seen: float
    _kv_files: dict[str, int]
    _kv_bytes: int
    _kv_peak: int
    _kv_orphans: dict[str, int]

    if TYPE_CHECKING:

        def _release_later(self, blocks: list, pins: list[bytes], grace: float) -> None: ...
        def _share_with_group(self, target: int | str) -> None: ...

    def _add_client(self, conn: socket.socket, pid: int, name: str, uid: int = -1) -> Client:
        with self.lock:
            cid = self._next_cid
            self._next_cid += 1
        mbox_path = os.path.join(self.dir, f"c{cid}.mbox")
        made: list[Ring] = []
        try:  # out of descriptors, memory or space: nothing half made is left behind
            made.append(
                Ring.create(
                    self.dir, f"c{cid}.req", capacity=P.RING_CAPACITY, role="consumer", doorbell=self.doorbell
                )
            )
            made.append(Ring.create(self.dir, f"c{cid}.resp", capacity=P.RING_CAPACITY, role="producer"))
            mbox = np.frombuffer(shm.create(mbox_path, P.MAILBOX_BYTES), dtype=np.uint8)
        except BaseException as exc:
            for ring in made:
                with contextlib.suppress(Exception):
                    ring.close()
            for leftover in (f"c{cid}.req.ring", f"c{cid}.resp.ring", f"c{cid}.mbox"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.dir, leftover))
            if not isinstance(exc, OSError) or exc.errno in (errno.EMFILE, errno.ENFILE):
                raise  # out of descriptors: the hello refuses it as such
            # A full pool file system (the rings and the mailbox are files beside the pool)
            # refuses this client with the reason; the server and its other clients go on.
            free = free_bytes(self.dir)
            self._errors.log(
                logging.ERROR,
                "client-files",
                "cannot attach pid %d: its rings and mailbox in %s: %s (%d bytes free there)",
                pid,
                self.dir,
                exc.strerror,
                free,
            )
            raise HpkvError(
                f"the hpkv server cannot make this client's rings and mailbox in {self.dir}: "
                f"{exc.strerror} ({free} bytes free there); free space in that file system",
                -(exc.errno or errno.EIO),
            ) from None
        req, resp = made
        c = Client(cid, pid, conn, req, resp, mbox_path, mbox, name=name, uid=uid)
        if uid != os.geteuid():  # a member of HPKV_ALLOW_GROUP: it maps these files too
            for path in (req.path, resp.path, mbox_path, self.pool.path, self.doorbell.path, self.stats.path):
                self._share_with_group(path)
        with self.lock:
            self.clients[cid] = c
            self._last_client_seen = time.monotonic()
            self.stats.glob[G.CLIENTS] = len(self.clients)
            self._catalog_dirty = True
        log.info("client %d attached (pid %d%s)", cid, pid, f", {name}" if name else "")
        self.doorbell.ring()  # make the request loop pick up the new ring
        return c

    def _drop_client(self, c: Client, reason: str) -> None:
        if not c.alive:
            return
        c.alive = False
        # Its devices' workers stop first: then no copy of theirs is running. Its reservations are
        # freed at once (a late save for them is refused by the slot fence); its pins wait for
        # the loads other clients' workers may still make.
        for dev in c.devices:
            for w in dev.workers:
                w.stop()
                self.workers.remove(w)
            self._release_kv_files(dev)
        pins = self.index.take_pins(c.cid)
        retired = self.index.retire(self.index.owned_reservations(c.cid))
        self.tiers.client_gone(c)
        self._release_later(retired, pins, grace=RETIRE_GRACE_S)
        # The request loop may be waiting on the doorbell that watches c.req: it
        # closes the rings itself (_reap_closed_clients), never another thread.
        self._closing.append(c)
        self.doorbell.ring()
        self.clients.pop(c.cid, None)
        for ns_id in c.namespaces:
            if not any(ns_id in o.namespaces for o in self.clients.values()):
                self._detached[ns_id] = time.monotonic()  # reclaimable when an id is needed
        self._last_client_seen = time.monotonic()
        self.stats.glob[G.CLIENTS] = len(self.clients)
        self._catalog_dirty = True
        log.info(
            "client %d (pid %d) detached: %s; released %d pins, %d reservations",
            c.cid,
            c.pid,
            reason,
            len(pins),
            len(retired),
        )

    def _attach_namespace(self, c: Client, msg: dict[str, Any]) -> dict[str, Any]:
        # Everything is checked before anything is registered: a refused call leaves no trace.
        fp = msg["fingerprint"]
        if not isinstance(fp, str) or not _FINGERPRINT_RE.fullmatch(fp):
            raise ValueError(
                f"namespace fingerprint {str(fp)[:80]!r} is not {2 * KEY_BYTES} lowercase "
                f"hex digits; compute it with hpkv.protocol.keys.namespace_fingerprint"
            )
        world = int_arg(msg, "world_size", 1, 62)
        shard = int_arg(msg, "shard_bytes", 1, self.pool.size)
        block_tokens = int_arg(msg, "block_tokens", 0, 1 << 31, default=0)
        rank = int_arg(msg, "rank", 0, world - 1, default=None)
        name = printable(msg.get("name") or fp[:12], MAX_NAME)
        ns = self.namespaces_by_fp.get(fp)
        if ns is None:
            ns_id = self._free_ns_id()
            self.stats.ns[ns_id, :] = 0
            ns = Namespace(
                ns_id,
                name,
                fp,
                world,
                shard,
                block_tokens=block_tokens,
                counters=self.stats.ns[ns_id, :NS_COUNTERS],
            )
            self.tiers.attach(ns)
            self.index.add_namespace(ns)
            self.namespaces_by_fp[fp] = ns
            log.info(
                "namespace %d %s: %s, %d rank(s), %s per shard",
                ns_id,
                fp[:12],
                ns.name,
                world,
                format_size(shard),
            )
        elif (ns.world_size, ns.shard_bytes) != (world, shard):
            raise ValueError(
                f"namespace {fp} is attached with world_size {ns.world_size} and "
                f"shard_bytes {ns.shard_bytes}, not {world} and {shard}"
            )
        self._detached.pop(ns.ns_id, None)
        c.namespaces.add(ns.ns_id)
        if rank is not None:
            c.ranks.add(rank)
            c.writer_ranks.add((ns.ns_id, rank))
        self._catalog_dirty = True
        return {"ok": True, "ns_id": ns.ns_id, "slot_bytes": ns.slot_bytes, "slot_unit": P.SLOT_UNIT}

    def _free_ns_id(self) -> int:
        """The lowest unused namespace id; when all are taken, the one detached longest ago
        (no client attached) is released: its DRAM blocks are dropped, its files stay."""
        used = set(self.index.namespaces)
        for i in range(MAX_NS):
            if i not in used:
                return i
        for ns_id, since in sorted(self._detached.items(), key=lambda kv: kv[1]):
            ns = self.index.namespaces.get(ns_id)
            if ns is None or any(ns_id in o.namespaces for o in self.clients.values()):
                self._detached.pop(ns_id, None)
                continue
            if not self.index.drop_namespace(ns):
                continue  # pinned, reserved or in IO: not now
            self.tiers.detach(ns)
            del self.namespaces_by_fp[ns.fingerprint]
            self._detached.pop(ns_id, None)
            log.info(
                "namespace %d %s (%s) released: no client attached for %.0fs and its id is needed",
                ns_id,
                ns.fingerprint[:12],
                ns.name,
                time.monotonic() - since,
            )
            return ns_id
        raise ValueError(f"{MAX_NS} namespaces are attached by live clients (or busy); no id is free")

    def _register_device(self, c: Client, msg: dict[str, Any]) -> dict[str, Any]:
        ns = self.index.ns(int_arg(msg, "ns_id", 0, MAX_NS - 1))
        rank = int_arg(msg, "rank", 0, ns.world_size - 1, default=0)
        if "cuda" in msg:  # a GPU's KV cache (CUDA IPC), or its host stand-in
            layout = validate_cuda(msg, ns.slot_bytes, allowed_uids={os.geteuid(), c.uid})
        else:
            layout = validate_device(msg, ns.slot_bytes, allowed_uids={os.geteuid(), c.uid})
        n_workers = self.cfg["HPKV_NUM_TRANSFER_WORKERS"]
        device = printable(msg.get("device", "cpu"), MAX_NAME)
        numa = msg.get("numa_node")
        numa = numa if isinstance(numa, int) and not isinstance(numa, bool) and -1 <= numa < 4096 else None
        if MAX_WORKERS - len(self.workers) < n_workers:
            raise ValueError(f"no room for {n_workers} more workers (at most {MAX_WORKERS})")
        dev_id = self._next_dev
        self._next_dev += 1
        node, cpus = device_cpus(device, numa)
        spec = dict(layout)
        spec.update(
            pool=self.pool.path,
            fence=self.fence.path,
            slot_bytes=ns.slot_bytes,
            numa_node=node,
            cpus=cpus,
            stats_dir=self.dir,
            log_level=self.cfg["HPKV_LOG_LEVEL"],
        )
        dev = Device(dev_id, c.cid, ns.ns_id, rank, spec)
        answer = []
        for j in range(n_workers):
            slot = self._free_worker_slot()
            base = f"c{c.cid}.d{dev_id}.w{j}"
            w = WorkerProcess.start_transfer(
                self.dir, base, slot, spec, device=device, stats=self.stats, fence=self.fence
            )
            if c.uid != os.geteuid():
                for name in (w.req_name, w.resp_name):
                    self._share_with_group(os.path.join(self.dir, name + ".ring"))
                self._share_with_group(w.jobs_path)
            dev.workers.append(w)
            self.workers.append(w)
            answer.append({"req": w.req_name, "resp": w.resp_name, "jobs": w.jobs_path})
        c.devices.append(dev)
        c.writer_ranks.add((ns.ns_id, rank))
        self._count_kv_files(dev)
        self._device_registered = True  # the pool is about to be used: warm it in earnest
        self._catalog_dirty = True
        log.info(
            "client %d registered device %s (rank %d, NUMA node %s, CPUs %s): %d transfer worker(s)",
            c.cid,
            device,
            dev.rank,
            node,
            format_cpulist(cpus),
            n_workers,
        )
        return {"ok": True, "device_id": dev_id, "workers": answer}

    # ================================================================ engines' KV-cache files
    def _kv_space_kept(self) -> int:
        """Bytes of the pool's file system the pool must leave free: the KV-cache files of
        engines that registered before and are not registered now (a vLLM restarted after
        Ctrl-C needs its file's space again; the pool warming meanwhile must not take it)."""
        return max(self._kv_peak - self._kv_bytes, 0)

    def _count_kv_files(self, dev: Device) -> None:
        for region in dev.spec["regions"]:
            path = region["path"]
            if os.path.dirname(path) == self.dir and P.device_file_pid(os.path.basename(path)) is not None:
                try:
                    self._kv_files[path] = os.stat(path).st_size
                except OSError:
                    self._kv_files[path] = region["size"]
                self._kv_orphans.pop(path, None)  # its engine came back
        self._kv_bytes = sum(self._kv_files.values())
        self._kv_peak = max(self._kv_peak, self._kv_bytes)
        self._check_space(f"when client {dev.client_id} registered its KV cache")

    def _release_kv_files(self, dev: Device) -> None:
        """The device's engine detached: its KV-cache file is removed once its process is gone
        (vLLM's shutdown SIGKILLs its workers, which cannot remove it themselves; the
        connection closes before the process is reaped, so that may be later)."""
        for region in dev.spec["regions"]:
            path = region["path"]
            if self._kv_files.pop(path, None) is None:
                continue
            self._kv_bytes = sum(self._kv_files.values())
            pid = P.device_file_pid(os.path.basename(path))
            if pid is not None:
                self._kv_orphans[path] = pid
        if self._kv_orphans:
            self._remove_orphan_kv_files()

    def _remove_orphan_kv_files(self) -> None:
        for path, pid in list(self._kv_orphans.items()):
            if pid_running(pid):
                continue
            del self._kv_orphans[path]
            try:
                size = os.stat(path).st_size
                os.unlink(path)
            except FileNotFoundError:
                continue  # it removed its file itself
            log.info(
                "removed the KV-cache file %s (%s) of engine process %d, which has exited",
                path,
                format_size(size),
                pid,
            )

    def _check_space(self, when: str) -> None:
        """Warn when the pool cannot be fully allocated beside the engines' KV-cache files."""
        pool = self.pool
        free = free_bytes(self.dir)
        to_reserve = pool.size - pool.backed  # at most
        kept = self._kv_space_kept()
        engines = self._kv_bytes
        if free - kept >= to_reserve:
            return
        short = to_reserve - (free - kept)
        log.warning(
            "%s: the file system of %s has %s free, but the pool still needs up to %s to be "
            "fully allocated (HPKV_KV_MEM_POOL_SIZE %s) beside engines' KV-cache files (%s "
            "registered now, %s kept free for engines that return): the pool stops growing "
            "about %s short. Enlarge that file system or lower HPKV_KV_MEM_POOL_SIZE by that much",
            when,
            self.dir,
            format_size(free),
            format_size(to_reserve),
            format_size(pool.size),
            format_size(engines),
            format_size(kept),
            format_size(short),
        )

    def _free_worker_slot(self) -> int:
        used = {w.slot for w in self.workers}
        for i in range(MAX_WORKERS):
            if i not in used:
                return i
        raise ValueError(f"more than {MAX_WORKERS} workers")

"""The hpkv server: owns the pool, the index, the stats segment and the worker processes.

One server per pool directory, guaranteed by an flock on ``server.lock`` (the
kernel releases it when the holder dies, so a lock left by a killed server is
simply taken over). Threads:

* the *request loop* (main thread) sleeps on the doorbell shared by every
  client's request ring and answers hot calls (lookup, reserve, commit, pin,
  unpin) through the clients' mailboxes;
* the *control thread* accepts Unix-socket connections and serves the rare
  JSON calls (hello, namespace, register_device, clear, stats, shutdown); a
  closed socket means the client is gone and its pins and reservations go too;
* the *supervisor thread* restarts dead workers (their in-flight and queued jobs
  complete as failures), publishes gauges, and stops an idle auto-spawned server.

The index is touched under one lock; hot calls hold it for one request.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpkv.config import Config, ConfigError, check_runtime, format_size
from hpkv import shm
from hpkv.engine import protocol as P
from hpkv.proc import pid_alive
from hpkv.engine.index import Index, Namespace, NsCounter, NoSuchNamespace
from hpkv.engine.keys import KEY_BYTES
from hpkv.engine.logs import setup_logging
from hpkv.engine.pool import PoolFile
from hpkv.engine.stats import MAX_NS, MAX_WORKERS, NS_COUNTERS, G, StatsSegment
from hpkv.engine.workers import WorkerProcess, device_cpus
from hpkv.io_workers.tier import StorageTier
from hpkv.ring import Doorbell, Ring, RingError

log = logging.getLogger("hpkv.server")

LOCK_RETRY_S = 0.5
EXIT_ALREADY_SERVED = 3   # `hpkv serve`: another server holds the pool directory


class AlreadyServed(RuntimeError):
    def __init__(self, directory: str, pid: int | None):
        self.pid = pid
        who = f"pid {pid}" if pid else "another process"
        super().__init__(f"the pool directory {directory} is already served by {who}; "
                         f"stop it first (kill {pid or '<pid>'}) or use another HPKV_SHARE_MEM_FILE_PATH")


def read_lock_pid(directory: str) -> int | None:
    try:
        with open(os.path.join(directory, P.LOCK_FILE)) as f:
            return int(f.read().strip() or 0) or None
    except (OSError, ValueError):
        return None


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
    namespaces: set[int] = field(default_factory=set)
    ranks: set[int] = field(default_factory=set)
    pins: Counter = field(default_factory=Counter)
    devices: list[Device] = field(default_factory=list)
    alive: bool = True
    busy: bool = False   # a hot call (promote) is parked until its IO completes: no other is taken


class Server:
    def __init__(self, cfg: Config, auto: bool = False):
        self.cfg = cfg
        self.dir = cfg.pool_dir
        self.auto = auto
        self.idle_exit = cfg["HPKV_SERVER_IDLE_EXIT"] if auto else 0.0
        self.lock = threading.RLock()
        self.stop_event = threading.Event()   # a stop was requested: drain spills, then shut down
        self.down = threading.Event()         # shut down: the control and supervisor threads end
        self.stopping = False                 # draining: new clients are refused
        self._stop_waiters: list[socket.socket] = []   # `hpkv stop` connections awaiting the outcome
        self.stop_outcome: dict[str, Any] = {}
        self.clients: dict[int, Client] = {}
        self.namespaces_by_fp: dict[str, Namespace] = {}
        self.workers: list[WorkerProcess] = []
        self._closing: list[Client] = []
        self._next_cid = 1
        self._next_dev = 1
        self._lock_fd: int | None = None
        self._catalog_dirty = True
        self._last_client_seen = time.monotonic()
        self.storage: StorageTier | None = None

    # ================================================================ life cycle
    def acquire_lock(self) -> None:
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        path = os.path.join(self.dir, P.LOCK_FILE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        # `hpkv status` and hpkv-top probe the lock with a shared flock for microseconds:
        # retry briefly, so a monitor never makes a starting server give up.
        deadline = time.monotonic() + LOCK_RETRY_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise AlreadyServed(self.dir, read_lock_pid(self.dir)) from None
                time.sleep(0.01)
        previous = read_lock_pid(self.dir)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd
        if previous and previous != os.getpid():
            log.warning("took over the pool directory %s from pid %s, which exited without "
                        "cleaning up", self.dir, previous)
        self._remove_owned_files(startup=True)

    def _remove_owned_files(self, startup: bool) -> None:
        removed = []
        for name in os.listdir(self.dir):
            engine_pid = P.device_file_pid(name)
            if (name in (P.POOL_FILE, P.SOCKET_FILE, "stats") or name.endswith(P.OWNED_SUFFIXES)
                    or ".tmp" in name or (engine_pid is not None and not pid_alive(engine_pid))):
                try:
                    os.unlink(os.path.join(self.dir, name))
                    removed.append(name)
                except FileNotFoundError:
                    pass
        if removed and startup:
            log.warning("removed %d files left by a previous server in %s: %s", len(removed),
                        self.dir, ", ".join(sorted(removed)[:8]) + (" ..." if len(removed) > 8 else ""))

    def start(self) -> None:
        if self.auto:
            # Spawned by an engine process that may be pinned to its compute cores
            # (vLLM's CPU worker is): don't inherit that, place our workers ourselves.
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, range(os.cpu_count() or 1))
        for w in check_runtime(self.cfg):
            log.warning("%s", w)
        self.acquire_lock()
        size = self.cfg.pool_size
        t0 = time.monotonic()
        self.pool = PoolFile.create(os.path.join(self.dir, P.POOL_FILE), size)
        log.info("pool %s: %s created in %.2fs; its memory is allocated and locked in the background",
                 self.pool.path, format_size(size), time.monotonic() - t0)
        self.stats = StatsSegment.create(self.dir)
        self.pool.warm_in_background(lock=True, progress=self._pool_warm_progress)
        self.index = Index(size, storage_enabled=self.cfg.storage_path is not None)
        self.stats.glob[G.POOL_CAPACITY] = size
        self.doorbell = Doorbell.create(self.dir, "server")
        if self.cfg.storage_path is not None:
            self.storage = StorageTier(self.cfg, self.dir, self.stats, self.index, self.lock,
                                       self.doorbell, self.pool.path, self._answer_parked)
            self.workers += self.storage.start(list(range(self.cfg["HPKV_NUM_IO_WORKERS"])))
        from hpkv.engine.metrics import start_metrics  # HPKV_METRICS_PORT; up before clients connect
        self.metrics = start_metrics(self.cfg)
        sock_path = os.path.join(self.dir, P.SOCKET_FILE)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(sock_path)
        os.chmod(sock_path, 0o600)
        self.listener.listen(64)
        self._publish_catalog()
        threading.Thread(target=self._control_loop, name="control", daemon=True).start()
        threading.Thread(target=self._supervisor_loop, name="supervisor", daemon=True).start()
        log.info("hpkv server %d serving %s (pool %s, storage %s)%s", os.getpid(), self.dir,
                 format_size(size), self.cfg.storage_path or "disabled",
                 f", idle exit after {self.idle_exit:g}s" if self.idle_exit else "")

    def _pool_warm_progress(self, done: int) -> None:
        self.stats.glob[G.POOL_WARM] = done
        if done >= self.pool.size:
            self._catalog_dirty = True    # pool_locked is known now

    def shutdown(self) -> None:
        self.stop_event.set()
        self.down.set()
        if hasattr(self, "pool"):
            self.pool.stop_warming()
        for w in list(self.workers):
            w.stop()
        if self.storage is not None:
            self.storage.shutdown()
        with self.lock:
            for c in list(self.clients.values()):
                self._drop_client(c, reason="server shutdown")
        self._reap_closed_clients()
        # After a failed start some of these were never made.
        for name in ("listener", "doorbell", "stats", "pool"):
            obj = getattr(self, name, None)
            try:
                if obj is not None:
                    obj.close()
            except Exception as exc:  # noqa: BLE001 - best effort on the way out
                log.debug("closing the %s: %s", name, exc)
        self._remove_owned_files(startup=False)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.dir, P.SPAWN_LOCK_FILE))
        if self._lock_fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.dir, P.LOCK_FILE))
            os.close(self._lock_fd)
            self._lock_fd = None
        log.info("hpkv server %d stopped; pool, rings and stats removed", os.getpid())

    def serve_forever(self) -> None:
        """Run the request loop until SIGTERM/SIGINT, a shutdown call or idle exit, then write
        the pending spills (bounded by HPKV_STOP_DRAIN_TIMEOUT) and tell `hpkv stop` how it went."""
        while not self.stop_event.is_set():
            self._serve_round(0.2)
        self.stopping = True
        self.stop_outcome = self._drain_spills()
        self._answer_stop_waiters()

    def _serve_round(self, timeout: float) -> None:
        with self.lock:
            clients = [c for c in self.clients.values() if c.alive]
        try:
            self.doorbell.wait(timeout=timeout)
        except InterruptedError:
            return
        for c in clients:
            self._drain(c)
        if self.storage is not None:
            self.storage.poll()
        if self._closing:
            self._reap_closed_clients()

    def _drain_spills(self) -> dict[str, Any]:
        """Keep serving until every queued or running write-through spill is done, or the
        drain timeout passes; attached engines keep their hits meanwhile."""
        if self.storage is None:
            return {"pending": 0, "written": 0, "dropped": 0, "seconds": 0.0}
        timeout = float(self.cfg["HPKV_STOP_DRAIN_TIMEOUT"])
        t0 = time.monotonic()
        with self.lock:
            pending = first = self.storage.pending_spills()
        written0 = int(self.stats.glob[G.STORAGE_SPILLS])
        if pending:
            log.info("stopping: writing %d pending block(s) to storage first (at most %gs, "
                     "HPKV_STOP_DRAIN_TIMEOUT)", pending, timeout)
        while pending and time.monotonic() - t0 < timeout:
            self._serve_round(0.05)
            with self.lock:
                pending = self.storage.pending_spills()
        seconds = time.monotonic() - t0
        written = int(self.stats.glob[G.STORAGE_SPILLS]) - written0
        if pending:
            log.warning("stopping: %d block(s) were not written to storage: HPKV_STOP_DRAIN_TIMEOUT=%gs "
                        "expired (%d file(s) written meanwhile); they will be recomputed when needed",
                        pending, timeout, written)
        elif first:
            log.info("stopping: %d pending block(s) written to storage in %.2fs (%d file(s))",
                     first, seconds, written)
        return {"pending": first, "written": written, "dropped": pending, "seconds": round(seconds, 3)}

    def _answer_stop_waiters(self) -> None:
        line = json.dumps({"ok": True, "stopped": True, **self.stop_outcome}).encode() + b"\n"
        with self.lock:
            waiters, self._stop_waiters = self._stop_waiters, []
        for conn in waiters:
            with contextlib.suppress(OSError):
                conn.settimeout(1.0)
                conn.sendall(line)

    def _reap_closed_clients(self) -> None:
        with self.lock:
            closing, self._closing = self._closing, []
        for c in closing:
            for ring in (c.req, c.resp):
                ring.close()
            try:
                os.unlink(c.mbox_path)
            except FileNotFoundError:
                pass

    # ================================================================ hot path
    def _drain(self, c: Client) -> None:
        while c.alive and not c.busy:
            try:
                d = c.req.try_pop()
            except RingError:
                return
            if d is None:
                return
            with self.lock:
                status, a0, a1 = self._handle(c, d)
            self.stats.glob[G.REQUESTS] += 1
            if status is None:       # parked until its IO completes (_answer_parked)
                continue
            if status < 0:
                self.stats.glob[G.ERRORS] += 1
            try:
                c.resp.try_push(P.COMPLETION, d.seq, a0, a1, status=status)
            except RingError as exc:
                log.info("client %d: cannot answer (%s)", c.cid, exc)

    def _keys(self, c: Client, n: int) -> list[bytes]:
        if n > P.MAX_KEYS_PER_CALL:
            raise OverflowError
        return c.mbox[: n * KEY_BYTES].view(f"V{KEY_BYTES}").tolist()

    def _answer_parked(self, c: Client, seq: int, rows: np.ndarray) -> None:
        """The storage tier finished a parked promote: answer it like a pin (request loop)."""
        c.busy = False
        if not c.alive:
            return
        c.mbox[P.MAILBOX_HALF: P.MAILBOX_HALF + rows.nbytes] = rows.reshape(-1).view(np.uint8)
        try:
            c.resp.try_push(P.COMPLETION, seq, rows.shape[1], 0, status=0)
        except RingError as exc:
            log.info("client %d: cannot answer (%s)", c.cid, exc)
        self.doorbell.ring()  # requests it queued meanwhile are taken on the next round

    def _handle(self, c: Client, d) -> tuple[int | None, int, int]:
        """One hot call; returns (status, a0, a1) for the completion, status None when parked."""
        kind, ns_id, n = d.kind, d.a0, d.a1
        try:
            idx = self.index
            out = c.mbox[P.MAILBOX_HALF:]
            if kind == P.LOOKUP:
                ns = idx.ns(ns_id)
                if n > P.MAX_KEYS_PER_CALL:
                    raise OverflowError
                # The hot path: keys read and tiers written in place, in C.
                hit = idx.present.prefix(c.mbox[: n * KEY_BYTES], n, out[:n])
                tiers = out[:hit].tolist()
                if hit < n and self.storage is not None:   # files the index has not seen yet
                    hit = self.storage.extend_lookup(ns, self._keys(c, n), hit, tiers)
                    out[:hit] = np.frombuffer(bytes(tiers), np.uint8)
                idx.count_lookup(ns, n, tiers)
                return 0, hit, 0
            keys = self._keys(c, n)
            if kind == P.RESERVE:
                slots = idx.reserve(ns_id, keys, owner=c.cid)
                flat = slots.reshape(-1)
                out[: flat.nbytes] = flat.view(np.uint8)
                return 0, slots.shape[1], 0
            if kind == P.COMMIT:
                if d.flags & P.FLAG_ABORT:
                    idx.abort(keys)
                    return 0, 0, 0
                ready = idx.commit(ns_id, keys, rank=d.a2)
                if ready and self.storage is not None:
                    self.storage.spill(ready)               # write-through
                return 0, len(ready), 0
            if kind == P.PIN:
                idx.ns(ns_id)
                slots_per_key = idx.pin(keys)
                world = idx.ns(ns_id).world_size
                arr = np.full((n, world), -1, np.int64)
                for i, s in enumerate(slots_per_key):
                    if s is not None:
                        arr[i] = s
                    c.pins[keys[i]] += 1
                idx.ns(ns_id).counters[NsCounter.LOADS_DRAM] += sum(s is not None for s in slots_per_key)
                if self.storage is not None:
                    self.storage.touch(keys)
                out[: arr.nbytes] = arr.reshape(-1).view(np.uint8)
                return 0, world, 0
            if kind == P.PROMOTE:
                ns = idx.ns(ns_id)
                if self.storage is None:
                    rows = np.full((n, ns.world_size), -1, np.int64)
                    for i, s in enumerate(idx.pin(keys)):
                        if s is not None:
                            rows[i] = s
                            c.pins[keys[i]] += 1
                else:
                    rows = self.storage.promote(c, d.seq, ns, keys, timeout=d.a2 / 1000.0)
                    if rows is None:
                        c.busy = True
                        return None, 0, 0
                out[: rows.nbytes] = rows.reshape(-1).view(np.uint8)
                return 0, ns.world_size, 0
            if kind == P.UNPIN:
                held = [k for k in keys if c.pins.get(k, 0) > 0]   # never another client's pin
                idx.unpin(held)
                for k in held:
                    c.pins[k] -= 1
                    if c.pins[k] <= 0:
                        del c.pins[k]
                return 0, 0, 0
            return P.E_BAD_REQUEST, 0, 0
        except NoSuchNamespace:
            return P.E_NO_NAMESPACE, 0, 0
        except OverflowError:
            return P.E_TOO_MANY_KEYS, 0, 0
        finally:
            self.stats.glob[G.POOL_USED] = idx.alloc.used
            self.stats.glob[G.POOL_PINNED] = idx.pinned_bytes
            self.stats.glob[G.BLOCKS] = len(idx.blocks)

    # ================================================================ control path
    def _control_loop(self) -> None:
        import selectors
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ, None)
        buffers: dict[socket.socket, bytes] = {}
        while not self.down.is_set():
            try:
                events = sel.select(timeout=0.5)
            except (OSError, ValueError):
                return
            for key, _ in events:
                if key.fileobj is self.listener:
                    try:
                        conn, _ = self.listener.accept()
                    except OSError:
                        continue
                    conn.setblocking(False)
                    buffers[conn] = b""
                    sel.register(conn, selectors.EVENT_READ, {"client": None})
                    continue
                conn = key.fileobj
                state = key.data
                try:
                    chunk = conn.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    chunk = b""
                if not chunk:
                    sel.unregister(conn)
                    buffers.pop(conn, None)
                    if state["client"] is not None:
                        with self.lock:
                            self._drop_client(state["client"], reason="connection closed")
                    conn.close()
                    continue
                buffers[conn] += chunk
                while b"\n" in buffers[conn]:
                    line, buffers[conn] = buffers[conn].split(b"\n", 1)
                    reply = self._control_call(conn, state, line)
                    if reply is None:     # answered later (a `hpkv stop` waiting for the outcome)
                        continue
                    try:
                        conn.setblocking(True)
                        conn.sendall(json.dumps(reply).encode() + b"\n")
                        conn.setblocking(False)
                    except OSError:
                        pass

    def _control_call(self, conn: socket.socket, state: dict, line: bytes) -> dict[str, Any] | None:
        try:
            msg = json.loads(line)
            op = msg.get("op")
            if op == "hello" and self.stopping:
                return {"ok": False, "error": "the hpkv server is stopping (writing pending spills); "
                                             "connect again once it has exited"}
            if op == "hello":
                c = self._add_client(conn, int(msg.get("pid", 0)), str(msg.get("name", "")))
                state["client"] = c
                return {"ok": True, "client_id": c.cid, "req": c.req.name, "resp": c.resp.name,
                        "mailbox": c.mbox_path, "pool": self.pool.path, "pool_size": self.pool.size,
                        "server_pid": os.getpid(), "storage": self.cfg.storage_path}
            if op == "stats":
                with self.lock:
                    if self._catalog_dirty:
                        self._publish_catalog()
                return {"ok": True, "stats": self.stats.snapshot()}
            if op == "shutdown":
                log.info("shutdown requested by pid %s", msg.get("pid"))
                if msg.get("wait"):
                    with self.lock:
                        if self.stop_outcome:        # already drained: answer now
                            return {"ok": True, "stopped": True, **self.stop_outcome}
                        self._stop_waiters.append(conn)
                self.stop_event.set()
                self.doorbell.ring()
                return None if msg.get("wait") else {"ok": True}
            c = state["client"]
            if c is None:
                return {"ok": False, "error": f"call 'hello' before {op!r}"}
            with self.lock:
                if op == "namespace":
                    return self._attach_namespace(c, msg)
                if op == "register_device":
                    return self._register_device(c, msg)
                if op == "clear":
                    n = self.index.clear_namespace(int(msg["ns_id"]))
                    log.info("client %d cleared namespace %s from the DRAM tier: %d blocks",
                             c.cid, msg["ns_id"], n)
                    return {"ok": True, "dropped": n}
            return {"ok": False, "error": f"unknown op {op!r}"}
        except NoSuchNamespace as exc:
            return {"ok": False, "error": str(exc)}
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("bad control call %r: %s", line[:200], exc)
            return {"ok": False, "error": f"bad request: {exc}"}
        except Exception as exc:  # noqa: BLE001 - a bad call must not kill the control thread
            log.exception("control call failed")
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}

    def _add_client(self, conn: socket.socket, pid: int, name: str) -> Client:
        with self.lock:
            cid = self._next_cid
            self._next_cid += 1
        req = Ring.create(self.dir, f"c{cid}.req", capacity=P.RING_CAPACITY,
                          role="consumer", doorbell=self.doorbell)
        resp = Ring.create(self.dir, f"c{cid}.resp", capacity=P.RING_CAPACITY, role="producer")
        mbox_path = os.path.join(self.dir, f"c{cid}.mbox")
        mbox = np.frombuffer(shm.create(mbox_path, P.MAILBOX_BYTES), dtype=np.uint8)
        c = Client(cid, pid, conn, req, resp, mbox_path, mbox, name=name)
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
        if c.pins:
            keys = [k for k, n in c.pins.items() for _ in range(n)]
            self.index.unpin(keys)
        aborted = self.index.abort_owner(c.cid)
        if self.storage is not None:
            self.storage.client_gone(c)
        for dev in c.devices:
            for w in dev.workers:
                w.stop()
                self.workers.remove(w)
            for region in dev.spec["regions"]:   # an engine's KV cache file, if it died without removing it
                name = os.path.basename(region["path"])
                pid = P.device_file_pid(name)
                if pid is not None and os.path.dirname(region["path"]) == self.dir and not pid_alive(pid):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(region["path"])
        # The request loop may be waiting on the doorbell that watches c.req: it
        # closes the rings itself (_reap_closed_clients), never another thread.
        self._closing.append(c)
        self.doorbell.ring()
        self.clients.pop(c.cid, None)
        self._last_client_seen = time.monotonic()
        self.stats.glob[G.CLIENTS] = len(self.clients)
        self._catalog_dirty = True
        log.info("client %d (pid %d) detached: %s; released %d pins, %d reservations",
                 c.cid, c.pid, reason, sum(c.pins.values()), aborted)

    def _attach_namespace(self, c: Client, msg: dict[str, Any]) -> dict[str, Any]:
        fp = str(msg["fingerprint"])
        world = int(msg["world_size"])
        shard = int(msg["shard_bytes"])
        if world < 1 or world > 62 or shard <= 0:
            raise ValueError(f"world_size {world} must be 1..62 and shard_bytes {shard} > 0")
        ns = self.namespaces_by_fp.get(fp)
        if ns is None:
            ns_id = len(self.namespaces_by_fp)
            if ns_id >= MAX_NS:
                raise ValueError(f"more than {MAX_NS} namespaces attached")
            ns = Namespace(ns_id, str(msg.get("name", fp[:12])), fp, world, shard,
                           block_tokens=int(msg.get("block_tokens", 0)),
                           counters=self.stats.ns[ns_id, :NS_COUNTERS])
            self.namespaces_by_fp[fp] = ns
            self.index.add_namespace(ns)
            if self.storage is not None:
                self.storage.attach_namespace(ns)
            log.info("namespace %d %s: %s, %d rank(s), %s per shard", ns_id, fp[:12], ns.name,
                     world, format_size(shard))
        elif (ns.world_size, ns.shard_bytes) != (world, shard):
            raise ValueError(f"namespace {fp} is attached with world_size {ns.world_size} and "
                             f"shard_bytes {ns.shard_bytes}, not {world} and {shard}")
        c.namespaces.add(ns.ns_id)
        if "rank" in msg:
            c.ranks.add(int(msg["rank"]))
        self._catalog_dirty = True
        return {"ok": True, "ns_id": ns.ns_id, "slot_bytes": ns.slot_bytes, "slot_unit": P.SLOT_UNIT}

    def _register_device(self, c: Client, msg: dict[str, Any]) -> dict[str, Any]:
        ns = self.index.ns(int(msg["ns_id"]))
        n_workers = self.cfg["HPKV_NUM_TRANSFER_WORKERS"]
        dev_id = self._next_dev
        self._next_dev += 1
        node, cpus = device_cpus(msg.get("device", "cpu"), msg.get("numa_node"))
        spec = {k: msg[k] for k in ("regions", "layer_bases", "block_stride", "page_bytes",
                                    "num_blocks")}
        spec.update(pool=self.pool.path, slot_bytes=ns.slot_bytes, numa_node=node, cpus=cpus,
                    stats_dir=self.dir, log_level=self.cfg["HPKV_LOG_LEVEL"])
        dev = Device(dev_id, c.cid, ns.ns_id, int(msg.get("rank", 0)), spec)
        answer = []
        for j in range(n_workers):
            slot = self._free_worker_slot()
            base = f"c{c.cid}.d{dev_id}.w{j}"
            w = WorkerProcess.start_transfer(self.dir, base, slot, spec, device=str(msg.get("device", "cpu")),
                                             stats=self.stats)
            dev.workers.append(w)
            self.workers.append(w)
            answer.append({"req": w.req_name, "resp": w.resp_name, "jobs": w.jobs_path})
        c.devices.append(dev)
        self._catalog_dirty = True
        log.info("client %d registered device %s (rank %d, NUMA node %s, CPUs %s): %d transfer worker(s)",
                 c.cid, msg.get("device", "cpu"), dev.rank, node, _cpu_list(cpus), n_workers)
        return {"ok": True, "device_id": dev_id, "workers": answer}

    def _free_worker_slot(self) -> int:
        used = {w.slot for w in self.workers}
        for i in range(MAX_WORKERS):
            if i not in used:
                return i
        raise ValueError(f"more than {MAX_WORKERS} workers")

    # ================================================================ supervision
    def _supervisor_loop(self) -> None:
        while not self.down.wait(0.2):
            try:
                self._supervise_once()
            except Exception:  # noqa: BLE001 - supervision must keep running
                log.exception("supervisor step failed")

    def _supervise_once(self) -> None:
        now = time.time_ns()
        self.stats.header[4] = now  # heartbeat
        with self.lock:
            for w in list(self.workers):
                if not w.poll_dead():
                    continue
                if w.kind == "io" and self.storage is not None:
                    self.storage.worker_died(w)    # the request loop recovers and restarts it
                else:
                    self.stats.glob[G.WORKER_RESTARTS] += 1
                    w.fail_pending_and_restart()
                    self._catalog_dirty = True
            for c in list(self.clients.values()):
                if c.alive and not pid_alive(c.pid):
                    self._drop_client(c, reason=f"process {c.pid} exited")
            if self.storage is not None and self.storage.catalog_dirty:
                self.storage.catalog_dirty = False
                self._catalog_dirty = True
            if self._catalog_dirty:
                self._publish_catalog()
            idle = not self.clients and self.idle_exit > 0 and not self.stop_event.is_set() and \
                time.monotonic() - self._last_client_seen > self.idle_exit
        if idle:
            log.info("no client for %.0fs (HPKV_SERVER_IDLE_EXIT): exiting", self.idle_exit)
            self.stop_event.set()
            self.doorbell.ring()

    def _publish_catalog(self) -> None:
        self._catalog_dirty = False
        self.stats.write_catalog({
            "server": {"pool_dir": self.dir, "pool_file": self.pool.path,
                       "storage": self.cfg.storage_path, "auto": self.auto,
                       "pool_locked": self.pool.locked},
            "namespaces": [{"id": ns.ns_id, "name": ns.name, "fingerprint": ns.fingerprint,
                            "world_size": ns.world_size, "shard_bytes": ns.shard_bytes,
                            "block_tokens": ns.block_tokens}
                           for ns in self.namespaces_by_fp.values()],
            "workers": [w.describe() for w in self.workers],
            "clients": [{"id": c.cid, "pid": c.pid, "name": c.name,
                         "namespaces": sorted(c.namespaces), "ranks": sorted(c.ranks)}
                        for c in self.clients.values()],
            "rings": [{"name": r.name, "capacity": r.capacity}
                      for c in self.clients.values() for r in (c.req, c.resp)],
            "storage": self.storage.describe() if self.storage is not None else {"path": None},
        })


def _cpu_list(cpus: list[int]) -> str:
    return ",".join(map(str, cpus))


class ReadyPipe:
    """The auto-spawn's status pipe (``--ready-fd``): one line, ``ready PID``, ``served PID``
    (another server holds the directory) or ``error REASON``; a no-op without a pipe."""

    def __init__(self, fd: int | None):
        self.fd = fd

    def send(self, line: str) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.write(self.fd, line.replace("\n", " ").encode() + b"\n")
            os.close(self.fd)
        self.fd = None


def detach() -> None:
    """Leave the caller's process tree: fork, the parent exits at once, the child goes on
    in a session of its own, re-parented to init. An engine that kills its descendants at
    shutdown (vLLM does, with SIGKILL) then no longer reaches this server."""
    if os.fork() > 0:
        os._exit(0)
    with contextlib.suppress(OSError):
        os.setsid()


def serve(cfg: Config, auto: bool = False, log_level: str | None = None,
          ready: ReadyPipe | None = None) -> int:
    """``hpkv serve``: run the server in the foreground until told to stop."""
    ready = ready or ReadyPipe(None)
    setup_logging(cfg.pool_dir, log_level or cfg["HPKV_LOG_LEVEL"])
    server = Server(cfg, auto=auto)
    try:
        server.start()
    except AlreadyServed as exc:
        log.info("%s", exc)
        ready.send(f"served {exc.pid or 0}")
        return EXIT_ALREADY_SERVED
    except Exception as exc:  # noqa: BLE001 - every start-up failure is logged and reported
        if isinstance(exc, (ConfigError, OSError)):
            log.error("cannot start: %s", exc)
        else:
            log.exception("cannot start: %s", exc)
        ready.send(f"error {exc}")
        if server._lock_fd is not None:
            server.shutdown()
        return 1

    def on_signal(signum, _frame):
        log.info("received %s: stopping", signal.Signals(signum).name)
        server.stop_event.set()
        server.doorbell.ring()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if auto:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    ready.send(f"ready {os.getpid()}")
    try:
        server.serve_forever()
    finally:
        server.shutdown()
    return 0

"""The hpkv server: owns the pool, the index, the stats segment and the worker processes.

One server per pool directory, guaranteed by an flock on ``server.lock`` (the
kernel releases it when the holder dies, so a lock left by a killed server is
simply taken over). Threads:

* the *request loop* (main thread) sleeps on the doorbell shared by every
  client's request ring and answers hot calls (lookup, reserve, commit, pin,
  unpin) through the clients' mailboxes (this module);
* the *control thread* accepts Unix-socket connections (:mod:`hpkv.engine.control`) and
  serves the rare JSON calls (hello, namespace, register_device, clear, events, stats, shutdown:
  :mod:`hpkv.engine.calls`, registering through :mod:`hpkv.engine.registry`); a closed
  socket means the client is gone and its pins and reservations go too;
* the *supervisor thread* restarts dead workers (their in-flight and queued jobs
  complete as failures), publishes gauges, and stops an idle auto-spawned server
  (:mod:`hpkv.engine.supervisor`).

The index is touched under one lock; hot calls hold it for one request.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpkv.common.checks import check_runtime
from hpkv.common.pool import PoolFile
from hpkv.common.proc import pid_running
from hpkv.common.ratelimit import RateLimitedLog
from hpkv.common.security import open_nofollow, open_private_dir
from hpkv.config import Config, format_size
from hpkv.engine.calls import OperatorCalls, OperatorJob, ServerConn
from hpkv.engine.control import ControlTransport
from hpkv.engine.index import Index, Namespace
from hpkv.engine.registry import RETIRE_GRACE_S, Client
from hpkv.engine.remote import RemoteTier
from hpkv.engine.remote import check_config as check_remote_config
from hpkv.engine.storage.tier import FileTier
from hpkv.engine.tiers import LookupAnswer, LowerTier, ParkedLookup, TierList
from hpkv.engine.workers import WorkerProcess
from hpkv.monitor.metrics import start_metrics
from hpkv.protocol import wire as P
from hpkv.protocol.errors import (
    ROW_MISSING,
    ROW_POOL_FULL,
    CallTooLarge,
    NamespaceNotAttached,
    NotOwner,
    Status,
)
from hpkv.protocol.keys import KEY_BYTES
from hpkv.protocol.stats import G, NsCounter, StatsSegment
from hpkv.protocol.wire import Tier
from hpkv.ring import Doorbell, RingError
from hpkv.runtime.fence import SlotFence

log = logging.getLogger("hpkv.server")

LOCK_RETRY_S = 0.5
MAX_PROMOTE_MS = 600_000  # a promote's deadline is clamped to 10 minutes
TIER_OF = {"files": Tier.STORAGE, "remote": Tier.REMOTE}  # HPKV_TIER_ORDER's names, as wire tiers
HOT_BATCH = 32  # hot calls taken from one client per round of the request loop (fairness)


class AlreadyServed(RuntimeError):
    def __init__(self, directory: str, pid: int | None):
        self.pid = pid
        who = f"pid {pid}" if pid else "another process"
        super().__init__(
            f"the pool directory {directory} is already served by {who}; "
            f"stop it first (kill {pid or '<pid>'}) or use another HPKV_SHARE_MEM_FILE_PATH"
        )


def _kind_name(kind: int) -> str:
    names = {
        P.LOOKUP: "LOOKUP",
        P.RESERVE: "RESERVE",
        P.COMMIT: "COMMIT",
        P.PIN: "PIN",
        P.UNPIN: "UNPIN",
        P.PROMOTE: "PROMOTE",
    }
    return names.get(kind, f"kind-{kind}")


@dataclass
class _Release:
    """Detached pins, dropped once the marked copies have ended (reservations need no wait)."""

    blocks: list
    pins: list
    marks: list
    not_before: float


class Server(OperatorCalls):
    def __init__(self, cfg: Config, auto: bool = False):
        self.cfg = cfg
        self.dir = cfg.pool_dir
        self.auto = auto
        self.idle_exit = cfg["HPKV_SERVER_IDLE_EXIT"] if auto else 0.0
        self.lock = threading.RLock()
        self.stop_event = threading.Event()  # a stop was requested: drain spills, then shut down
        self.down = threading.Event()  # shut down: the control and supervisor threads end
        self.stopping = False  # draining the spills (new clients are refused from stop_event on)
        self._stop_waiters: list[ServerConn] = []  # `hpkv stop` connections awaiting the outcome
        self._operator_jobs: list[OperatorJob] = []  # operator calls answered later (evict, prefetch)
        self._evicting_files = False  # an `hpkv evict` deletes storage files (one at a time)
        self.stop_outcome: dict[str, Any] = {}
        self.clients: dict[int, Client] = {}
        self.namespaces_by_fp: dict[str, Namespace] = {}
        self.workers: list[WorkerProcess] = []
        self._closing: list[Client] = []
        self._next_cid = 1
        self._next_dev = 1
        self._device_registered = False
        self._lock_fd: int | None = None
        self._catalog_dirty = True
        self._last_client_seen = time.monotonic()
        # Open `hold` connections (engine processes that started the server early), by id.
        self._holds: dict[int, ServerConn] = {}
        self.tiers = TierList()  # below the pool, in priority order; empty when storage is off
        self._errors = RateLimitedLog(log)
        self._releases: list[_Release] = []
        self._lease_checked = 0.0
        self._detached: dict[int, float] = {}  # namespace id -> when its last client left
        self._work_left = False  # a client had more than HOT_BATCH calls queued last round
        self._drain_added = 0  # spills queued during the stop drain (counted in its report)
        # Engines' KV-cache files in the pool directory share its file system with the pool:
        # path -> bytes of those registered now; the most registered at once; and the files of
        # engines that detached while their process still ran (removed once it is gone).
        self._kv_files: dict[str, int] = {}
        self._kv_bytes = 0  # their sum: read by the pool's warmers, so one int, never the dict
        self._kv_peak = 0
        self._kv_orphans: dict[str, int] = {}
        self._hot_handlers = {
            P.LOOKUP: self._hot_lookup,
            P.RESERVE: self._hot_reserve,
            P.COMMIT: self._hot_commit,
            P.PIN: self._hot_pin,
            P.PROMOTE: self._hot_promote,
            P.UNPIN: self._hot_unpin,
        }
        self._control_handlers = {
            "hello": self._ctl_hello,
            "hold": self._ctl_hold,
            "stats": self._ctl_stats,
            "shutdown": self._ctl_shutdown,
            "namespace": self._ctl_namespace,
            "register_device": self._ctl_register_device,
            "clear": self._ctl_clear,
            "events": self._ctl_events,
            "time_saved": self._ctl_time_saved,
            # the operator's (hpkv evict, prefetch, pin, unpin)
            "evict": self._ctl_evict,
            "prefetch": self._ctl_prefetch,
            "pin": self._ctl_pin,
            "unpin": self._ctl_unpin,
        }

    # ================================================================ life cycle
    def acquire_lock(self) -> None:
        # The directory must be ours and closed to others (created 0700), and the lock file is
        # opened through the verified directory without following a symlink.
        dir_fd = open_private_dir(self.dir, "the pool directory (HPKV_SHARE_MEM_FILE_PATH)")
        try:
            fd = open_nofollow(dir_fd, P.LOCK_FILE, os.O_RDWR | os.O_CREAT)
            self._share_with_group(dir_fd)
        finally:
            os.close(dir_fd)
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
                    raise AlreadyServed(self.dir, P.read_lock_pid(self.dir)) from None
                time.sleep(0.01)
        previous = P.read_lock_pid(self.dir)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd
        if previous and previous != os.getpid():
            log.warning(
                "took over the pool directory %s from pid %s, which exited without cleaning up",
                self.dir,
                previous,
            )
        self._remove_owned_files(startup=True)

    def _share_with_group(self, target: int | str) -> None:
        """HPKV_ALLOW_GROUP: let that group reach the socket (directory 0710, socket 0660, both
        of that group); nobody but us can still write the directory."""
        gid = self.cfg["HPKV_ALLOW_GROUP"]
        if gid is None:
            return
        is_dir = isinstance(target, int)
        os.chown(target, -1, gid)
        os.chmod(target, 0o710 if is_dir else 0o660)

    def _remove_owned_files(self, startup: bool) -> None:
        removed = []
        for name in os.listdir(self.dir):
            engine_pid = P.device_file_pid(name)
            if (
                name in (P.POOL_FILE, P.SOCKET_FILE, "stats")
                or name.endswith(P.OWNED_SUFFIXES)
                or ".tmp" in name
                or (engine_pid is not None and not pid_running(engine_pid))
            ):
                try:
                    os.unlink(os.path.join(self.dir, name))
                    removed.append(name)
                except FileNotFoundError:
                    pass
        if removed and startup:
            log.warning(
                "removed %d files left by a previous server in %s: %s",
                len(removed),
                self.dir,
                ", ".join(sorted(removed)[:8]) + (" ..." if len(removed) > 8 else ""),
            )

    def start(self) -> None:
        if self.auto:
            # Spawned by an engine process that may be pinned to its compute cores
            # (vLLM's CPU worker is): don't inherit that, place our workers ourselves.
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, range(os.cpu_count() or 1))
        for w in check_runtime(self.cfg):
            log.warning("%s", w)
        check_remote_config(self.cfg)
        self.acquire_lock()
        size = self.cfg.pool_size
        t0 = time.monotonic()
        self.pool = PoolFile.create(os.path.join(self.dir, P.POOL_FILE), size)
        log.info(
            "pool %s: %s created in %.2fs; its memory is allocated and locked in the background",
            self.pool.path,
            format_size(size),
            time.monotonic() - t0,
        )
        self.stats = StatsSegment.create(self.dir)
        self.fence = SlotFence.create(self.pool.path + P.FENCE_SUFFIX, size)
        self.index = Index(
            size,
            storage_enabled=self.cfg.storage_path is not None or bool(self.cfg["HPKV_REMOTE_BACKEND"]),
            memory=self.pool,
            fence_bump=self.fence.bump,
            eviction=self.cfg["HPKV_DRAM_EVICTION"],
            below_order=[TIER_OF[name] for name in self.cfg["HPKV_TIER_ORDER"]],
        )
        self.pool.keep_free = self._kv_space_kept
        self._check_space("at start")
        self.pool.warm_in_background(
            lock=True,
            progress=self._pool_warm_progress,
            high_water=lambda: self.index.alloc.high_water,
            engine_started=lambda: self._device_registered or self.index.alloc.high_water > 0,
        )
        self.stats.glob[G.POOL_CAPACITY] = size
        self.doorbell = Doorbell.create(self.dir, "server")
        self.tiers = self._start_tiers()

        self.metrics = start_metrics(self.cfg)
        sock_path = os.path.join(self.dir, P.SOCKET_FILE)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(sock_path)
        os.chmod(sock_path, 0o600)
        self._share_with_group(sock_path)
        self.listener.listen(64)
        self.listener.setblocking(False)  # an accept() never waits, also a second one in a row
        self.control = ControlTransport(
            self.listener,
            max_conns=self.cfg["HPKV_MAX_CONTROL_CONNECTIONS"],
            allow_group=self.cfg["HPKV_ALLOW_GROUP"],
            new_conn=ServerConn,
            handle=self._control_line,
            on_close=self._control_closed,
        )
        self._publish_catalog()
        threading.Thread(
            target=self.control.serve, args=(self.down, self._control_round), name="control", daemon=True
        ).start()
        threading.Thread(target=self._supervisor_loop, name="supervisor", daemon=True).start()
        log.info(
            "hpkv server %d serving %s (pool %s, storage %s)%s",
            os.getpid(),
            self.dir,
            format_size(size),
            self.cfg.storage_path or "disabled",
            f", idle exit after {self.idle_exit:g}s" if self.idle_exit else "",
        )

    def _start_tiers(self) -> TierList:
        """The tiers below the pool that are on, in HPKV_TIER_ORDER (DRAM -> local files -> the
        remote store by default); a tier the order names that is off is left out (said once)."""
        order = self.cfg["HPKV_TIER_ORDER"]
        on = {"files": self.cfg.storage_path is not None, "remote": bool(self.cfg["HPKV_REMOTE_BACKEND"])}
        off = [name for name in order if not on[name]]
        if off and any(on.values()) and self.cfg.source("HPKV_TIER_ORDER").kind != "default":
            log.info(
                "HPKV_TIER_ORDER=%s: %s is off on this node, left out", ",".join(order), " and ".join(off)
            )
        # Started files first whatever the order: the IO workers take the stats rows 0..N-1,
        # the remote worker the next free one.
        started: dict[str, LowerTier] = {}
        if on["files"]:
            files = FileTier(
                self.cfg, self.dir, self.stats, self.index, self.lock, self.doorbell, self.pool.path
            )
            self.workers += files.start(list(range(self.cfg["HPKV_NUM_IO_WORKERS"])))
            started["files"] = files
        if on["remote"]:
            remote = RemoteTier(
                self.cfg, self.dir, self.stats, self.index, self.lock, self.doorbell, self.pool.path
            )
            self.workers += remote.start(self._free_worker_slot())
            started["remote"] = remote
        names = [name for name in order if name in started]
        below = [started[name] for name in names]
        return TierList(below, fallback=names.index("files") if "files" in started else 0)

    def _pool_warm_progress(self, done: int) -> None:
        self.stats.glob[G.POOL_WARM] = done
        if done >= self.pool.size:
            self._catalog_dirty = True  # pool_locked is known now

    def shutdown(self) -> None:
        self.stop_event.set()
        self.down.set()
        if hasattr(self, "pool"):
            self.pool.stop_warming()
        for w in list(self.workers):
            w.stop()
        self.tiers.shutdown()
        with self.lock:
            for c in list(self.clients.values()):
                self._drop_client(c, reason="server shutdown")
        self._reap_closed_clients()
        # After a failed start some of these were never made.
        for name in ("listener", "doorbell", "stats", "fence", "pool"):
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
        """One round of the request loop: sleep until a ring has work (unless work was left
        last round), then take at most HOT_BATCH calls from each client in turn, so a client
        that floods its ring delays another's call by one batch, never by its whole backlog."""
        with self.lock:
            clients = [c for c in self.clients.values() if c.alive]
        if not self._work_left:
            due = self.tiers.next_deadline()  # a parked lookup is answered at its bound, not later
            if due is not None:
                timeout = min(timeout, max(due - time.monotonic(), 0.0))
            try:
                self.doorbell.wait(timeout=timeout)
            except InterruptedError:
                return
        left = False
        for c in clients:
            left |= self._drain(c)
        self._work_left = left
        answers = self.tiers.poll()
        if answers:
            with self.lock:
                for a in answers:
                    if isinstance(a, LookupAnswer):
                        self._answer_lookup(a)
                    else:
                        self._answer_parked(a.client, a.seq, a.rows)
        if self._closing:
            self._reap_closed_clients()

    def _drain_spills(self) -> dict[str, Any]:
        """Keep serving until every queued or running write-through spill is done, or the
        drain timeout passes; attached engines keep their hits meanwhile."""
        if not self.tiers:
            return {"pending": 0, "written": 0, "dropped": 0, "seconds": 0.0}
        timeout = float(self.cfg["HPKV_STOP_DRAIN_TIMEOUT"])
        t0 = time.monotonic()
        with self.lock:
            pending = first = self.tiers.pending_spills()
        written0 = int(self.stats.glob[G.STORAGE_SPILLS])
        self._drain_added = 0  # blocks reserved before the stop, committed during the drain
        if pending:
            log.info(
                "stopping: writing %d pending block(s) to storage first (at most %gs, "
                "HPKV_STOP_DRAIN_TIMEOUT)",
                pending,
                timeout,
            )
        degraded = False
        while pending and time.monotonic() - t0 < timeout:
            self._serve_round(0.05)
            with self.lock:
                pending = self.tiers.pending_spills()
                degraded = self.tiers.degraded
            if degraded:  # a hung mount would only run the timeout out
                break
        seconds = time.monotonic() - t0
        written = int(self.stats.glob[G.STORAGE_SPILLS]) - written0
        first += self._drain_added
        if pending and degraded:
            log.warning(
                "stopping: %d block(s) were not written to storage: it is degraded (%s; %d file(s) "
                "written meanwhile); they will be recomputed when needed",
                pending,
                self.tiers.describe().get("degraded_reason"),
                written,
            )
        elif pending:
            log.warning(
                "stopping: %d block(s) were not written to storage: HPKV_STOP_DRAIN_TIMEOUT=%gs "
                "expired (%d file(s) written meanwhile); they will be recomputed when needed",
                pending,
                timeout,
                written,
            )
        elif first:
            log.info(
                "stopping: %d pending block(s) written to storage in %.2fs (%d file(s))",
                first,
                seconds,
                written,
            )
        return {"pending": first, "written": written, "dropped": pending, "seconds": round(seconds, 3)}

    def _answer_stop_waiters(self) -> None:
        """Give the control thread a moment to tell `hpkv stop` the outcome before shutting down."""
        deadline = time.monotonic() + 2.0
        while self._stop_waiters and time.monotonic() < deadline:
            time.sleep(0.01)

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
    def _drain(self, c: Client) -> bool:
        """Answer up to HOT_BATCH of ``c``'s queued calls; True when it may have more queued."""
        for _ in range(HOT_BATCH):
            if not c.alive or c.busy:
                return False  # a parked client is taken again once its promote is answered
            try:
                d = c.req.try_pop()
            except RingError:
                return False
            if d is None:
                return False
            with self.lock:
                status, a0, a1 = self._handle(c, d)
            self.stats.glob[G.REQUESTS] += 1
            if status is None:  # parked until a tier's poll returns its answer (_answer_parked)
                continue
            if status < 0:
                self.stats.glob[G.ERRORS] += 1
            try:
                c.resp.try_push(P.COMPLETION, d.seq, a0, a1, status=status)
            except RingError as exc:  # a client that does not read its answers: once per 10 s
                self._errors.log(logging.INFO, "cannot-answer", "client %d: cannot answer (%s)", c.cid, exc)
        return True

    def _keys(self, c: Client, n: int, answer_bytes_per_key: int = 0) -> list[bytes]:
        """The call's keys from the mailbox; CallTooLarge when they, or the answer, would not
        fit in their half of the mailbox (the answer of a world-W call is 8*W bytes a key)."""
        if n > P.MAX_KEYS_PER_CALL or n * answer_bytes_per_key > P.MAILBOX_HALF:
            raise CallTooLarge("too many keys in one call")
        return c.mbox[: n * KEY_BYTES].view(f"V{KEY_BYTES}").tolist()

    def _answer_lookup(self, a: LookupAnswer) -> None:
        """A parked lookup's checks ended or its bound passed: run it again without parking
        (what is not confirmed now is a miss) and answer it (request loop, lock held)."""
        c = a.client
        self._park(c, False)
        if not c.alive:
            return
        status, hit, unconfirmed = 0, 0, 0
        if a.ns.released:  # its namespace was dropped meanwhile
            status = int(Status.NO_NAMESPACE)
            self.stats.glob[G.ERRORS] += 1
        else:
            hit, unconfirmed = self._lookup(c, a.ns, a.n, None, a.each) or (0, 0)  # not parked again
            self._publish_pool_gauges()
        try:
            c.resp.try_push(P.COMPLETION, a.seq, hit, unconfirmed, status=status)
        except RingError as exc:
            log.info("client %d: cannot answer (%s)", c.cid, exc)
        self.doorbell.ring()  # requests it queued meanwhile are taken on the next round

    def _answer_parked(self, c: Client, seq: int, rows: np.ndarray) -> None:
        """A tier's poll returned a parked promote's answer: answer it like a pin (request loop)."""
        self._park(c, False)
        if not c.alive:
            return
        c.mbox[P.MAILBOX_HALF : P.MAILBOX_HALF + rows.nbytes] = rows.reshape(-1).view(np.uint8)
        try:
            c.resp.try_push(P.COMPLETION, seq, rows.shape[1], 0, status=0)
        except RingError as exc:
            log.info("client %d: cannot answer (%s)", c.cid, exc)
        self.doorbell.ring()  # requests it queued meanwhile are taken on the next round

    def _park(self, c: Client, on: bool) -> None:
        """A parked client's next calls wait in its ring until its promote is answered; its
        ring is unwatched meanwhile, so its pushes cannot keep the request loop spinning."""
        c.busy = on
        with contextlib.suppress(RingError):  # a closed ring: the client is being dropped
            c.req.watch(not on)

    def _handle(self, c: Client, d) -> tuple[int | None, int, int]:
        """One hot call; returns (status, a0, a1) for the completion, status None when parked.

        Never raises: whatever a descriptor or mailbox holds, the call is answered (an error
        status, counted by the caller) and the server keeps serving."""
        handler = self._hot_handlers.get(d.kind)
        try:
            if handler is None:
                raise ValueError(f"unknown call kind {d.kind}")
            return handler(c, d)
        except NamespaceNotAttached:
            return Status.NO_NAMESPACE, 0, 0
        except CallTooLarge:
            return Status.TOO_MANY_KEYS, 0, 0
        except NotOwner as exc:
            self._errors.log(
                logging.WARNING,
                "not-owner",
                "client %d (pid %d): %s refused: %s",
                c.cid,
                c.pid,
                _kind_name(d.kind),
                exc,
            )
            return Status.NOT_OWNER, 0, 0
        except (ValueError, KeyError, TypeError, IndexError, MemoryError) as exc:
            self._errors.log(
                logging.WARNING,
                "bad-call",
                "client %d (pid %d): bad %s call (a0=%d a1=%d a2=%d flags=%d): %s",
                c.cid,
                c.pid,
                _kind_name(d.kind),
                d.a0,
                d.a1,
                d.a2,
                d.flags,
                exc,
            )
            return Status.BAD_REQUEST, 0, 0
        except Exception:  # noqa: BLE001 - one call must never end the request loop
            self._errors.log(
                logging.ERROR,
                "hot-internal",
                "client %d: %s call failed inside the server",
                c.cid,
                _kind_name(d.kind),
                exc_info=True,
            )
            return Status.INTERNAL, 0, 0
        finally:
            self._publish_pool_gauges()

    def _publish_pool_gauges(self) -> None:
        """The pool's used and pinned bytes and block count, after anything that changed them."""
        idx = self.index
        self.stats.glob[G.POOL_USED] = idx.alloc.used
        self.stats.glob[G.POOL_PINNED] = idx.pinned_bytes
        self.stats.glob[G.BLOCKS] = idx.block_count()

    def _hot_lookup(self, c: Client, d) -> tuple[int | None, int, int]:
        ns = self.index.ns(d.a0)
        n = d.a1
        if n > P.MAX_KEYS_PER_CALL:
            raise CallTooLarge("too many keys in one call")
        each = bool(d.flags & P.FLAG_EACH)
        call = ParkedLookup(c, d.seq, ns, n, time.monotonic(), each=each) if self.tiers else None
        answer = self._lookup(c, ns, n, call, each)
        if answer is None:  # a tier is asking its medium: answered by _answer_lookup
            self._park(c, True)
            return None, 0, 0
        return 0, *answer

    def _lookup(
        self, c: Client, ns: Namespace, n: int, call: ParkedLookup | None, each: bool = False
    ) -> tuple[int, int] | None:
        """The one way a lookup is answered: the prefix's tiers into the mailbox, counted;
        (hit, 1 when the key after the prefix is still being checked, else 0). None (nothing
        written) when a tier parked ``call`` to ask its medium first. ``each`` (FLAG_EACH):
        every key's tier, 0 where missing (:meth:`_lookup_each`)."""
        if each:
            return self._lookup_each(c, ns, n, call)
        idx = self.index
        out = c.mbox[P.MAILBOX_HALF :]
        # The hot path: keys read and tiers written in place, in C.
        hit = idx.present.prefix(ns.ns_id, c.mbox[: n * KEY_BYTES], n, out[:n])
        tiers = out[:hit].tolist()
        pending = False
        if self.tiers and (hit < n or max(tiers, default=0) >= Tier.STORAGE):
            # files deleted from outside are not hits; files the index has not seen yet are
            hit, pending = self.tiers.lookup(ns, self._keys(c, n), hit, tiers, call)
            if pending and call is not None:
                return None
            out[:hit] = np.frombuffer(bytes(tiers), np.uint8)
        idx.count_lookup(ns, n, tiers)
        return hit, int(pending)

    def _lookup_each(
        self, c: Client, ns: Namespace, n: int, call: ParkedLookup | None
    ) -> tuple[int, int] | None:
        """A FLAG_EACH lookup: every key's tier into the mailbox (0: missing); (the leading
        prefix, 1 when a key is still being checked on storage). The leading prefix is
        answered as a prefix lookup is (the tiers check its storage hits and look on their
        medium for the keys after it: files another server wrote); the keys after it as the
        pool and the tiers know them, each run of them from a storage hit checked by the tiers
        as a prefix (files deleted from outside are no hits). Unknown keys past the leading
        prefix are not looked for on the medium: a sliding-window model's missing blocks are
        the rule there, and a stat of each would cost every lookup; only while a tier is still
        learning what it holds (its journals read after a restart) are they checked too
        (:meth:`TierList.discover`). All runs' checks start before the call parks, once."""
        idx = self.index
        out = c.mbox[P.MAILBOX_HALF : P.MAILBOX_HALF + n]
        idx.present.each(ns.ns_id, c.mbox[: n * KEY_BYTES], n, out)
        parked = unconfirmed = False
        if self.tiers:
            keys = self._keys(c, n)
            miss = np.flatnonzero(out == Tier.MISS)
            pos = int(miss[0]) if len(miss) else n  # the leading prefix
            tiers = out[:pos].tolist()
            if pos < n or max(tiers, default=0) >= Tier.STORAGE:
                hit, pending = self.tiers.lookup(ns, keys, pos, tiers, call)
                if pending and call is not None:
                    parked = True
                else:
                    unconfirmed |= pending
                    out[:hit] = np.frombuffer(bytes(tiers), np.uint8)
                    if hit < pos:  # a file gone: the rest of the prefix is checked below
                        out[hit] = Tier.MISS
                    pos = hit + 1 if hit < pos else max(hit, pos)
            while pos < n:
                found = np.flatnonzero(out[pos:] >= Tier.STORAGE)
                if not len(found):
                    break
                start = pos + int(found[0])
                gap = np.flatnonzero(out[start:] == Tier.MISS)
                end = start + int(gap[0]) if len(gap) else n
                tiers = out[start:end].tolist()
                hit, pending = self.tiers.lookup(ns, keys[start:end], end - start, tiers, call)
                if pending and call is not None:
                    parked, pos = True, end
                    continue
                unconfirmed |= pending
                out[start : start + hit] = np.frombuffer(bytes(tiers), np.uint8)
                if hit < end - start:
                    out[start + hit] = Tier.MISS
                pos = start + hit + 1
            learning = self.tiers.learning(ns)
            nowhere = [keys[i] for i in np.flatnonzero(out == Tier.MISS)] if learning else []
            if nowhere and self.tiers.discover(ns, nowhere, call):
                if call is not None:
                    parked = True
                else:
                    unconfirmed = True
        if parked:
            return None
        present = out[out != Tier.MISS]
        idx.count_lookup(ns, n, present.tolist())
        miss = np.flatnonzero(out == Tier.MISS)
        return (int(miss[0]) if len(miss) else n), int(unconfirmed)

    def _hot_reserve(self, c: Client, d) -> tuple[int, int, int]:
        idx = self.index
        ns = idx.ns(d.a0)
        keys = self._keys(c, d.a1, 8 * ns.world_size)
        if self.stop_event.is_set():
            # Stopping: new blocks would only lengthen the spill drain (and be dropped at its
            # timeout). The engine skips saving them, as when the pool is full.
            slots = np.full((len(keys), ns.world_size), ROW_POOL_FULL, np.int64)
        else:
            conflicts = idx.conflicts
            slots = idx.reserve(ns.ns_id, keys, owner=c.cid)
            if idx.conflicts != conflicts:
                self._errors.log(
                    logging.WARNING,
                    "key-conflict",
                    "client %d (pid %d): %d key(s) reserved in namespace %d belong to another "
                    "namespace: skipped (-2). A client must derive keys from its namespace "
                    "fingerprint (hpkv.protocol.keys.block_key); this one reuses keys across namespaces",
                    c.cid,
                    c.pid,
                    idx.conflicts - conflicts,
                    ns.ns_id,
                )
        flat = slots.reshape(-1)
        new = flat >= 0  # each slot with its generation: a save for it lands only while it is this one's
        flat[new] |= self.fence.generations(flat[new]) << P.SLOT_GEN_SHIFT
        c.mbox[P.MAILBOX_HALF : P.MAILBOX_HALF + flat.nbytes] = flat.view(np.uint8)
        return 0, slots.shape[1], 0

    def _hot_commit(self, c: Client, d) -> tuple[int, int, int]:
        idx = self.index
        ns = idx.ns(d.a0)
        keys = self._keys(c, d.a1)
        if d.flags & P.FLAG_ABORT:
            # Only the owner, or a writer of the namespace (its copy failed), may abort; the
            # slots are freed once no copy into them can still be running.
            idx.check_owner(ns, keys, c.cid, writer=any(n == ns.ns_id for n, _ in c.writer_ranks))
            self._release_later(idx.retire(keys, ns), [], grace=0.0)
            return 0, 0, 0
        rank = d.a2
        if not 0 <= rank < ns.world_size:
            raise ValueError(f"rank {rank} outside 0..{ns.world_size - 1} of namespace {ns.ns_id}")
        idx.check_owner(ns, keys, c.cid, writer=(ns.ns_id, rank) in c.writer_ranks)
        torn = idx.torn_commits
        ready = idx.commit(ns.ns_id, keys, rank=rank)
        if idx.torn_commits != torn:
            self._errors.log(
                logging.WARNING,
                "torn-commit",
                "client %d (pid %d): %d block(s) of namespace %d committed while a save into them "
                "was still running: dropped, never served (commit only after the save completed)",
                c.cid,
                c.pid,
                idx.torn_commits - torn,
                ns.ns_id,
            )
        if ready and self.tiers:
            before = self.tiers.pending_spills() if self.stopping else 0
            self.tiers.spill(ready)  # write-through
            if self.stopping:  # reserved before the stop: what the drain reports grows with it
                self._drain_added += max(self.tiers.pending_spills() - before, 0)
        return 0, len(ready), 0

    def _hot_pin(self, c: Client, d) -> tuple[int, int, int]:
        idx = self.index
        ns = idx.ns(d.a0)
        world = ns.world_size
        keys = self._keys(c, d.a1, 8 * world)
        arr = np.full((len(keys), world), -1, np.int64)
        used = []
        for i, s in enumerate(idx.pin(ns, keys, owner=c.cid)):
            if s is not None:
                arr[i] = s
                used.append(keys[i])
        ns.counters[NsCounter.LOADS_DRAM] += len(used)
        self.tiers.touch(used)
        c.mbox[P.MAILBOX_HALF : P.MAILBOX_HALF + arr.nbytes] = arr.reshape(-1).view(np.uint8)
        return 0, world, 0

    def _hot_promote(self, c: Client, d) -> tuple[int | None, int, int]:
        idx = self.index
        ns = idx.ns(d.a0)
        keys = self._keys(c, d.a1, 8 * ns.world_size)
        if not self.tiers:
            rows: np.ndarray | None = np.full((len(keys), ns.world_size), ROW_MISSING, np.int64)
            assert rows is not None
            for i, s in enumerate(idx.pin(ns, keys, owner=c.cid)):
                if s is not None:
                    rows[i] = s
        else:
            timeout = min(d.a2, MAX_PROMOTE_MS) / 1000.0  # the client waits no longer anyway
            rows = self.tiers.promote(c, d.seq, ns, keys, timeout=timeout)
            if rows is None:
                self._park(c, True)
                return None, 0, 0
        c.mbox[P.MAILBOX_HALF : P.MAILBOX_HALF + rows.nbytes] = rows.reshape(-1).view(np.uint8)
        return 0, ns.world_size, 0

    def _hot_unpin(self, c: Client, d) -> tuple[int, int, int]:
        ns = self.index.namespaces.get(d.a0)
        if ns is not None:  # a namespace not attached holds no pins: nothing to release
            self.index.unpin(self._keys(c, d.a1), owner=c.cid, ns=ns)  # this client's pins on ns's blocks
        return 0, 0, 0

    # ================================================================ deferred release
    def _release_later(self, blocks: list, pins: list[bytes], grace: float) -> None:
        """Free retired reservations now and drop detached pins once every load that could
        still read their slots has ended: every job queued on any transfer worker now has run
        (or failed with its worker), and at least ``grace`` seconds passed (a dead scheduler's
        worker may still submit the copy it was told to make).

        Reservations whose namespace saves only through transfer workers wait for nobody: their
        slots get a new generation (the slot fence), so a save made for them that comes later is
        refused by the worker, and a save still copying keeps its slots out of the allocator only
        until it ends (Index.reclaim_fenced). A namespace with a rank that writes the pool from
        inside the engine (SGLang's in-process mode, vLLM's CUDA fallback), which no fence checks,
        keeps its released reservations ``grace`` seconds first, as before the fence."""
        if blocks:
            by_id = {b.ns.ns_id: b.ns for b in blocks}
            fenced = {i: grace <= 0 or self._saves_fenced(ns) for i, ns in by_id.items()}
            unfenced = [b for b in blocks if not fenced[b.ns.ns_id]]
            self.index.free_retired([b for b in blocks if fenced[b.ns.ns_id]])
            self._publish_pool_gauges()
            if unfenced:
                self._releases.append(_Release(unfenced, [], [], time.monotonic() + grace))
        if not pins:
            return
        # Only the workers of the pins' namespaces load those blocks: an engine of another model
        # (and its hung worker, should it have one) never holds these pins back.
        nss = {b.ns.ns_id for k in pins if (b := self.index.blocks.get(k)) is not None}
        workers = [
            w for c in self.clients.values() for dev in c.devices if dev.ns_id in nss for w in dev.workers
        ]
        marks = [(w, w.mark()) for w in workers]
        rel = _Release([], pins, marks, time.monotonic() + grace)
        if not self._release_if_done(rel):
            self._releases.append(rel)

    def _saves_fenced(self, ns: Namespace) -> bool:
        """Every rank of the namespace has a device whose transfer workers make its saves (so
        the slot fence checks every save into its reservations)."""
        ranks = {
            dev.rank
            for c in self.clients.values()
            if c.alive
            for dev in c.devices
            if dev.ns_id == ns.ns_id and dev.workers
        }
        return len(ranks) >= ns.world_size

    def _release_if_done(self, rel: _Release) -> bool:
        if time.monotonic() < rel.not_before or not all(w.passed(m) for w, m in rel.marks):
            return False
        self.index.free_retired(rel.blocks)
        self.index.drop_pins(rel.pins)
        self._publish_pool_gauges()
        return True

    def _release_due(self) -> None:
        if self._releases:
            self._releases = [r for r in self._releases if not self._release_if_done(r)]

    def _expire_leases(self) -> None:
        """Release pins and reservations older than HPKV_LEASE_S (a hung engine's)."""
        lease = self.cfg["HPKV_LEASE_S"]
        now = time.monotonic()
        if not lease or now - self._lease_checked < min(1.0, lease / 4):
            return
        self._lease_checked = now
        idx = self.index
        keys = idx.expired_reservations(lease, now)
        if keys:
            self._errors.log(
                logging.WARNING,
                "lease-reservations",
                "%d reservation(s) not committed within HPKV_LEASE_S=%gs: released",
                len(keys),
                lease,
            )
            self._release_later(idx.retire(keys), [], grace=RETIRE_GRACE_S)
        for owner, ks in idx.expired_pins(lease, now).items():
            self._errors.log(
                logging.WARNING,
                "lease-pins",
                "client %d held %d pin(s) longer than HPKV_LEASE_S=%gs: released",
                owner,
                len(ks),
                lease,
            )
            self._release_later([], idx.take_pins(owner, ks), grace=RETIRE_GRACE_S)

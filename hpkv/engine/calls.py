"""The server's control calls (hello, hold, stats, shutdown, namespace, register_device,
clear, events, time_saved; the operator's evict, prefetch, pin, unpin): one line of JSON in,
its reply out. :class:`hpkv.engine.control.ControlTransport` carries the lines; these methods
run on its thread and answer them.

:class:`ControlCalls` is a part of :class:`hpkv.engine.server.Server` (its base class), like
:class:`hpkv.engine.registry.Registry`, on the server's state and under its lock.
"""

from __future__ import annotations

import base64
import errno
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hpkv.common.proc import PID_MAX, valid_pid
from hpkv.common.text import printable
from hpkv.config import format_size
from hpkv.engine.control import Conn, ControlTransport
from hpkv.engine.devices import int_arg
from hpkv.engine.events import MAX_READ, NsEventLog
from hpkv.engine.index import Namespace, PinCapExceeded, State
from hpkv.engine.registry import MAX_NAME, Client
from hpkv.engine.storage.tier import FileTier
from hpkv.engine.supervisor import Supervision
from hpkv.io_workers import kvfile
from hpkv.protocol.errors import TOO_MANY_CONNECTIONS, HpkvError, NamespaceNotAttached, Status, refusal
from hpkv.protocol.keys import KEY_BYTES, namespaces_named
from hpkv.protocol.stats import MAX_NS, TIERS, G, NsCounter

log = logging.getLogger("hpkv.server")

MAX_LOGGED_ERROR = 500  # characters of an error message that quotes client input
# Bounds of one time_saved report (per tier): a day's worth of microseconds, 2**40 tokens.
# A report beyond them is refused, so a confused client cannot wrap the counters.
MAX_REPORTED_US = 86_400 * 10**6
MAX_REPORTED_TOKENS = 1 << 40
_TIME_SAVED_COUNTERS = {
    tier: (
        NsCounter[f"LOADED_TOKENS_{tier.upper()}"],
        NsCounter[f"PREFILL_SAVED_US_{tier.upper()}"],
        NsCounter[f"LOAD_US_{tier.upper()}"],
    )
    for tier in TIERS
}


@dataclass
class ServerConn(Conn):
    """A control connection as the server sees it: the client it attached, or the hold it keeps."""

    client: Client | None = None
    hold: str = ""  # a `hold` call's name: no idle exit while this connection is open

    def describe(self) -> str:
        return f"client {self.client.cid if self.client else '-'} (pid {self.pid})"


class ControlCalls(Supervision):
    """The control calls and the control thread's hooks (see the module docstring)."""

    # The server's state these methods use, beside the registry's and the supervisor's.
    stopping: bool
    stop_outcome: dict[str, Any]
    control: ControlTransport[ServerConn]
    _stop_waiters: list[ServerConn]
    _control_handlers: dict[str, Callable[[ServerConn, dict[str, Any]], dict[str, Any] | None]]

    def _operator_round(self) -> bool:  # OperatorCalls
        return False

    def _reply_to_stop_waiters(self) -> None:
        reply = {"ok": True, "stopped": True, **self.stop_outcome}
        with self.lock:
            waiters, self._stop_waiters = self._stop_waiters, []
        for conn in waiters:
            self.control.send(conn, reply)

    def _control_round(self) -> float:
        """The control thread's own work each round: answer `hpkv stop` once the drain is done."""
        if self.stop_outcome and self._stop_waiters:
            self._reply_to_stop_waiters()
        if self._operator_round():
            return 0.02
        return 0.1 if self.stopping else 0.5

    def _control_line(self, conn: ServerConn, line: bytes) -> dict[str, Any] | None:
        reply = self._control_call(conn, line)
        if reply is not None and not reply.get("ok"):
            with self.lock:  # counted like a failed hot call
                self.stats.glob[G.ERRORS] += 1
        return reply

    def _control_closed(self, conn: ServerConn, reason: str) -> None:
        if conn.hold:
            with self.lock:
                self._holds.pop(id(conn), None)
                self._last_client_seen = time.monotonic()
                self._catalog_dirty = True
            log.info("pid %d (%s) released its hold: %s", conn.pid, conn.hold, reason)
        if conn.client is not None:
            with self.lock:
                self._drop_client(conn.client, reason=reason)

    def _control_call(self, conn: ServerConn, line: bytes) -> dict[str, Any] | None:
        """One control call; its reply (``ok``, or ``status`` and ``error``), None when it is
        answered later. Never raises: a bad call is refused and the control thread goes on."""
        try:
            msg = json.loads(line)
            if not isinstance(msg, dict):
                raise ValueError("a control call is a JSON object")
            op = msg.get("op")
            handler = self._control_handlers.get(op) if isinstance(op, str) else None
            if handler is None:
                raise ValueError(f"unknown op {msg.get('op')!r}")
            reply = handler(conn, msg)
            # What the call changed (a namespace, a client) is in the catalog before the
            # caller hears back: `hpkv status` right after it must see it.
            self._publish_catalog_if_dirty()
            return reply
        except HpkvError as exc:
            return refusal(exc.status, str(exc))
        except (ValueError, KeyError, TypeError, RecursionError, MemoryError) as exc:
            self._errors.log(
                logging.WARNING,
                "bad-control",
                "bad control call from pid %d %r: %s",
                conn.pid,
                line[:200],
                printable(exc, MAX_LOGGED_ERROR),
            )
            return refusal(Status.BAD_REQUEST, f"bad request: {exc}")
        except Exception as exc:  # noqa: BLE001 - a bad call must not kill the control thread
            self._errors.log(logging.ERROR, "control-internal", "control call failed", exc_info=True)
            return refusal(Status.INTERNAL, f"{type(exc).__name__}: {exc}")

    def _refuse_if_stopping(self) -> None:
        # From the moment a stop is requested: a client attached now would be dropped at once.
        if self.stop_event.is_set():
            raise HpkvError(
                "the hpkv server is stopping (writing pending spills); connect again once it has exited",
                -errno.ESHUTDOWN,
            )

    def _ctl_hold(self, conn: ServerConn, msg: dict[str, Any]) -> dict[str, Any]:
        """An engine that started the server early keeps it from its idle exit while it starts
        up (loading and compiling can outlast HPKV_SERVER_IDLE_EXIT), until it closes this
        connection or exits."""
        if conn.hold or conn.client is not None:
            raise ValueError("this connection holds the server or is a client already")
        with self.lock:
            self._refuse_if_stopping()
            conn.hold = printable(msg.get("name", ""), MAX_NAME) or "hold"
            self._holds[id(conn)] = conn
            self._catalog_dirty = True
        log.info("pid %d (%s) holds the server: no idle exit while it runs", conn.pid, conn.hold)
        return {"ok": True, "server_pid": os.getpid()}

    def _ctl_hello(self, conn: ServerConn, msg: dict[str, Any]) -> dict[str, Any]:
        self._refuse_if_stopping()
        if conn.client is not None:
            raise ValueError(
                f"this connection is client {conn.client.cid} already; "
                "open a new connection for another client"
            )
        pid = msg.get("pid", conn.pid)
        if not valid_pid(pid):
            raise ValueError(f"pid {pid!r} is not a process id (1..{PID_MAX})")
        try:
            c = self._add_client(conn.sock, pid, printable(msg.get("name", ""), MAX_NAME), conn.uid)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            self._errors.log(logging.ERROR, "hello-emfile", "cannot attach pid %d: %s", pid, exc)
            raise HpkvError(
                f"the hpkv server is out of file descriptors ({exc.strerror}); try again later",
                TOO_MANY_CONNECTIONS,
            ) from None
        conn.client = c
        return {
            "ok": True,
            "client_id": c.cid,
            "req": c.req.name,
            "resp": c.resp.name,
            "mailbox": c.mbox_path,
            "pool": self.pool.path,
            "pool_size": self.pool.size,
            "server_pid": os.getpid(),
            "storage": self.cfg.storage_path,
        }

    def _ctl_stats(self, conn: ServerConn, msg: dict[str, Any]) -> dict[str, Any]:
        self._publish_catalog_if_dirty()
        return {"ok": True, "stats": self.stats.snapshot()}

    def _ctl_shutdown(self, conn: ServerConn, msg: dict[str, Any]) -> dict[str, Any] | None:
        if conn.uid != os.geteuid():  # a member of HPKV_ALLOW_GROUP uses the server, it does not run it
            log.warning(
                "refused a stop from pid %d (uid %d): only uid %d may stop this server",
                conn.pid,
                conn.uid,
                os.geteuid(),
            )
            return refusal(-errno.EACCES, f"only uid {os.geteuid()}, who runs this hpkv server, may stop it")
        log.info("shutdown requested by pid %s", printable(msg.get("pid"), 40))
        if msg.get("wait"):
            with self.lock:
                if self.stop_outcome:  # already drained: answer now
                    return {"ok": True, "stopped": True, **self.stop_outcome}
                self._stop_waiters.append(conn)
        self.stop_event.set()
        self.doorbell.ring()
        return None if msg.get("wait") else {"ok": True}

    def _client_of(self, conn: ServerConn, msg: dict[str, Any]) -> Client:
        if conn.client is None:
            raise HpkvError(f"call 'hello' before {msg.get('op')!r}")
        return conn.client

    def _ctl_namespace(self, conn: ServerConn, msg: dict[str, Any]) -> dict[str, Any]:
        c = self._client_of(conn, msg)
        with self.lock:
            return self._attach_namespace(c, msg)

    def _ctl_register_device(self, conn: ServerConn, msg: dict[str, Any]) -> dict[str, Any]:
        c = self._client_of(conn, msg)
        with self.lock:
            return self._register_device(c, msg)

    def _ctl_clear(self, conn: ServerConn, msg: dict[str, Any]) -> dict[str, Any]:
        c = self._client_of(conn, msg)
        ns_id = int_arg(msg, "ns_id", 0, MAX_NS - 1)
        with self.lock:
            n = self.index.clear_namespace(ns_id)
            self._publish_pool_gauges()  # `hpkv status` right after shows the pool as it is now
        log.info("client %d cleared namespace %s from the DRAM tier: %d blocks", c.cid, ns_id, n)
        return {"ok": True, "dropped": n}

    def _ctl_events(self, conn: ServerConn, msg: dict[str, Any]) -> dict[str, Any]:
        """The namespace's tier changes from seq ``since`` on (:mod:`hpkv.engine.events`), for a
        client that attached it. The first call (``since`` -1) starts the namespace's log and
        answers its head: an engine publishes what happens from then on."""
        c = self._client_of(conn, msg)
        ns_id = int_arg(msg, "ns_id", 0, MAX_NS - 1)
        since = int_arg(msg, "since", -1, 1 << 62)
        limit = int_arg(msg, "limit", 0, MAX_READ, default=MAX_READ)
        with self.lock:
            ns = self.index.namespaces.get(ns_id)
            if ns is None or ns_id not in c.namespaces:
                raise NamespaceNotAttached(f"namespace id {ns_id} is not attached by this client")
            if ns.events is None:
                ns.events = NsEventLog()
            records, seq, lost = ns.events.read(since, limit)
            more = seq < ns.events.head
        return {
            "ok": True,
            "records": base64.b64encode(records).decode(),
            "seq": seq,
            "lost": lost,
            "more": more,
        }

    def _ctl_time_saved(self, conn: ServerConn, msg: dict[str, Any]) -> dict[str, Any]:
        """An engine's connector reports the prefill time its loads saved since its last report,
        per tier: ``{"ns_id": n, "dram": [tokens, prefill_us, load_us], "storage": [...]}``
        (either tier may be left out). Added to the namespace's counters; only a client that
        attached the namespace may report for it."""
        c = self._client_of(conn, msg)
        ns_id = int_arg(msg, "ns_id", 0, MAX_NS - 1)
        if ns_id not in c.namespaces:
            raise NamespaceNotAttached(f"namespace id {ns_id} is not attached by this client")
        adds = []
        for tier, counters in _TIME_SAVED_COUNTERS.items():
            v = msg.get(tier)
            if v is None:
                continue
            if not isinstance(v, list) or len(v) != 3:
                raise ValueError(f"{tier!r} must be [tokens, prefill_us, load_us]")
            row = dict(zip(("tokens", "prefill_us", "load_us"), v, strict=True))
            bounds = (MAX_REPORTED_TOKENS, MAX_REPORTED_US, MAX_REPORTED_US)
            adds += [
                (counter, int_arg(row, key, 0, hi))
                for counter, key, hi in zip(counters, row, bounds, strict=True)
            ]
        with self.lock:
            ns = self.index.ns(ns_id)
            for counter, n in adds:
                ns.counters[counter] += n
        return {"ok": True}


# ---------------------------------------------------------------------------------------------
# Operator calls: `hpkv evict`, `hpkv prefetch`, `hpkv pin`, `hpkv unpin`. Only the uid that runs
# the server may make them (a member of HPKV_ALLOW_GROUP is an engine, not an operator), and they
# need no `hello`: the CLI sends one line and reads one reply. Work that touches the storage
# file system (evict) or waits for IO workers (prefetch) is answered later by the control
# thread (:meth:`OperatorCalls._operator_round`), never on the request loop.

MAX_OPERATOR_KEYS = 20_000  # hex keys in one pin/unpin call (a control line holds at most 1 MiB)
MAX_PREFETCH_WAIT_S = 600.0
TIERS_EVICTED = ("dram", "storage", "all")


@dataclass
class OperatorJob:
    """A call answered once ``poll()`` returns its reply (the control thread asks every round)."""

    conn: ServerConn
    poll: Callable[[], dict[str, Any] | None]


class OperatorCalls(ControlCalls):
    """The operator's control calls (see the block comment above)."""

    _operator_jobs: list[OperatorJob]
    _evicting_files: bool

    def _operator_round(self) -> bool:
        """Answer the operator jobs that finished; True while some are left (poll sooner)."""
        if not self._operator_jobs:
            return False
        left = []
        for job in self._operator_jobs:
            try:
                reply = job.poll()
            except Exception as exc:  # noqa: BLE001 - a failed job is answered, the thread goes on
                self._errors.log(logging.ERROR, "operator-internal", "operator call failed", exc_info=True)
                reply = refusal(Status.INTERNAL, f"{type(exc).__name__}: {exc}")
            if reply is None:
                left.append(job)
            else:
                self.control.send(job.conn, reply)
        self._operator_jobs = left
        return bool(left)

    def _operator(self, conn: ServerConn, what: str) -> None:
        """Refuse a caller that is not the server's own uid (as `shutdown` does)."""
        if conn.uid != os.geteuid():
            log.warning(
                "refused %s from pid %d (uid %d): only uid %d may make operator calls",
                what,
                conn.pid,
                conn.uid,
                os.geteuid(),
            )
            raise HpkvError(
                f"only uid {os.geteuid()}, who runs this hpkv server, may {what} "
                "(members of HPKV_ALLOW_GROUP may use the cache, not operate it)",
                -errno.EACCES,
            )

    def _ns_named(self, msg: dict[str, Any]) -> Namespace:
        """The namespace ``msg["namespace"]`` names: its id, a fingerprint prefix or its name (as
        `hpkv status` shows them). Unknown or ambiguous: refused, naming the value."""
        sel = msg.get("namespace")
        if not isinstance(sel, str) or not sel.strip():
            raise ValueError("'namespace' must be a namespace id, fingerprint prefix or name")
        sel = sel.strip()
        known = list(self.index.namespaces.values())
        found = [
            known[i] for i in namespaces_named(sel, [(ns.ns_id, ns.fingerprint, ns.name) for ns in known])
        ]
        if len(found) == 1:
            return found[0]
        names = ", ".join(f"{ns.ns_id} {ns.fingerprint[:12]} {ns.name!r}" for ns in known) or "none"
        if found:
            raise HpkvError(
                f"namespace {printable(sel, 96)!r} is ambiguous: it matches "
                + ", ".join(f"{ns.ns_id} {ns.fingerprint[:12]}" for ns in found)
                + "; give more of the fingerprint or the id",
                -errno.EINVAL,
            )
        raise HpkvError(
            f"no namespace {printable(sel, 96)!r} on this server (known: {names}); `hpkv status` lists them",
            -errno.ENOENT,
        )

    def _file_tier(self) -> FileTier | None:
        return next((t for t in self.tiers.tiers if isinstance(t, FileTier)), None)

    def _operator_pin_cap(self) -> int:
        v = self.cfg["HPKV_OPERATOR_PIN_MAX"]
        return int(self.pool.size * v / 100.0) if isinstance(v, float) else int(v)

    @staticmethod
    def _ns_reply(ns: Namespace) -> dict[str, Any]:
        return {"id": ns.ns_id, "fingerprint": ns.fingerprint, "name": ns.name}

    # ------------------------------------------------------------ hpkv evict
    def _ctl_evict(self, conn: ServerConn, msg: dict[str, Any]) -> dict[str, Any] | None:
        """Drop a namespace's blocks from DRAM and/or storage (all of them, or those not used for
        ``older_than_s``), never pinned, reserved, promoting or in-IO ones (counted as skipped).
        DRAM is answered at once; storage files are deleted on a thread of this call (the
        catalog's forget path: journals, capacity accounting, KV events) and answered after."""
        self._operator(conn, "evict blocks")
        tier = msg.get("tier", "dram")
        if tier not in TIERS_EVICTED:
            raise ValueError(f"tier {tier!r} is not one of {', '.join(TIERS_EVICTED)}")
        older = msg.get("older_than_s")
        if older is not None and (not isinstance(older, int | float) or not 0 <= older < 1e9):
            raise ValueError(f"older_than_s {older!r} is not a number of seconds >= 0")
        dry = bool(msg.get("dry_run"))
        ft = self._file_tier()
        if tier == "storage" and ft is None:
            raise HpkvError("this server has no storage tier (HPKV_KV_STORAGE_PATH is empty)", -errno.ENOENT)
        reply: dict[str, Any] = {"ok": True, "dry_run": dry, "tier": tier}
        with self.lock:
            ns = self._ns_named(msg)
            reply["namespace"] = self._ns_reply(ns)
            cutoff = None if older is None else time.monotonic() - older
            if tier != "dram" and ft is not None and self._evicting_files:  # before DRAM changes
                raise HpkvError(
                    "another `hpkv evict` is deleting files; try again when it ends", -errno.EBUSY
                )
            if tier in ("dram", "all"):
                victims, skipped = self.index.dram_victims(ns, cutoff)
                n = len(victims) if dry else self.index.drop_dram(victims)
                if not dry:
                    self._publish_pool_gauges()
                reply["dram"] = {"blocks": n, "bytes": n * ns.slot_bytes * ns.world_size, "skipped": skipped}
            if tier == "dram" or ft is None:
                log.info("operator evict (pid %d) of namespace %s from DRAM: %s", conn.pid, ns.ns_id, reply)
                return reply
            keys, skipped_s = ft.file_victims(ns)
            if cutoff is not None:  # a block used from DRAM lately is in use, whatever its files say
                recent = {k for k in keys if (b := self.index.blocks.get(k)) is not None and b.used > cutoff}
                skipped_s["recent"] = len(recent)
                keys = [k for k in keys if k not in recent]
            self._evicting_files = True
        self._evict_files(conn, ns, ft, keys, skipped_s, older, dry, reply)
        return None

    def _evict_files(
        self,
        conn: ServerConn,
        ns: Namespace,
        ft: FileTier,
        keys: list[bytes],
        skipped_s: dict[str, int],
        older: float | None,
        dry: bool,
        reply: dict[str, Any],
    ) -> None:
        """`hpkv evict`'s storage part, on a thread of its own (stat and unlink may wait on the
        mount); the control thread answers ``reply`` with its outcome once it ends."""
        file_bytes = ns.world_size * kvfile.file_size(ns.shard_bytes)
        result: dict[str, Any] = {}

        def delete() -> None:
            try:
                chosen = keys
                if older is not None:
                    wall_cutoff = time.time_ns() - int(older * 1e9)
                    chosen = [k for k in keys if ft.last_used_ns(ns, k) <= wall_cutoff]
                    skipped_s["recent"] += len(keys) - len(chosen)
                if dry:
                    gone, files = chosen, len(chosen) * ns.world_size
                else:
                    gone, files = ft.delete_files(ns, chosen)
                    skipped_s["in_use"] = len(chosen) - len(gone)  # came into use meanwhile
                result["storage"] = {
                    "blocks": len(gone),
                    "bytes": len(gone) * file_bytes,
                    "files": files,
                    "skipped": skipped_s,
                }
            except Exception as exc:  # noqa: BLE001 - answered as a refusal by the control thread
                result["error"] = exc
            finally:
                result["done"] = True

        def answer() -> dict[str, Any] | None:
            if not result.get("done"):
                return None
            with self.lock:
                self._evicting_files = False
            if "error" in result:
                exc = result["error"]
                return refusal(Status.INTERNAL, f"deleting files failed: {type(exc).__name__}: {exc}")
            reply["storage"] = result["storage"]
            log.info("operator evict (pid %d) of namespace %s: %s", conn.pid, ns.ns_id, reply)
            return reply

        threading.Thread(target=delete, name="hpkv-evict", daemon=True).start()
        self._operator_jobs.append(OperatorJob(conn, answer))

    # ------------------------------------------------------------ hpkv prefetch
    def _ctl_prefetch(self, conn: ServerConn, msg: dict[str, Any]) -> dict[str, Any] | None:
        """Read a namespace's storage blocks into DRAM, most recently used first, within
        ``max_bytes`` (default and at most: what is free in the pool, so nothing is evicted for
        it) and ``newest`` blocks; answered when the reads end or after ``timeout_s``."""
        self._operator(conn, "prefetch blocks")
        max_bytes = msg.get("max_bytes")
        if max_bytes is not None:
            max_bytes = int_arg(msg, "max_bytes", 0, 1 << 50)
        newest = None if msg.get("newest") is None else int_arg(msg, "newest", 1, 1 << 40)
        wait = msg.get("timeout_s", 30.0)
        if not isinstance(wait, int | float) or not 0 < wait <= MAX_PREFETCH_WAIT_S:
            raise ValueError(f"timeout_s {wait!r} is not a number of seconds in (0, {MAX_PREFETCH_WAIT_S:g}]")
        ft = self._file_tier()
        if ft is None:
            raise HpkvError("this server has no storage tier (HPKV_KV_STORAGE_PATH is empty)", -errno.ENOENT)
        t0 = time.monotonic()
        with self.lock:
            ns = self._ns_named(msg)
            free = self.index.alloc.free_bytes
            budget = free if max_bytes is None else min(max_bytes, free)
            keys = ft.prefetch(ns, budget, newest)
            degraded = ft.degraded
        deadline = t0 + wait
        size = ns.slot_bytes * ns.world_size

        def answer() -> dict[str, Any] | None:
            with self.lock:
                running = sum(ft.promoting(k) for k in keys)
                if running and time.monotonic() < deadline:
                    return None
                loaded = sum(self.index.in_dram(ns, k) for k in keys)
                self._publish_pool_gauges()  # `hpkv status` right after shows what it loaded
            out = {
                "ok": True,
                "namespace": self._ns_reply(ns),
                "blocks": loaded,
                "bytes": loaded * size,
                "queued": len(keys),
                "failed": len(keys) - loaded - running,
                "still_reading": running,
                "budget_bytes": budget,
                "free_bytes": free,
                "seconds": round(time.monotonic() - t0, 3),
                "degraded": degraded,
            }
            log.info("operator prefetch (pid %d) of namespace %s: %s", conn.pid, ns.ns_id, out)
            return out

        reply = answer()
        if reply is None:
            self._operator_jobs.append(OperatorJob(conn, answer))
        return reply

    # ------------------------------------------------------------ hpkv pin / unpin
    def _operator_keys(self, msg: dict[str, Any]) -> list[bytes] | None:
        """``msg["keys"]`` (hex strings) as keys, None with ``all``; a bad key is refused by value."""
        if msg.get("all"):
            if msg.get("keys"):
                raise ValueError("give 'keys' or 'all', not both")
            return None
        raw = msg.get("keys")
        if not isinstance(raw, list) or not raw:
            raise ValueError("'keys' must be a non-empty list of hex keys (or 'all': true)")
        if len(raw) > MAX_OPERATOR_KEYS:
            raise ValueError(f"{len(raw)} keys in one call, more than {MAX_OPERATOR_KEYS}: split it")
        out = []
        for i, k in enumerate(raw):
            if not isinstance(k, str) or len(k) != 2 * KEY_BYTES:
                raise ValueError(f"key {i + 1} {printable(k, 64)!r} is not {2 * KEY_BYTES} hex digits")
            try:
                out.append(bytes.fromhex(k))
            except ValueError:
                raise ValueError(
                    f"key {i + 1} {printable(k, 64)!r} is not {2 * KEY_BYTES} hex digits"
                ) from None
        return out

    def _ctl_pin(self, conn: ServerConn, msg: dict[str, Any]) -> dict[str, Any]:
        """Pin a namespace's DRAM blocks against eviction until `hpkv unpin` or the server's
        restart (no lease), within HPKV_OPERATOR_PIN_MAX bytes in all namespaces together."""
        self._operator(conn, "pin blocks")
        keys = self._operator_keys(msg)
        cap = self._operator_pin_cap()
        with self.lock:
            ns = self._ns_named(msg)
            if keys is None:
                keys = [k for k, b in self.index.blocks.items() if b.ns is ns and b.state == State.READY]
            try:
                n, nbytes, missing = self.index.operator_pin(ns, keys, cap)
            except PinCapExceeded as exc:
                raise HpkvError(
                    f"pinning these blocks would make {format_size(exc.total)} pinned by the operator, "
                    f"over HPKV_OPERATOR_PIN_MAX ({format_size(cap)}); unpin some (`hpkv unpin`) or "
                    "raise HPKV_OPERATOR_PIN_MAX",
                    -errno.ENOSPC,
                ) from None
            self._publish_pool_gauges()
            total = self.index.operator_pinned_bytes()
            ns_bytes = int(ns.counters[NsCounter.BYTES_PINNED_OPERATOR])
        log.info(
            "operator pin (pid %d) in namespace %s: %d block(s), %d byte(s)", conn.pid, ns.ns_id, n, nbytes
        )
        return {
            "ok": True,
            "namespace": self._ns_reply(ns),
            "pinned": n,
            "bytes": nbytes,
            "not_in_dram": len(missing),
            "not_in_dram_keys": [k.hex() for k in missing[:10]],
            "namespace_pinned_bytes": ns_bytes,
            "operator_pinned_bytes": total,
            "cap_bytes": cap,
        }

    def _ctl_unpin(self, conn: ServerConn, msg: dict[str, Any]) -> dict[str, Any]:
        self._operator(conn, "unpin blocks")
        keys = self._operator_keys(msg)
        with self.lock:
            ns = self._ns_named(msg)
            n, nbytes = self.index.operator_unpin(ns, keys)
            self._publish_pool_gauges()
            total = self.index.operator_pinned_bytes()
        log.info("operator unpin (pid %d) in namespace %s: %d block(s)", conn.pid, ns.ns_id, n)
        return {
            "ok": True,
            "namespace": self._ns_reply(ns),
            "unpinned": n,
            "bytes": nbytes,
            "operator_pinned_bytes": total,
        }

"""The server's control calls (hello, hold, stats, shutdown, namespace, register_device,
clear, events, time_saved): one line of JSON in, its reply out. :class:`hpkv.engine.control.ControlTransport`
carries the lines; these methods run on its thread and answer them.

:class:`ControlCalls` is a part of :class:`hpkv.engine.server.Server` (its base class), like
:class:`hpkv.engine.registry.Registry`, on the server's state and under its lock.
"""

from __future__ import annotations

import base64
import errno
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hpkv.common.proc import PID_MAX, valid_pid
from hpkv.common.text import printable
from hpkv.engine.control import Conn, ControlTransport
from hpkv.engine.devices import int_arg
from hpkv.engine.events import MAX_READ, NsEventLog
from hpkv.engine.registry import MAX_NAME, Client
from hpkv.engine.supervisor import Supervision
from hpkv.protocol.errors import TOO_MANY_CONNECTIONS, HpkvError, NamespaceNotAttached, Status, refusal
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

"""The control socket's transport: accept, read lines, buffer and send replies, close. It knows
nothing of the calls it carries: each complete line goes to one handler, whose reply (a JSON
object, or None when it is sent later with :meth:`ControlTransport.send`) goes back as one line.

One thread (the server's control thread) runs :meth:`ControlTransport.serve` and is the only
one that touches the connections. It never blocks on one client: replies are buffered per
connection and sent as the socket takes them; a client whose line or unread replies grow past
their caps is dropped with a log line. Who may connect is checked on accept (the peer's
credentials, HPKV_ALLOW_GROUP), and so is how many may (HPKV_MAX_CONTROL_CONNECTIONS, lowered
to what the open-file limit allows); when accept() itself runs out of descriptors, the waiting
client is told why with a descriptor kept spare for that.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import resource
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from hpkv.common.ratelimit import RateLimitedLog
from hpkv.common.security import peer_allowed, peer_credentials
from hpkv.protocol.errors import TOO_MANY_CONNECTIONS, refusal

log = logging.getLogger("hpkv.server")

MAX_CONTROL_LINE = 1 << 20  # bytes of one control line (a register_device is a few KiB)
MAX_CONTROL_BACKLOG = 4 << 20  # unread reply bytes before a client that never reads is dropped
FD_RESERVE = 256  # descriptors kept for the pool, rings, workers and files beside control connections
ACCEPT_BACKOFF_S = 0.5  # the listener's rest when accept() finds no descriptor left


@dataclass
class Conn:
    """One control connection: its peer, its partial input line and its unsent replies."""

    sock: socket.socket
    pid: int
    uid: int
    inbuf: bytearray = field(default_factory=bytearray)
    out: bytearray = field(default_factory=bytearray)
    events: int = selectors.EVENT_READ
    closed: bool = False

    def describe(self) -> str:
        """Who is at the other end, for log lines."""
        return f"pid {self.pid}"


C = TypeVar("C", bound=Conn)


class ControlTransport(Generic[C]):
    """The control socket's connections, for one handler of lines.

    ``new_conn(sock, pid, uid)`` makes the record of an accepted connection (the caller's own
    subclass of :class:`Conn`, with what it keeps per connection); ``handle(conn, line)`` answers
    one line (without its newline) and never raises; ``on_close(conn, reason)`` is told once
    when a connection ends, on this thread, before its socket is closed."""

    def __init__(
        self,
        listener: socket.socket,
        *,
        max_conns: int,
        allow_group: int | None,
        new_conn: Callable[[socket.socket, int, int], C],
        handle: Callable[[C, bytes], dict[str, Any] | None],
        on_close: Callable[[C, str], None],
    ):
        self.listener = listener
        self.allow_group = allow_group
        self.new_conn = new_conn
        self.handle = handle
        self.on_close = on_close
        self.n_conns = 0  # open connections
        self.max_conns = max_conns
        self._spare_fd: int | None = None  # closed to accept and refuse when out of descriptors
        self._accept_paused_until = 0.0
        self._sel = selectors.DefaultSelector()
        self._errors = RateLimitedLog(log)
        self._limit_connections()

    def serve(self, down: threading.Event, on_round: Callable[[], float]) -> None:
        """Serve until ``down`` is set. ``on_round()`` is called at the start of every round,
        on this thread (it may :meth:`send`), and returns how long the round may wait."""
        sel = self._sel
        sel.register(self.listener, selectors.EVENT_READ, None)
        while not down.is_set():
            timeout = on_round()
            if self._accept_paused_until:  # out of descriptors: the listener rests a while
                timeout = min(timeout, max(self._accept_paused_until - time.monotonic(), 0.0))
                if timeout == 0.0:
                    self._accept_paused_until = 0.0
                    sel.register(self.listener, selectors.EVENT_READ, None)
            try:
                events = sel.select(timeout=timeout)
            except (OSError, ValueError):
                return
            for key, mask in events:
                if key.fileobj is self.listener:
                    self._accept()
                    continue
                conn: C = key.data
                try:
                    if mask & selectors.EVENT_WRITE:
                        self._flush(conn)
                    if mask & selectors.EVENT_READ and not conn.closed:
                        self._read(conn)
                except Exception as exc:  # noqa: BLE001 - one connection must not end the thread
                    self._errors.log(
                        logging.ERROR,
                        "control-conn",
                        "control connection of pid %d failed: %s",
                        conn.pid,
                        exc,
                        exc_info=True,
                    )
                    self._close(conn, f"connection error: {exc}")

    def send(self, conn: C, reply: dict[str, Any]) -> None:
        """Queue one reply line and send what the socket takes now (the serving thread only)."""
        if conn.closed:
            return
        conn.out += json.dumps(reply).encode() + b"\n"
        if len(conn.out) > MAX_CONTROL_BACKLOG:
            log.warning(
                "%s does not read its control replies (%d bytes unread): dropped",
                conn.describe(),
                len(conn.out),
            )
            self._close(conn, "does not read its replies")
            return
        self._flush(conn)

    # ------------------------------------------------------------------ accept
    def _limit_connections(self) -> None:
        """HPKV_MAX_CONTROL_CONNECTIONS, lowered to what the open-file limit leaves beside the
        server's other descriptors; the soft limit is raised toward the hard one if need be.
        A descriptor is kept spare, so that even at the limit a client is told why it is refused."""
        asked = cap = self.max_conns
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        need = cap + FD_RESERVE
        if soft != resource.RLIM_INFINITY and soft < need:
            new = need if hard == resource.RLIM_INFINITY else min(need, hard)
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
                soft = new
            if soft < need:
                cap = max(1, soft - FD_RESERVE)
                log.warning(
                    "HPKV_MAX_CONTROL_CONNECTIONS=%d lowered to %d: the open-file limit is %d "
                    "(ulimit -n) and the server keeps %d descriptors for its pool, rings and workers",
                    asked,
                    cap,
                    soft,
                    FD_RESERVE,
                )
        self.max_conns = cap
        self._spare_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    def _refuse(self, sock: socket.socket, status: int, error: str) -> None:
        """Tell a just-accepted client why it is refused (one line, never blocking), then close."""
        with contextlib.suppress(OSError):
            sock.setblocking(False)
            sock.send(json.dumps(refusal(status, error)).encode() + b"\n")
        sock.close()

    def _accept_without_fds(self, exc: OSError) -> None:
        """accept() failed for want of a descriptor: the listener would stay readable and the
        control thread would spin. Refuse the waiting client with the spare descriptor; where
        even that fails, leave the listener alone for ACCEPT_BACKOFF_S."""
        self._errors.log(
            logging.ERROR,
            "accept-emfile",
            "cannot accept a control connection: %s (%d open, open-file limit %d): refusing new "
            "clients; raise the limit (ulimit -n) or lower HPKV_MAX_CONTROL_CONNECTIONS",
            exc.strerror,
            self.n_conns,
            resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        )
        refused = False
        if self._spare_fd is not None:
            os.close(self._spare_fd)
            self._spare_fd = None
            with contextlib.suppress(OSError):
                sock, _ = self.listener.accept()
                self._refuse(
                    sock,
                    TOO_MANY_CONNECTIONS,
                    f"the hpkv server is out of file descriptors ({self.n_conns} control connections "
                    "open); try again later",
                )
                refused = True
            with contextlib.suppress(OSError):
                self._spare_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        if not refused or self._spare_fd is None:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(self.listener)
            self._accept_paused_until = time.monotonic() + ACCEPT_BACKOFF_S

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                self._accept_without_fds(exc)
            return
        try:
            pid, uid, gid = peer_credentials(sock)
        except OSError:
            pid, uid, gid = 0, -1, -1
        if self.n_conns >= self.max_conns:
            self._errors.log(
                logging.WARNING,
                "too-many-connections",
                "refused a control connection from pid %d: %d are open (HPKV_MAX_CONTROL_CONNECTIONS=%d)",
                pid,
                self.n_conns,
                self.max_conns,
            )
            self._refuse(
                sock,
                TOO_MANY_CONNECTIONS,
                f"the hpkv server has {self.n_conns} control connections open, its limit "
                f"(HPKV_MAX_CONTROL_CONNECTIONS={self.max_conns}); try again later or raise it",
            )
            return
        if not peer_allowed(pid, uid, gid, self.allow_group):
            self._errors.log(
                logging.WARNING,
                "peer-refused",
                "refused a connection from pid %d (uid %d, gid %d): only uid %d%s may connect",
                pid,
                uid,
                gid,
                os.geteuid(),
                f" and group {self.allow_group} (HPKV_ALLOW_GROUP)"
                if self.allow_group is not None
                else " (HPKV_ALLOW_GROUP names a group that may too)",
            )
            self._refuse(
                sock, -errno.EACCES, f"uid {uid} may not use this hpkv server (see HPKV_ALLOW_GROUP)"
            )
            return
        sock.setblocking(False)
        conn = self.new_conn(sock, pid, uid)
        self._sel.register(sock, selectors.EVENT_READ, conn)
        self.n_conns += 1

    # ------------------------------------------------------------------ read, send, close
    def _read(self, conn: C) -> None:
        try:
            chunk = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._close(conn, "connection closed")
            return
        buf = conn.inbuf
        start = 0
        scan = len(buf)  # only the new bytes are searched: linear in what arrives
        buf += chunk
        while not conn.closed:
            end = buf.find(b"\n", scan)
            if end < 0:
                break
            line = bytes(buf[start:end])
            start = scan = end + 1
            reply = self.handle(conn, line)
            if reply is not None:  # None: answered later (send)
                self.send(conn, reply)
        if conn.closed:
            return
        del buf[:start]
        if len(buf) > MAX_CONTROL_LINE:
            log.warning(
                "%s sent a control line longer than %d bytes: dropped",
                conn.describe(),
                MAX_CONTROL_LINE,
            )
            self._close(conn, "control line too long")

    def _flush(self, conn: C) -> None:
        if conn.closed:
            return
        while conn.out:
            try:
                n = conn.sock.send(conn.out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._close(conn, f"send failed: {exc}")
                return
            del conn.out[:n]
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
        if want != conn.events:
            conn.events = want
            self._sel.modify(conn.sock, want, conn)

    def _close(self, conn: C, reason: str) -> None:
        if conn.closed:
            return
        conn.closed = True
        self.n_conns -= 1
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(conn.sock)
        self.on_close(conn, reason)
        conn.sock.close()

"""The control socket's transport on its own (hpkv.engine.control), with a trivial handler:
lines in, replies out, however the bytes are cut; closes and oversized lines reach the
close hook with their reason; the connection cap refuses with a reason the client reads."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import pytest

from hpkv.engine.control import MAX_CONTROL_LINE, Conn, ControlTransport
from hpkv.protocol.errors import TOO_MANY_CONNECTIONS


class Echo:
    """A transport whose handler answers each line with its text and counts the closes."""

    def __init__(self, path: str, max_conns: int = 8):
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(8)
        self.listener.setblocking(False)
        self.closed: list[str] = []
        self.closed_event = threading.Event()
        self.transport = ControlTransport(
            self.listener,
            max_conns=max_conns,
            allow_group=None,
            new_conn=Conn,
            handle=lambda conn, line: {"ok": True, "echo": line.decode()},
            on_close=self._on_close,
        )
        self.down = threading.Event()
        self.thread = threading.Thread(target=self.transport.serve, args=(self.down, lambda: 0.05))
        self.thread.start()

    def _on_close(self, conn: Conn, reason: str) -> None:
        self.closed.append(reason)
        self.closed_event.set()

    def stop(self) -> None:
        self.down.set()
        self.thread.join(5)
        self.listener.close()


@pytest.fixture
def echo(tmp_path) -> Iterator[Echo]:
    e = Echo(str(tmp_path / "ctl.sock"))
    yield e
    e.stop()


def _connect(e: Echo) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(e.listener.getsockname())
    return s


def _lines(s: socket.socket, n: int) -> list[dict]:
    buf = b""
    while buf.count(b"\n") < n:
        chunk = s.recv(65536)
        assert chunk, f"closed after {buf!r}"
        buf += chunk
    return [json.loads(x) for x in buf.split(b"\n")[:n]]


def test_each_line_gets_one_reply_however_the_bytes_are_cut(echo):
    s = _connect(echo)
    s.sendall(b"one\ntw")
    assert _lines(s, 1) == [{"ok": True, "echo": "one"}]
    s.sendall(b"o\nthree\n")
    assert _lines(s, 2) == [{"ok": True, "echo": "two"}, {"ok": True, "echo": "three"}]
    s.close()


def test_a_closed_connection_reaches_the_close_hook_once(echo):
    s = _connect(echo)
    s.sendall(b"hi\n")
    _lines(s, 1)
    s.close()
    assert echo.closed_event.wait(5)
    assert echo.closed == ["connection closed"]
    assert echo.transport.n_conns == 0


def test_a_line_longer_than_the_cap_closes_the_connection(echo):
    s = _connect(echo)
    s.sendall(b"x" * (MAX_CONTROL_LINE + 1))
    assert echo.closed_event.wait(5)
    assert echo.closed == ["control line too long"]
    s.close()


def test_a_connection_beyond_the_cap_is_refused_with_the_reason(tmp_path):
    e = Echo(str(tmp_path / "ctl.sock"), max_conns=1)
    try:
        first = _connect(e)
        first.sendall(b"a\n")
        _lines(first, 1)  # accepted and counted
        second = _connect(e)
        [answer] = _lines(second, 1)
        assert answer["ok"] is False and answer["status"] == TOO_MANY_CONNECTIONS
        assert "HPKV_MAX_CONTROL_CONNECTIONS=1" in answer["error"]
        first.close()
        second.close()
    finally:
        e.stop()

"""``hpkv stop``: ask the server of a pool directory to drain its spills and exit."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import sys
import time

from hpkv.config import Config
from hpkv.protocol.errors import HpkvUnavailable, raise_refusal
from hpkv.protocol.wire import SOCKET_FILE, live_server_pid


def _ask_to_stop(cfg: Config, timeout: float) -> dict | None:
    """Ask the server over its socket to stop and wait for the outcome of its spill drain;
    None if it cannot be asked (then a signal does it, without the report)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(os.path.join(cfg.pool_dir, SOCKET_FILE))
        s.sendall(json.dumps({"op": "shutdown", "pid": os.getpid(), "wait": True}).encode() + b"\n")
        line = s.makefile("rb").readline()
        return json.loads(line) if line else None
    except (OSError, ValueError):
        return None
    finally:
        s.close()


def stop_server(cfg: Config, timeout: float | None = None) -> int:
    """``hpkv stop``: the server writes pending spills (HPKV_STOP_DRAIN_TIMEOUT), then exits
    and removes its files; this says what happened and waits until it is gone."""
    pid = live_server_pid(cfg.pool_dir)
    if pid is None:
        print(f"hpkv: no server is running for the pool directory {cfg.pool_dir}", file=sys.stderr)
        return 1
    if timeout is None:
        timeout = float(cfg["HPKV_STOP_DRAIN_TIMEOUT"]) + 30.0
    deadline = time.monotonic() + timeout
    outcome = _ask_to_stop(cfg, timeout)
    if outcome is not None and outcome.get("status") == -errno.EACCES:
        print(f"hpkv: server {pid} refused to stop: {outcome.get('error')}", file=sys.stderr)
        return 1
    if outcome is None or not outcome.get("ok"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    while time.monotonic() < deadline:
        if live_server_pid(cfg.pool_dir) is None:
            print(f"hpkv: server {pid} stopped{_describe_drain(outcome)}")
            return 0
        time.sleep(0.05)
    print(f"hpkv: server {pid} did not stop within {timeout:g}s", file=sys.stderr)
    return 1


def _describe_drain(outcome: dict | None) -> str:
    if not outcome or "pending" not in outcome:
        return ""
    if outcome["dropped"]:
        return (
            f"; {outcome['dropped']} of {outcome['pending']} pending block(s) were NOT written to "
            f"storage (HPKV_STOP_DRAIN_TIMEOUT expired after {outcome['seconds']:g}s)"
        )
    if outcome["pending"]:
        return f"; {outcome['pending']} pending block(s) written to storage first ({outcome['seconds']:g}s)"
    return "; nothing was pending"


def operator_call(cfg: Config, op: str, timeout: float, **kwargs: object) -> dict:
    """One operator call (``evict``, ``prefetch``, ``pin``, ``unpin``) on the server's socket,
    without becoming a client (no rings, no hello): its reply, or :class:`HpkvError` with the
    server's reason (:class:`HpkvUnavailable` when no server answers within ``timeout``)."""
    if live_server_pid(cfg.pool_dir) is None:
        raise HpkvUnavailable(f"no server is running for the pool directory {cfg.pool_dir}")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(os.path.join(cfg.pool_dir, SOCKET_FILE))
        s.sendall(json.dumps({"op": op, "pid": os.getpid(), **kwargs}).encode() + b"\n")
        line = s.makefile("rb").readline()
    except OSError as exc:
        raise HpkvUnavailable(f"hpkv {op}: the server did not answer: {exc}") from None
    finally:
        s.close()
    if not line:
        raise HpkvUnavailable(f"hpkv {op}: the server closed the connection")
    reply = json.loads(line)
    raise_refusal(reply, f"hpkv {op}")
    return reply

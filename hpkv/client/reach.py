"""Reaching the hpkv server of a pool directory, starting it if none runs.

``connect(cfg)`` attaches to the server of the configured pool directory, or
starts one (``hpkv serve --auto``, detached into its own process group) and waits for it
with a bound. Every call is bounded too: a slow or dead server raises
:class:`HpkvUnavailable`, and the caller (the connector) falls back to recomputing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

from hpkv.client.client import HpkvClient
from hpkv.client.spawn import open_in_pool_dir, spawn_server
from hpkv.common.security import peer_credentials
from hpkv.config import Config, load_config
from hpkv.protocol import wire as P
from hpkv.protocol.errors import HpkvError, HpkvUnavailable, raise_refusal

log = logging.getLogger("hpkv.client")


def _try_connect(directory: str, timeout: float) -> socket.socket | None:
    """A connection to the server of the pool ``directory``; None when none listens."""
    sock_path = os.path.join(directory, P.SOCKET_FILE)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(sock_path)
    except (TimeoutError, FileNotFoundError, ConnectionRefusedError):
        s.close()
        return None
    except BlockingIOError:  # a Unix socket's full backlog: EAGAIN at once, not a timeout
        s.close()
        raise HpkvUnavailable(
            f"the hpkv server at {sock_path} takes no more connections (its backlog is full: "
            "it is overloaded or out of file descriptors, see its server.log); try again later"
        ) from None
    try:
        _check_server(s, directory)
    except BaseException:
        s.close()
        raise
    return s


def _check_server(sock: socket.socket, directory: str) -> None:
    """Talk only to a server in a directory nobody else can write, run by that directory's
    owner: the owner is us, or (HPKV_ALLOW_GROUP on the server) its group is one of ours.
    Another local user's look-alike socket would otherwise receive our hello and keys."""
    import stat as _stat

    st = os.lstat(directory)
    _, server_uid, _ = peer_credentials(sock)
    me = os.geteuid()
    problem = None
    if not _stat.S_ISDIR(st.st_mode) or st.st_mode & 0o022:
        problem = f"it is not a directory closed to other writers (mode {_stat.filemode(st.st_mode)})"
    elif st.st_uid != server_uid:
        problem = f"the server runs as uid {server_uid} but the directory belongs to uid {st.st_uid}"
    elif st.st_uid != me and st.st_gid not in (*os.getgroups(), os.getegid()):
        problem = f"it belongs to uid {st.st_uid}, not to us (uid {me}) nor shared with our groups"
    if problem:
        raise HpkvError(
            f"refusing the hpkv server in {directory}: {problem}. Another user may have "
            f"made it; remove it (as its owner or root) or set HPKV_SHARE_MEM_FILE_PATH "
            f"to a directory of your own"
        )


class _ServerLeaving(HpkvUnavailable):
    """The server we reached is stopping: it refused us, or closed or reset the connection at once."""


def _handshake(sock: socket.socket, msg: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    """Send the first call of a connection and return its reply, within ``timeout``."""
    sock.settimeout(timeout)
    reset: OSError | None = None
    try:
        sock.sendall(json.dumps(msg).encode() + b"\n")
    except (ConnectionResetError, BrokenPipeError) as exc:
        reset = exc  # a server that refused us at once has closed: its reason may still be queued
    except TimeoutError:
        raise HpkvUnavailable(f"the hpkv server did not take {msg['op']!r} within {timeout:g}s") from None
    except OSError as exc:
        raise HpkvUnavailable(f"hpkv {msg['op']!r} failed: {exc}") from None
    try:
        with sock.makefile("rb") as f:
            line = f.readline()
    except TimeoutError:
        raise HpkvUnavailable(f"the hpkv server did not answer {msg['op']!r} within {timeout:g}s") from None
    except (ConnectionResetError, BrokenPipeError) as exc:
        line, reset = b"", reset or exc
    except OSError as exc:
        raise HpkvUnavailable(f"hpkv {msg['op']!r} failed: {exc}") from None
    if not line and reset is not None:
        raise _ServerLeaving(f"the hpkv server reset the connection during {msg['op']!r} ({reset})")
    if not line:
        raise _ServerLeaving(f"the hpkv server closed the connection during {msg['op']!r}")
    reply = json.loads(line)
    if not reply.get("ok") and reply.get("status") == -errno.ESHUTDOWN:
        raise _ServerLeaving(str(reply.get("error")))
    raise_refusal(reply, f"hpkv {msg['op']!r}")
    return reply


def _reach(
    cfg: Config, env: Mapping[str, str] | None, timeout: float, spawn: bool, msg: dict[str, Any]
) -> tuple[socket.socket, dict[str, Any]]:
    """A connection to the pool directory's server that has answered ``msg``, starting a
    server if none runs. A server that is stopping (an idle exit, ``hpkv stop``) when we
    reach it is waited out and replaced, within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        sock = _try_connect(cfg.pool_dir, min(5.0, max(deadline - time.monotonic(), 0.01)))
        if sock is None:
            if not spawn:
                raise HpkvUnavailable(f"no hpkv server is running for {cfg.pool_dir}")
            sock = _spawn_and_reach(cfg, env, max(deadline - time.monotonic(), 1.0))
        try:
            # The whole connect honours ``timeout``: a server that accepts but never answers
            # (hung, or its control thread stuck) costs the caller no more than that.
            return sock, _handshake(sock, msg, max(deadline - time.monotonic(), 0.01))
        except _ServerLeaving as exc:
            sock.close()
            if not spawn:
                raise
            leaving = P.live_server_pid(cfg.pool_dir)
            log.info("%s; waiting for server %s to exit, then starting a new one", exc, leaving)
            while leaving is not None and P.live_server_pid(cfg.pool_dir) == leaving:
                if time.monotonic() > deadline:
                    raise HpkvUnavailable(
                        f"the hpkv server (pid {leaving}) for {cfg.pool_dir} was still stopping "
                        f"after {timeout:g}s (it writes pending spills first, for at most "
                        f"HPKV_STOP_DRAIN_TIMEOUT): connect again once it has exited"
                    ) from None
                time.sleep(0.05)
        except BaseException:
            sock.close()
            raise


def connect(
    cfg: Config | None = None,
    *,
    spawn: bool = True,
    timeout: float = 60.0,
    call_timeout: float = 5.0,
    name: str = "",
    env: Mapping[str, str] | None = None,
) -> HpkvClient:
    """Attach to the pool directory's server, starting one if needed (at most one ever runs)."""
    cfg = cfg or load_config(env)
    sock, reply = _reach(cfg, env, timeout, spawn, {"op": "hello", "pid": os.getpid(), "name": name})
    return HpkvClient(cfg.pool_dir, sock, reply, call_timeout)


def ensure_server(
    cfg: Config, *, timeout: float = 60.0, env: Mapping[str, str] | None = None, hold: str = ""
) -> socket.socket | None:
    """Start the pool directory's server if none runs, without attaching to it: an engine
    calls this early in its start-up so the pool's memory is ready by its first request.

    With ``hold`` (a name for the server's log), the returned connection keeps an
    auto-spawned server from its idle exit until it is closed (or this process exits): an
    engine's start-up can take longer than HPKV_SERVER_IDLE_EXIT before it attaches."""
    if not hold:
        sock = _try_connect(cfg.pool_dir, 5.0) or _spawn_and_reach(cfg, env, timeout)
        sock.close()
        return None
    sock, _ = _reach(cfg, env, timeout, True, {"op": "hold", "pid": os.getpid(), "name": hold})
    return sock


def _spawn_and_reach(cfg: Config, env: Mapping[str, str] | None, timeout: float) -> socket.socket:
    """Spawn a server unless another spawner does; a socket connected to it."""
    deadline = time.monotonic() + timeout
    lock_fd = open_in_pool_dir(cfg, P.SPAWN_LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        while True:  # one spawner at a time; the others find its server
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise HpkvUnavailable(
                        f"timed out waiting for another process to start the hpkv server for {cfg.pool_dir}"
                    ) from None
                time.sleep(0.05)
        sock = _try_connect(cfg.pool_dir, 5.0)
        if sock is None:
            try:
                pid = spawn_server(cfg, env, timeout=max(deadline - time.monotonic(), 1.0))
            except HpkvUnavailable:
                # No server runs, so nothing else uses the directory: leave only server.log
                # (a spawner waiting on this lock meanwhile just spawns once more).
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(cfg.pool_dir, P.SPAWN_LOCK_FILE))
                raise
            if pid:
                log.info("started hpkv server pid %d for %s", pid, cfg.pool_dir)
            while sock is None:  # ready (or served by another server): its socket accepts
                if time.monotonic() > deadline:
                    raise HpkvUnavailable(
                        f"the hpkv server for {cfg.pool_dir} did not accept connections "
                        f"within {timeout:g}s; see {os.path.join(cfg.pool_dir, P.LOG_FILE)}"
                    )
                time.sleep(0.02)
                sock = _try_connect(cfg.pool_dir, 5.0)
    finally:
        os.close(lock_fd)
    return sock

"""Starting the hpkv server for an engine: ``hpkv serve --auto``, detached, with a bound."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any

from hpkv.common.security import open_nofollow, open_private_dir
from hpkv.config import Config
from hpkv.protocol import wire as P
from hpkv.protocol.errors import HpkvUnavailable

SPAWN_READY_TIMEOUT_S = 60.0


def open_in_pool_dir(cfg: Config, name: str, flags: int) -> int:
    """Open a file of the pool directory (created 0700 if missing) only if the directory is
    private to us, and never through a symlink (see hpkv.common.security)."""
    dir_fd = open_private_dir(cfg.pool_dir, "the pool directory (HPKV_SHARE_MEM_FILE_PATH)")
    try:
        return open_nofollow(dir_fd, name, flags)
    finally:
        os.close(dir_fd)


def spawn_server(
    cfg: Config, env: Mapping[str, str] | None = None, timeout: float = SPAWN_READY_TIMEOUT_S
) -> int:
    """Start ``hpkv serve --auto`` detached from the caller; returns its pid once it serves.

    The server double-forks (``--detach``): it is neither our child nor in our process
    group, so an engine's shutdown, which kills its whole process tree (vLLM's
    ``kill_process_tree``), or a Ctrl-C in the engine's terminal never reaches it. It stays
    in our session: with autogroup scheduling (most distributions' kernels) a session is a
    scheduling group, and a server in a session of its own would get as much CPU as the
    whole engine whenever both want it, so its idle-priority work (pool warming) and its
    write-through would take half of the engine's CPUs, nice values notwithstanding. It
    gets the configuration we resolved (:meth:`Config.to_env`), writes its output to
    ``server.log``, and reports ``ready`` or the reason it could not start through a pipe.
    Raises :class:`HpkvUnavailable` with that reason. Returns 0 when another server
    already holds the directory (a concurrent spawner won): connect to that one.
    """
    child_env = dict(os.environ if env is None else env)
    child_env.update(cfg.to_env())
    log_path = os.path.join(cfg.pool_dir, P.LOG_FILE)
    log_fd = open_in_pool_dir(cfg, P.LOG_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    ready_r, ready_w = os.pipe()
    # Out of the engine's process group at once (Ctrl-C); --detach does it again.
    own_group: dict[str, Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hpkv", "serve", "--auto", "--detach", f"--ready-fd={ready_w}"],
            env=child_env,
            stdin=subprocess.DEVNULL,
            stdout=log_fd,
            stderr=log_fd,
            **own_group,
            close_fds=True,
            pass_fds=(ready_w,),
        )
    finally:
        os.close(ready_w)
        os.close(log_fd)
    deadline = time.monotonic() + timeout
    try:
        proc.wait(timeout)  # the first fork exits at once
        message = _read_ready(ready_r, max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        message = f"error hpkv serve did not detach within {timeout:g}s"
    finally:
        os.close(ready_r)
    kind, _, detail = message.partition(" ")
    if kind == "ready":
        return int(detail)
    if kind == "served":  # another server holds the directory
        return 0
    reason = detail if detail != _DIED else f"{_DIED}; its log ends with: {_log_tail(log_path)}"
    raise HpkvUnavailable(f"the hpkv server for {cfg.pool_dir} could not start: {reason} (log: {log_path})")


_DIED = "it exited before it was ready"


def _log_tail(path: str, lines: int = 3) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
            tail = f.read().decode(errors="replace").strip().splitlines()
    except OSError as exc:
        return f"<cannot read it: {exc.strerror}>"
    return " | ".join(tail[-lines:]) or "<nothing>"


def _read_ready(fd: int, timeout: float) -> str:
    """The server's one status line: ``ready PID``, ``served PID`` or ``error REASON``; EOF
    without one means it died, and the last lines of its log say why."""
    data = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return f"error it did not become ready within {timeout:g}s"
        chunk = os.read(fd, 4096)
        if not chunk:
            return "error " + (data.decode(errors="replace").strip() or _DIED)
        data += chunk
    return data.split(b"\n", 1)[0].decode(errors="replace")

"""``hpkv serve``: the server process's main, in the foreground or detached (auto-spawned by
an engine, which reads its status line from the ready pipe)."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal

from hpkv.common.proc import unmap_big_frees
from hpkv.config import Config, ConfigError
from hpkv.engine.server import AlreadyServed, Server
from hpkv.protocol.errors import ExitCode
from hpkv.protocol.wire import LOG_FILE
from hpkv.runtime.logs import setup_logging

log = logging.getLogger("hpkv.server")


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
    in a process group of its own, re-parented to init. An engine that kills its descendants
    at shutdown (vLLM does, with SIGKILL) then no longer reaches this server, nor does a
    Ctrl-C in its terminal (SIGINT goes to the foreground process group). It stays in the
    engine's session, its scheduling group where the kernel groups by session (autogroup):
    see :func:`hpkv.client.spawn.spawn_server`."""
    if os.fork() > 0:
        os._exit(0)
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)


def serve(
    cfg: Config, auto: bool = False, log_level: str | None = None, ready: ReadyPipe | None = None
) -> int:
    """``hpkv serve``: run the server in the foreground until told to stop."""
    ready = ready or ReadyPipe(None)
    unmap_big_frees()  # the server's memory stays what it holds, not what its scans once used
    setup_logging(cfg.pool_dir, log_level or cfg["HPKV_LOG_LEVEL"], max_bytes=cfg["HPKV_LOG_MAX_BYTES"])
    # `kill -USR2 <server pid>` writes every thread's stack to the log: what a stuck server waits on.
    stacks = open(os.path.join(cfg.pool_dir, LOG_FILE), "a")  # noqa: SIM115 - open for the process's life
    faulthandler.register(signal.SIGUSR2, file=stacks, all_threads=True)
    server = Server(cfg, auto=auto)
    try:
        server.start()
    except AlreadyServed as exc:
        log.info("%s", exc)
        ready.send(f"served {exc.pid or 0}")
        return ExitCode.ALREADY_SERVED
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

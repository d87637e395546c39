"""Logging of the server and its workers: stderr plus ``server.log`` in the pool directory.

Every process of a server appends to ``server.log``. The server alone rotates it: once it
has grown past HPKV_LOG_MAX_BYTES it is renamed ``server.log.1`` (``.1`` becomes ``.2`` and
so on, LOG_BACKUPS kept) and a new one is started. Every process notices at its next log
line that the name now points to another file and reopens it; where its stdout or stderr
was the old file (a spawned server's output, its workers' inherited stderr), they follow.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import sys
from typing import TextIO

from hpkv.common.security import InsecurePath, open_nofollow, open_private_dir
from hpkv.protocol.wire import LOG_FILE

FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"
LOG_BACKUPS = 3  # server.log.1 .. server.log.3


def setup_logging(directory: str, level: str, to_stderr: bool = True, max_bytes: int = 0) -> None:
    """Log to stderr and to ``directory``/server.log; ``max_bytes`` > 0 (the server's
    HPKV_LOG_MAX_BYTES): this process rotates the file at that size."""
    fmt = logging.Formatter(FORMAT)
    root = logging.getLogger("hpkv")
    root.setLevel(level)
    root.handlers.clear()
    root.propagate = False
    path = os.path.join(directory, LOG_FILE)
    if to_stderr and not _same_file(2, path):  # a spawned server's stderr is server.log itself
        h = StderrHandler()
        h.setFormatter(fmt)
        root.addHandler(h)
    try:
        fh = PoolLogHandler(directory, max_bytes)
    except InsecurePath as exc:
        root.error("not writing %s: %s", LOG_FILE, exc)
    except OSError as exc:
        root.warning("cannot write the log file in %s: %s", directory, exc)
    else:
        fh.setFormatter(fmt)
        root.addHandler(fh)


class StderrHandler(logging.Handler):
    """stderr that never blocks: the server logs under its lock, so a stderr pipe nobody
    reads (a harness that reads it at exit, a stopped ``| less``) must not stall every
    engine. A line that does not fit now is dropped and counted, and the next line that
    fits says so; ``server.log`` has every line."""

    def __init__(self, fd: int = 2):
        super().__init__()
        self.fd = fd
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            data = (self.format(record) + "\n").encode(errors="replace")
            if self.dropped and self._write(
                f"hpkv: {self.dropped} log line(s) not written to stderr (nobody read it); "
                f"{LOG_FILE} has them\n".encode()
            ):
                self.dropped = 0
            if not self._write(data):
                self.dropped += 1
        except Exception:  # noqa: BLE001 - logging's own rule: never raise into the caller
            self.handleError(record)

    def _write(self, data: bytes) -> bool:
        """Write in pieces of at most PIPE_BUF, each only when the fd has room for it (a pipe
        writes such a piece whole or not at all); False when it had no room."""
        for i in range(0, len(data), select.PIPE_BUF):
            if not select.select([], [self.fd], [], 0)[1]:
                return False
            os.write(self.fd, data[i : i + select.PIPE_BUF])
        return True


def _open_log(directory: str) -> int:
    # Only in a directory that is ours, and never through a symlink: a planted
    # server.log -> /some/file of ours would otherwise be appended to.
    dir_fd = open_private_dir(directory, "the pool directory (HPKV_SHARE_MEM_FILE_PATH)")
    try:
        return open_nofollow(dir_fd, LOG_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    finally:
        os.close(dir_fd)


class PoolLogHandler(logging.StreamHandler):
    """``server.log``, rotated by the process given ``max_bytes``, followed by every other."""

    def __init__(self, directory: str, max_bytes: int = 0):
        self.directory = directory
        self.path = os.path.join(directory, LOG_FILE)
        self.max_bytes = max_bytes
        super().__init__(self._fdopen(_open_log(directory)))

    @staticmethod
    def _fdopen(fd: int) -> TextIO:
        return os.fdopen(fd, "a", buffering=1, encoding="utf-8", errors="backslashreplace")

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        try:
            st = os.fstat(self.stream.fileno())
            if self.max_bytes and st.st_size >= self.max_bytes:
                self._rotate()
            elif not _same_file_stat(st, self.path):
                self._switch(_open_log(self.directory))  # rotated by the server: follow
        except (OSError, InsecurePath) as exc:
            # Keep writing to the file we have; say so once per failure, not per line.
            if getattr(self, "_rotate_failed", None) != str(exc):
                self._rotate_failed = str(exc)
                self.stream.write(f"hpkv: cannot rotate or reopen {self.path}: {exc}\n")

    def _rotate(self) -> None:
        dir_fd = open_private_dir(self.directory, "the pool directory (HPKV_SHARE_MEM_FILE_PATH)")
        try:
            for i in range(LOG_BACKUPS - 1, 0, -1):  # renames never follow a symlink planted there
                with contextlib.suppress(FileNotFoundError):
                    os.rename(f"{LOG_FILE}.{i}", f"{LOG_FILE}.{i + 1}", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.rename(LOG_FILE, f"{LOG_FILE}.1", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            fd = open_nofollow(dir_fd, LOG_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        finally:
            os.close(dir_fd)
        self._switch(fd)

    def _switch(self, fd: int) -> None:
        """Write to ``fd`` from now on; stdout and stderr too where they were our old file."""
        old = self.stream
        old_st = os.fstat(old.fileno())
        for std, stream in ((1, sys.stdout), (2, sys.stderr)):
            try:
                st = os.fstat(std)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (old_st.st_dev, old_st.st_ino):
                with contextlib.suppress(ValueError, OSError, AttributeError):
                    stream.flush()
                os.dup2(fd, std)
        self.stream = self._fdopen(fd)
        with contextlib.suppress(OSError):
            old.close()


def _same_file_stat(st: os.stat_result, path: str) -> bool:
    try:
        other = os.stat(path)
    except OSError:
        return True  # nothing there (being rotated): keep what we have
    return (st.st_dev, st.st_ino) == (other.st_dev, other.st_ino)


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)

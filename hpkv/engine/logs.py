"""Logging of the server and its workers: stderr plus ``server.log`` in the pool directory."""

from __future__ import annotations

import logging
import os
import sys

from hpkv.common.security import InsecurePath, open_nofollow, open_private_dir
from hpkv.protocol.wire import LOG_FILE

FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"


def setup_logging(directory: str, level: str, to_stderr: bool = True) -> None:
    fmt = logging.Formatter(FORMAT)
    root = logging.getLogger("hpkv")
    root.setLevel(level)
    root.handlers.clear()
    root.propagate = False
    path = os.path.join(directory, LOG_FILE)
    if to_stderr and not _is_stderr(path):  # a spawned server's stderr is server.log itself
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(fmt)
        root.addHandler(h)
    try:
        # Only in a directory that is ours, and never through a symlink: a planted
        # server.log -> /some/file of ours would otherwise be appended to.
        dir_fd = open_private_dir(directory, "the pool directory (HPKV_SHARE_MEM_FILE_PATH)")
        try:
            fd = open_nofollow(dir_fd, LOG_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        finally:
            os.close(dir_fd)
        fh = logging.StreamHandler(os.fdopen(fd, "a", buffering=1, encoding="utf-8"))
        fh.setFormatter(fmt)
        root.addHandler(fh)
    except InsecurePath as exc:
        root.error("not writing %s: %s", LOG_FILE, exc)
    except OSError as exc:
        root.warning("cannot write the log file in %s: %s", directory, exc)


def _is_stderr(path: str) -> bool:
    try:
        err, log = os.fstat(2), os.stat(path)
    except OSError:
        return False
    return (err.st_dev, err.st_ino) == (log.st_dev, log.st_ino)

"""Logging of the server and its workers: stderr plus ``server.log`` in the pool directory."""
from __future__ import annotations

import logging
import os
import sys

from hpkv.engine.protocol import LOG_FILE

FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"


def setup_logging(directory: str, level: str, to_stderr: bool = True) -> None:
    fmt = logging.Formatter(FORMAT)
    root = logging.getLogger("hpkv")
    root.setLevel(level)
    root.handlers.clear()
    root.propagate = False
    path = os.path.join(directory, LOG_FILE)
    if to_stderr and not _is_stderr(path):   # a spawned server's stderr is server.log itself
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(fmt)
        root.addHandler(h)
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fh = logging.FileHandler(path)
        fh.setFormatter(fmt)
        root.addHandler(fh)
    except OSError as exc:
        root.warning("cannot write the log file in %s: %s", directory, exc)


def _is_stderr(path: str) -> bool:
    try:
        err, log = os.fstat(2), os.stat(path)
    except OSError:
        return False
    return (err.st_dev, err.st_ino) == (log.st_dev, log.st_ino)

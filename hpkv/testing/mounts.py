"""A FUSE view of a directory (bindfs) for tests: what a node on NFS or a parallel file system
sees. Its kernel caches entries, attributes and missing names for ``ttl`` seconds (like an NFS
mount with ``actimeo=ttl``, ``lookupcache=all``); SIGSTOP of its daemon hangs every call into
the view as a hard mount whose server is gone does."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def bindfs_view(src: Path, dst: Path, ttl: float = 0) -> Iterator[subprocess.Popen]:
    """Mount a view of ``src`` at ``dst`` for the block; yields the bindfs daemon. The daemon
    is always continued and stopped and the view always unmounted, whatever the block did."""
    if os.geteuid() != 0 or not shutil.which("bindfs") or not os.path.exists("/dev/fuse"):
        pytest.skip("needs root, bindfs and /dev/fuse (scripts/setup.sh installs bindfs)")
    dst.mkdir(mode=0o755, exist_ok=True)
    opts = f"entry_timeout={ttl:g},attr_timeout={ttl:g},negative_timeout={ttl:g}"
    daemon = subprocess.Popen(["bindfs", "-f", "-o", opts, str(src), str(dst)])
    try:
        deadline = time.monotonic() + 10
        while f" {dst} " not in Path("/proc/self/mounts").read_text():
            assert daemon.poll() is None, "bindfs exited"
            assert time.monotonic() < deadline, "bindfs did not mount"
            time.sleep(0.05)
        yield daemon
    finally:
        daemon.send_signal(signal.SIGCONT)
        subprocess.run(["umount", "-l", str(dst)], check=False, timeout=30)
        daemon.terminate()
        try:
            daemon.wait(10)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(10)


@contextlib.contextmanager
def stopped(daemon: subprocess.Popen) -> Iterator[None]:
    """The view hangs (its daemon stopped) for the block, and is continued whatever happens."""
    daemon.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        daemon.send_signal(signal.SIGCONT)

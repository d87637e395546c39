"""Life cycle of ring and doorbell files: create-and-publish, attach, stale check, unlink.

A file is created under a temporary name (O_EXCL, mode 0600), sized, mapped and
formatted by the native core, and only then published under its real name, so
no process ever attaches a half-written header. Publishing links the file into
place (fails if the name exists); an existing file is replaced only when its
creator is dead or released it (``replace_stale``), never while it is in use.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from collections.abc import Callable
from typing import Any

from hpkv.common.native import ffi, lib
from hpkv.ring.errors import RingError, RingExists, RingNotFound

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,58}\Z")
_HDR_SIZE = 4096

FileId = tuple[int, int]  # (st_dev, st_ino): which file a path named when we created it


def check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"bad {what} name {name!r}: use 1-59 characters from [A-Za-z0-9._-], "
            "starting with a letter or digit (it becomes a file name)"
        )


def describe_error(rc: int, path: str) -> str:
    """Text for a negative return code of the native ring/doorbell functions."""
    if rc == lib.HPKV_RING_EBADFILE:
        return f"{path} is not an hpkv ring/doorbell file (bad magic or size); remove it"
    if rc == lib.HPKV_RING_EVERSION:
        return (
            f"{path} was made by another hpkv version (file format {lib.HPKV_RING_VERSION} "
            "expected); stop the process that uses it, or remove it if none does"
        )
    if rc == lib.HPKV_RING_ECAPACITY:
        return "capacity must be a power of two between 2 and 2**24"
    if rc < 0 and -rc < 1000:
        return f"{path}: {os.strerror(-rc)}"
    return f"{path}: native error {rc}"


def probe(path: str) -> tuple[int, int]:
    """(HPKV_PROBE_LIVE | HPKV_PROBE_STALE | HPKV_RING_EBADFILE, creator pid) of an existing file."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.pread(fd, _HDR_SIZE, 0)
    finally:
        os.close(fd)
    pid = ffi.new("int32_t *")
    rc = lib.hpkv_shm_probe(ffi.from_buffer(data), len(data), pid)
    return rc, pid[0]


def create_file(
    directory: str,
    filename: str,
    what: str,
    replace_stale: bool,
    map_fn: Callable[[int], Any],
    unmap_fn: Callable[[Any], None],
) -> tuple[Any, str, FileId]:
    """Creates, maps (``map_fn(fd)`` returns the native handle) and publishes ``directory/filename``."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = os.path.join(directory, filename)
    tmp = os.path.join(directory, f".{filename}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    handle = None
    try:
        os.fchmod(fd, 0o600)  # exactly 0600 whatever the umask: only this user's processes attach
        handle = map_fn(fd)
        st = os.fstat(fd)
        _publish(tmp, path, what, replace_stale, (st.st_dev, st.st_ino))
    except BaseException:
        if handle is not None:
            unmap_fn(handle)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass  # already renamed or linked away: nothing left to clean
        raise
    finally:
        os.close(fd)
    return handle, path, (st.st_dev, st.st_ino)


def _publish(tmp: str, path: str, what: str, replace_stale: bool, ident: FileId) -> None:
    for _ in range(20):
        try:
            os.link(tmp, path)  # atomic, and fails if the name exists: never clobbers a live file
        except FileExistsError:
            pass
        else:
            os.unlink(tmp)
            return
        try:
            state, pid = probe(path)
        except FileNotFoundError:
            continue  # its owner removed it between our link and probe: try again
        if state == lib.HPKV_PROBE_LIVE:
            raise RingExists(
                f"{what} {path} is in use: its creator, pid {pid}, is alive. Close it "
                "in that process (or stop the process), or choose another name."
            )
        if state != lib.HPKV_PROBE_STALE:
            raise RingError(describe_error(state, path))
        if not replace_stale:
            raise RingExists(
                f"{what} {path} is stale (its creator, pid {pid}, is gone); "
                "remove it or create with replace_stale=True"
            )
        os.rename(tmp, path)  # atomic replace: attachers see the old file or the new, never neither
        st = os.stat(path)
        if (st.st_dev, st.st_ino) != ident:
            # Another process replaced the same stale file right after us; it won the name.
            raise RingExists(
                f"{what} {path} was re-created concurrently by another process; "
                "two creators raced for one name: give each its own name"
            )
        return
    raise RingError(f"could not publish {what} {path}: the name kept changing under us")


def open_existing(directory: str, filename: str, what: str, wait: float) -> tuple[int, str]:
    """Opens ``directory/filename`` read-write, waiting up to ``wait`` s for it to appear."""
    path = os.path.join(directory, filename)
    deadline = time.monotonic() + max(0.0, wait)
    while True:
        try:
            return os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW), path
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise RingNotFound(
                    f"no {what} at {path}: its creator has not created it (yet); "
                    "create it first, or pass wait=SECONDS to attach"
                ) from None
            time.sleep(0.005)


def unlink_if_ours(path: str, ident: FileId) -> bool:
    """Removes ``path`` if it still names the file we created (not a successor's)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    if (st.st_dev, st.st_ino) != ident:
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True

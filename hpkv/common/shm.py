"""Shared-memory files as every hpkv process maps them: allocated up front, mapped populated.

On this VM a copy into un-faulted shared memory runs 5-10x slower than into a
populated mapping (`hpkv bench pool` shows the cost), so a file is fallocated when created
and every mapping uses MAP_POPULATE. Standard library only: the connector, which
runs inside vLLM, uses it too.
"""

from __future__ import annotations

import mmap
import os

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def map_fd(fd: int, size: int, writable: bool = True, populate: bool = True) -> mmap.mmap:
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | (_POPULATE if populate else 0), prot=prot)


def create(path: str, size: int, *, exclusive: bool = True) -> mmap.mmap:
    """Create ``path`` (0600; ``exclusive``: fail if it exists, else truncate), allocate and map it."""
    flags = os.O_RDWR | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        return map_fd(fd, size)
    finally:
        os.close(fd)


def map_file(path: str, writable: bool = True, populate: bool = True) -> mmap.mmap:
    """Map an existing file whole. ``populate=False`` for a file that may still be sparse (the
    pool): populating a shared mapping of a tmpfs hole allocates the page, so it would
    allocate the whole file, outside the server's accounting of its file system."""
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        return map_fd(fd, os.fstat(fd).st_size, writable, populate)
    finally:
        os.close(fd)

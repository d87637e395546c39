"""The shared-memory DRAM pool: one file in HPKV_SHARE_MEM_FILE_PATH, mapped by every hpkv process.

The server creates it (fallocate, so pages exist up front) and every process maps
it with MAP_POPULATE: on this VM a copy into un-faulted shared memory runs 5–10×
slower than into a populated mapping (research/limits.md §2).
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import resource

import numpy as np

from hpkv import shm

log = logging.getLogger("hpkv.pool")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)


class PoolFile:
    """A mapping of the pool file; ``address`` is the base for native copies."""

    def __init__(self, path: str, mm: mmap.mmap, size: int, locked: bool):
        self.path = path
        self.mm = mm
        self.size = size
        self.locked = locked
        self.array = np.frombuffer(mm, dtype=np.uint8)
        self.address = int(self.array.ctypes.data)

    @classmethod
    def create(cls, path: str, size: int, lock: bool = True) -> "PoolFile":
        tmp = f"{path}.tmp{os.getpid()}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot allocate the {size}-byte pool file {path}: "
                              f"{exc.strerror}; lower HPKV_KV_MEM_POOL_SIZE or free space") from None
            os.rename(tmp, path)
            pool = cls._map(path, fd, size)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        if lock:
            pool.locked = pool._mlock()
        return pool

    @classmethod
    def attach(cls, path: str) -> "PoolFile":
        fd = os.open(path, os.O_RDWR)
        try:
            return cls._map(path, fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    @classmethod
    def _map(cls, path: str, fd: int, size: int) -> "PoolFile":
        return cls(path, shm.map_fd(fd, size), size, locked=False)

    def _mlock(self) -> bool:
        if _libc.mlock(ctypes.c_void_p(self.address), ctypes.c_size_t(self.size)) == 0:
            log.info("pool %s: %d bytes locked in memory", self.path, self.size)
            return True
        err = ctypes.get_errno()
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
        log.warning("pool %s: not locked in memory (%s; RLIMIT_MEMLOCK is %s): the kernel may "
                    "swap pool pages out; raise `ulimit -l` or grant CAP_IPC_LOCK to lock it",
                    self.path, os.strerror(err), limit)
        return False

    def close(self) -> None:
        del self.array
        try:
            self.mm.close()
        except BufferError:
            pass  # views are still alive (e.g. a copier): unmapped when they go

"""``hpkv bench pool``: what making a pool's memory exist costs, against what mapping it costs.

One run, one file in the pool directory's file system (``--dir``, default /dev/shm):

* ``first_touch_s_per_gib``: writing one byte per page of a fresh sparse file (allocation,
  zeroing and, in a VM, the hypervisor backing the page): what the pool's warmer pays once;
* ``fallocate_s_per_gib``: reserving the same pages without touching them;
* ``populate_s_per_gib`` / ``madvise_populate_s_per_gib`` / ``fault_s_per_gib``: page tables of
  a second mapping of existing pages, with MAP_POPULATE, MADV_POPULATE_WRITE or faults on use:
  what each further process pays.

The server's start-up does none of these; its warmer does the first two in the background
and the workers the populate (hpkv/common/pool.py).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import time
import uuid


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="1g", help="bytes per measurement (default 1g)")
    p.add_argument("--dir", default="/dev/shm", help="directory on the pool's file system")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from hpkv.common.pool import MADV_POPULATE_WRITE
    from hpkv.config import parse_size

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    size = parse_size(args.size)
    gib = size / (1 << 30)
    path = os.path.join(args.dir, f"hpkv-bench-pool-{uuid.uuid4().hex[:8]}")
    out: dict[str, float] = {}
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        first = np.frombuffer(mmap.mmap(fd, size, flags=mmap.MAP_SHARED), np.uint8)
        out["first_touch_s_per_gib"] = _timed(lambda: first.__setitem__(slice(None, None, 4096), 1)) / gib
        second = np.frombuffer(mmap.mmap(fd, size, flags=mmap.MAP_SHARED), np.uint8)
        out["fault_s_per_gib"] = _timed(lambda: second.__setitem__(slice(None, None, 4096), 2)) / gib
        third = np.frombuffer(mmap.mmap(fd, size, flags=mmap.MAP_SHARED), np.uint8)
        out["madvise_populate_s_per_gib"] = (
            _timed(lambda: libc.madvise(ctypes.c_void_p(third.ctypes.data), size, MADV_POPULATE_WRITE)) / gib
        )
        out["populate_s_per_gib"] = (
            _timed(lambda: mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)) / gib
        )
        os.ftruncate(fd, 0)
        os.ftruncate(fd, size)
        out["fallocate_s_per_gib"] = _timed(lambda: os.posix_fallocate(fd, 0, size)) / gib
    finally:
        os.close(fd)
        os.unlink(path)
    out = {k: round(v, 3) for k, v in out.items()}
    out["size_bytes"] = size
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:28} {v}")
        print(
            f"an 8 GiB pool: {8 * out['first_touch_s_per_gib']:.1f} s of first touch (background), "
            f"{8 * out['populate_s_per_gib']:.1f} s of page tables per process mapping it populated"
        )
    return 0

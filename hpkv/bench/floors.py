"""Physical floors measured in the same run as a benchmark: what the same bytes cost with
nothing of hpkv in the way. Benches report hpkv's cost next to these, not only ratios of
end-to-end times that an engine's fixed costs can hide.

* :func:`memcpy_gbps`: the best copy between two populated shared-memory mappings (the
  kind of memory the pool and vLLM's CPU KV cache are), single- and multi-threaded;
* :func:`raw_read_gbps`: the best raw ``open(O_DIRECT) + preadv + close`` of a set of
  files (buffered after dropping the page cache where O_DIRECT is refused), 1..N threads;
* :func:`machine_busy_s`: the CPU the whole machine spent, to tell a floor bound by the
  CPUs (where any added work adds time) from one bound by a device.
"""

from __future__ import annotations

import mmap
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from hpkv.common import shm


def machine_busy_s() -> float:
    """CPU seconds every CPU of the machine has spent busy since boot (``/proc/stat``: user,
    nice, system, irq and softirq; not idle, iowait or time stolen by the hypervisor), kernel
    network work included, which no process's counters show."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _parallel_copy(dst: np.ndarray, src: np.ndarray, threads: int, pool: ThreadPoolExecutor) -> float:
    """Seconds for one copy of ``src`` into ``dst`` split in ``threads`` slices (np.copyto drops
    the GIL while it copies)."""
    bounds = np.linspace(0, len(src), threads + 1).astype(np.int64) // 4096 * 4096
    bounds[-1] = len(src)
    t0 = time.perf_counter()
    list(
        pool.map(
            lambda i: np.copyto(dst[bounds[i] : bounds[i + 1]], src[bounds[i] : bounds[i + 1]]),
            range(threads),
        )
    )
    return time.perf_counter() - t0


def memcpy_gbps(
    nbytes: int, directory: str = "/dev/shm", threads: tuple[int, ...] = (1, 2), repeat: int = 5
) -> dict[str, float]:
    """Best GB/s of copying ``nbytes`` between two populated shared-memory files in
    ``directory``, per thread count, and the best of all (``best``)."""
    paths = [os.path.join(directory, f"hpkv-floor-{uuid.uuid4().hex[:8]}-{i}") for i in (0, 1)]
    maps: list[mmap.mmap] = []
    out: dict[str, float] = {}
    try:
        maps = [shm.create(p, nbytes) for p in paths]
        src, dst = (np.frombuffer(m, np.uint8) for m in maps)
        src[:] = 1
        with ThreadPoolExecutor(max(threads)) as pool:
            for t in threads:
                best = min(_parallel_copy(dst, src, t, pool) for _ in range(repeat))
                out[f"threads_{t}"] = round(nbytes / best / 1e9, 2)
        del src, dst
    finally:
        for m in maps:
            m.close()
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)
    out["best"] = max(out.values()) if out else 0.0
    return out


def drop_caches() -> bool:
    """Drop the page cache (root only); False if not allowed."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def read_files(paths: list[str], o_direct: bool, threads: int = 1) -> float:
    """Seconds to read every file whole with ``open + preadv + close``, spread over ``threads``."""
    size = max(os.path.getsize(p) for p in paths)
    flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if o_direct else 0)

    def read_some(part: list[str]) -> None:
        buf = mmap.mmap(-1, (size + 4095) // 4096 * 4096)  # page-aligned: O_DIRECT wants alignment
        try:
            for p in part:
                fd = os.open(p, flags)
                try:
                    want = os.fstat(fd).st_size
                    if os.preadv(fd, [memoryview(buf)[: (want + 511) // 512 * 512]], 0) < want:
                        raise RuntimeError(f"short read of {p}")
                finally:
                    os.close(fd)
        finally:
            buf.close()

    if not o_direct:
        drop_caches()
    parts = [paths[i::threads] for i in range(threads)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read_some, parts))
    return time.perf_counter() - t0


def o_direct_works(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False


def raw_read_gbps(
    paths: list[str], threads: tuple[int, ...] = (1, 2, 4, 8), repeat: int = 2
) -> dict[str, float]:
    """Best GB/s of reading ``paths`` raw (O_DIRECT where the file system takes it), per thread
    count, and the best of all (``best``)."""
    if not paths:
        return {"best": 0.0}
    o_direct = o_direct_works(paths[0])
    nbytes = sum(os.path.getsize(p) for p in paths)
    out: dict[str, float] = {}
    for t in threads:
        best = min(read_files(paths, o_direct, t) for _ in range(repeat))
        out[f"threads_{t}"] = round(nbytes / best / 1e9, 2)
    out["best"] = max(out.values())
    out["o_direct"] = float(o_direct)
    return out

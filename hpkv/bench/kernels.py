"""Native kernel throughput: batched block copy (save/load) vs a single-thread memcpy of
the same bytes, and CRC32C.

    hpkv bench kernels [--shm] [--reps 9]

GB/s counts each copied byte once. Every repetition runs the reference memcpy
(np.copyto between two contiguous buffers of the batch's size), then save, then load,
so host bandwidth drift hits all three alike; medians are reported. All buffers are
touched first (a fault costs ~2 us per 4 KiB page on these VMs, see `hpkv bench pool`).
--shm puts the pool in a /dev/shm file, fallocated and mapped with MAP_POPULATE, as the
engine does.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time

import numpy as np

from hpkv.io_workers.checksum import crc32c
from hpkv.transfer_workers.copy import BlockCopier, BlockLayout, set_nt_threshold

# (page KiB, layers, batch blocks, device blocks): ~50-200 MiB per batch, beyond L3.
CASES = [(16, 8, 400, 800), (64, 8, 300, 600), (256, 4, 200, 400)]


def _pool(nbytes: int, shm: bool):
    if not shm:
        return np.ones(nbytes, np.uint8), None
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="hpkv-bench-")
    os.unlink(path)
    os.posix_fallocate(fd, 0, nbytes)
    m = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    os.close(fd)
    return np.frombuffer(m, np.uint8), m


def bench_copy(page_kib: int, L: int, n: int, NB: int, reps: int, shm: bool, streaming: bool) -> dict:
    page = page_kib << 10
    rng = np.random.default_rng(0)
    layers = [np.ones((NB, page), np.uint8) for _ in range(L)]
    layout = BlockLayout.from_tensors(layers)
    pool, m = _pool(n * layout.slot_bytes, shm)
    copier = BlockCopier(layout, pool, layout.slot_bytes, n)
    blocks = rng.permutation(NB)[:n].astype(np.int64)
    slots = rng.permutation(n).astype(np.int64)
    nbytes = n * layout.slot_bytes
    src, dst = np.ones(nbytes, np.uint8), np.ones(nbytes, np.uint8)
    prev = set_nt_threshold(1 << 20 if streaming else 1 << 63)
    t: dict[str, list[float]] = {"memcpy": [], "save": [], "load": []}
    try:
        for _ in range(reps):
            for name, fn in (
                ("memcpy", lambda: np.copyto(dst, src)),
                ("save", lambda: copier.save(blocks, slots)),
                ("load", lambda: copier.load(blocks, slots)),
            ):
                t0 = time.perf_counter()
                fn()
                t[name].append(time.perf_counter() - t0)
    finally:
        set_nt_threshold(prev)
        copier = pool = None  # type: ignore[assignment]  # release the pool view before closing its mapping
        if m is not None:
            m.close()
    gbs = {k: nbytes / statistics.median(v) / 1e9 for k, v in t.items()}
    gbs["MiB"] = nbytes / 2**20
    return gbs


def bench_crc(nbytes: int, reps: int) -> float:
    buf = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    inner = max(1, (64 << 20) // nbytes)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            crc32c(buf)
        times.append((time.perf_counter() - t0) / inner)
    return nbytes / statistics.median(times) / 1e9


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--shm", action="store_true", help="pool in a MAP_POPULATE'd /dev/shm file")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--cached-too", action="store_true", help="also run with streaming stores off")


def run(a: argparse.Namespace) -> int:
    print(f"pool: {'/dev/shm MAP_POPULATE' if a.shm else 'anonymous (touched)'}; median of {a.reps}")
    modes = [True, False] if a.cached_too else [True]
    for streaming in modes:
        for page_kib, L, n, NB in CASES:
            r = bench_copy(page_kib, L, n, NB, a.reps, a.shm, streaming)
            print(
                f"copy page {page_kib:3d} KiB x {L} layers x {n} blocks ({r['MiB']:.0f} MiB)"
                f"{'' if streaming else ' [cached stores]'}: memcpy {r['memcpy']:5.2f} GB/s | "
                f"save {r['save']:5.2f} ({r['save'] / r['memcpy']:.2f}x) | "
                f"load {r['load']:5.2f} ({r['load'] / r['memcpy']:.2f}x)"
            )
    for nbytes in (64 << 10, 1 << 20, 64 << 20):
        print(f"crc32c {nbytes >> 10:6d} KiB: {bench_crc(nbytes, a.reps):5.2f} GB/s")
    return 0

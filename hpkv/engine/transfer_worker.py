"""A transfer worker process: executes block copy batches between one device's KV cache and the pool.

Started by the server (``python -m hpkv.engine.transfer_worker SPEC_JSON``), pinned
to the CPUs of the device's NUMA node. It pops COPY_SAVE / COPY_LOAD descriptors
from its request ring, reads the batch (device block ids, then pool byte offsets)
from the job arena, runs one native copy for the whole batch and pushes a
COMPLETION (or an ERROR with the reason) carrying the batch's seq.
"""
from __future__ import annotations

import json
import logging
import mmap
import os
import signal
import sys
import time

import numpy as np

from hpkv.engine import protocol as P
from hpkv.engine.copy import BlockCopier, BlockLayout
from hpkv.engine.logs import setup_logging
from hpkv.engine.pool import PoolFile
from hpkv.engine.stats import StatsSegment, W, WorkerState
from hpkv.engine.workers import set_memory_node
from hpkv.ring import PeerDead, Ring, RingError, RingTimeout

log = logging.getLogger("hpkv.transfer")


def map_file(path: str, writable: bool = True) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=prot)
    finally:
        os.close(fd)


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    setup_logging(spec["dir"], spec.get("log_level", "INFO"), to_stderr=True)
    stopping = False

    def on_term(signum, _frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when we stop
    parent = os.getppid()

    cpus = spec.get("cpus") or []
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as exc:
            log.warning("cannot pin to CPUs %s: %s", cpus, exc)
    placement = set_memory_node(int(spec.get("numa_node", 0)))

    stats = StatsSegment.attach(spec["dir"], writable=True)
    row = stats.workers[spec["slot"]]
    pool = PoolFile.attach(spec["pool"])
    regions = [map_file(r["path"]) for r in spec["regions"]]
    region_addr = [int(np.frombuffer(m, np.uint8).ctypes.data) for m in regions]
    layout = BlockLayout(
        layer_bases=tuple(region_addr[r] + int(off) for r, off in spec["layer_bases"]),
        block_stride=int(spec["block_stride"]), page_bytes=int(spec["page_bytes"]),
        num_blocks=int(spec["num_blocks"]), owners=tuple(regions))
    slot_bytes = int(spec["slot_bytes"])
    copier = BlockCopier(layout, pool.address, slot_stride=slot_bytes, num_slots=pool.size // slot_bytes)
    jobs_mm = map_file(spec["jobs"])
    jobs = np.frombuffer(jobs_mm, dtype=np.int64).reshape(P.JOB_SLOTS, P.JOB_SLOT_BYTES // 8)
    req = Ring.attach(spec["dir"], spec["req"], role="consumer", slice_ms=50)
    resp = Ring.attach(spec["dir"], spec["resp"], role="producer")
    row[W.PID] = os.getpid()
    row[W.STATE] = WorkerState.RUNNING
    log.info("transfer worker ready: %d layers x %d B pages, %d blocks; CPUs %s; %s",
             layout.num_layers, layout.page_bytes, layout.num_blocks, cpus, placement)

    while not stopping:
        row[W.HEARTBEAT_NS] = time.time_ns()
        if os.getppid() != parent:
            log.warning("the server (pid %d) is gone: exiting", parent)
            break
        try:
            d = req.pop(timeout=0.5)
        except RingTimeout:
            continue
        except PeerDead:
            time.sleep(0.05)  # the client went away; the server will stop us
            continue
        except RingError as exc:
            log.error("request ring failed: %s", exc)
            break
        if d.kind not in (P.COPY_SAVE, P.COPY_LOAD):
            resp.push(P.ERROR, d.seq, status=P.E_BAD_REQUEST, timeout=5.0)
            continue
        row[W.INFLIGHT_SEQ] = d.seq
        t0 = time.perf_counter_ns()
        n = int(d.a0)
        status, nbytes = 0, 0
        try:
            if not 0 < n <= P.MAX_PAIRS_PER_JOB:
                raise ValueError(f"batch of {n} blocks (1..{P.MAX_PAIRS_PER_JOB})")
            job = jobs[d.seq % P.JOB_SLOTS]
            blocks = job[:n]
            slots = job[n: 2 * n] // slot_bytes
            if d.kind == P.COPY_SAVE:
                copier.save(blocks, slots)
                row[W.BYTES_SAVED] += n * layout.slot_bytes
            else:
                copier.load(blocks, slots)
                row[W.BYTES_LOADED] += n * layout.slot_bytes
            nbytes = n * layout.slot_bytes
        except (ValueError, IndexError) as exc:
            log.error("copy batch seq %d rejected: %s", d.seq, exc)
            status = P.E_BAD_REQUEST
            row[W.JOBS_FAILED] += 1
        row[W.BUSY_NS] += time.perf_counter_ns() - t0
        row[W.JOBS] += 1
        try:
            resp.push(P.COMPLETION if status == 0 else P.ERROR, d.seq, nbytes, status=status, timeout=5.0)
        except RingError as exc:
            log.warning("cannot post the completion of seq %d: %s", d.seq, exc)
        row[W.INFLIGHT_SEQ] = 0

    row[W.STATE] = WorkerState.STOPPED
    req.close()
    resp.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

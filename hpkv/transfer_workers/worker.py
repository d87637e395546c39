"""A transfer worker process: executes block copy batches between one device's KV cache and the pool.

Started by the server (``python -m hpkv.transfer_workers.worker SPEC_JSON``), pinned
to the CPUs of the device's NUMA node. It pops COPY_SAVE / COPY_LOAD descriptors
from its request ring, reads the batch (device block ids, then pool byte offsets)
from the job arena, runs one native copy for the whole batch and pushes a
COMPLETION (or an ERROR with the reason) carrying the batch's seq.

A save writes its slots only while each still has the generation the job carries (the
slot fence, hpkv.runtime.fence): a save for a reservation the server has released since
is refused whole (STALE_SLOT, nothing written) and the client recomputes.
"""

from __future__ import annotations

import logging
import os
import sys

import numpy as np

from hpkv.common.numa import format_cpulist, set_memory_node, spread_cpus
from hpkv.common.pool import PoolFile
from hpkv.common.ratelimit import RateLimitedLog
from hpkv.common.shm import map_file
from hpkv.protocol import wire as P
from hpkv.protocol.errors import Status
from hpkv.protocol.stats import W
from hpkv.runtime.fence import SlotFence, decode_slots
from hpkv.runtime.worker import WorkerRuntime
from hpkv.transfer_workers.copy import BlockCopier, BlockLayout

log = logging.getLogger("hpkv.transfer")
MAX_COPY_THREADS = 4  # memcpy between shared mappings stops scaling about there


def main(argv: list[str]) -> int:
    rt = WorkerRuntime(argv, log)
    spec, row = rt.spec, rt.row
    cpus = spec.get("cpus") or []
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as exc:
            log.warning("cannot pin to CPUs %s: %s", cpus, exc)
    placement = set_memory_node(int(spec.get("numa_node", 0)))

    pool = PoolFile.attach(spec["pool"], warm_limit=rt.pool_warm_bytes)
    fence = SlotFence(spec["fence"])
    if "cuda" in spec:  # the engine's KV cache is on a GPU (or the host stand-in of one)
        from hpkv.transfer_workers.cuda import serve_cuda

        return serve_cuda(rt, pool, fence)
    regions = [map_file(r["path"]) for r in spec["regions"]]
    region_addr = [int(np.frombuffer(m, np.uint8).ctypes.data) for m in regions]
    layout = BlockLayout(
        layer_bases=tuple(region_addr[r] + int(off) for r, off in spec["layer_bases"]),
        block_stride=int(spec["block_stride"]),
        page_bytes=int(spec["page_bytes"]),
        num_blocks=int(spec["num_blocks"]),
        owners=tuple(regions),
    )
    slot_bytes = int(spec["slot_bytes"])
    # The engine waits for every copy (a load before its forward, a save after it): a large
    # one uses up to that many threads, each on CPUs of its own (see BlockCopier). Workers of
    # the same node (tensor-parallel ranks, other engines) start at different CPU sets, so
    # their copies below the split size do not all land on the same CPUs.
    copy_threads = max(1, min(len(cpus) or os.cpu_count() or 1, MAX_COPY_THREADS))
    thread_cpus = spread_cpus(cpus, copy_threads, first=int(spec.get("slot", 0))) if cpus else []
    copier = BlockCopier(
        layout,
        pool.address,
        slot_stride=slot_bytes,
        num_slots=pool.size // slot_bytes,
        thread_cpus=thread_cpus,
    )
    if thread_cpus:  # last: the threads started before (the pool's) keep all the node's CPUs
        try:
            os.sched_setaffinity(0, thread_cpus[0])
        except OSError as exc:
            log.warning("cannot pin the copy thread to CPUs %s: %s", sorted(thread_cpus[0]), exc)
    jobs_mm = map_file(spec["jobs"])
    jobs = np.frombuffer(jobs_mm, dtype=np.int64).reshape(P.JOB_SLOTS, P.JOB_SLOT_BYTES // 8)
    log.info(
        "transfer worker ready: %d layers x %d B pages, %d blocks; CPUs %s (copies over up to %d "
        "threads on CPUs %s); %s",
        layout.num_layers,
        layout.page_bytes,
        layout.num_blocks,
        cpus,
        copy_threads,
        " | ".join(map(format_cpulist, thread_cpus)) or "any",
        placement,
    )

    holder = int(spec["slot"]) + 1  # our mark in the fence (the server clears it if we die)
    errors = RateLimitedLog(log)

    def copy(d) -> tuple[int, int, int]:
        n = int(d.a0)
        try:
            if d.kind not in (P.COPY_SAVE, P.COPY_LOAD):
                raise ValueError(f"descriptor kind {d.kind} is not a copy")
            if not 0 < n <= P.MAX_PAIRS_PER_JOB:
                raise ValueError(f"batch of {n} blocks (1..{P.MAX_PAIRS_PER_JOB})")
            job = jobs[d.seq % P.JOB_SLOTS]
            blocks = job[:n].copy()  # our own copy: the client may rewrite its arena slot
            offsets, gens = decode_slots(job[n : 2 * n].copy(), slot_bytes, pool.size)
            slots = offsets // slot_bytes
            if d.kind == P.COPY_SAVE:
                refused = fence.enter(offsets, gens, holder)
                if refused >= 0:
                    row[W.STALE_SAVES] += 1
                    errors.log(
                        logging.WARNING,
                        "stale",
                        "save seq %d refused, nothing written: the reservation of pool offset %d "
                        "(generation %d) was released before the copy (a late save; the engine "
                        "recomputes)",
                        d.seq,
                        int(offsets[refused]),
                        int(gens[refused]),
                    )
                    return Status.STALE_SLOT, 0, 0
                try:
                    copier.save(blocks, slots, threads=copy_threads)
                finally:  # the copy ended (with a store fence): the server may reuse the slots
                    fence.leave(offsets, gens, holder)
                row[W.BYTES_SAVED] += n * layout.slot_bytes
            else:
                copier.load(blocks, slots, threads=copy_threads)
                row[W.BYTES_LOADED] += n * layout.slot_bytes
        except (ValueError, IndexError) as exc:
            row[W.BAD_JOBS] += 1
            errors.log(logging.ERROR, "bad", "copy batch seq %d rejected: %s", d.seq, exc)
            return Status.BAD_REQUEST, 0, 0
        return 0, n * layout.slot_bytes, 0

    # A client that went away leaves its ring; the server stops us when it notices.
    return rt.serve(copy, exit_when_producer_gone=False)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

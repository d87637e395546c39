"""An IO worker process: spills pool slots to KV files and promotes KV files into pool slots.

Started and supervised by the server (``python -m hpkv.io_workers.worker SPEC_JSON``).
It pops SPILL / PROMOTE descriptors (:func:`hpkv.engine.protocol.io_job`) from its
request ring, moves the bytes straight between its mapping of the pool and the file
(O_DIRECT when the server's probe said so, see :mod:`hpkv.io_workers.kvfile`), and
pushes a COMPLETION or an ERROR carrying the job's seq, the bytes moved and the
-errno (or E_CORRUPT after it quarantined a bad file). The server's end of the
completion ring is bound to the server's doorbell, so a completion wakes it.

The worker keeps no state the server needs: if it dies, the server fails the job
it had taken (``INFLIGHT_SEQ`` / the ring's order), removes its temporary file and
starts a replacement on the same rings.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import signal
import sys
import time

from hpkv.engine import protocol as P
from hpkv.engine.logs import setup_logging
from hpkv.engine.pool import PoolFile
from hpkv.engine.stats import StatsSegment, W, WorkerState
from hpkv.io_workers.kvfile import BlockId, CorruptFile, KvFileIO
from hpkv.io_workers.ratelimit import RateLimitedLog
from hpkv.ring import PeerClosed, PeerDead, Ring, RingError, RingTimeout

log = logging.getLogger("hpkv.io")


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

    stats = StatsSegment.attach(spec["dir"], writable=True)
    row = stats.workers[spec["slot"]]
    pool = PoolFile.attach(spec["pool"])
    io = KvFileIO(spec["storage"], memoryview(pool.mm), o_direct=bool(spec["o_direct"]),
                  fsync=bool(spec.get("fsync")), bounce_reads=bool(spec.get("bounce_reads")))
    req = Ring.attach(spec["dir"], spec["req"], role="consumer", slice_ms=50)
    resp = Ring.attach(spec["dir"], spec["resp"], role="producer")
    errors = RateLimitedLog(log)
    row[W.PID] = os.getpid()
    row[W.STATE] = WorkerState.RUNNING
    log.info("IO worker ready: storage %s, %s IO%s%s", spec["storage"],
             "O_DIRECT" if io.o_direct else "buffered", ", fsync before rename" if io.fsync else "",
             ", reads through a private buffer" if io.bounce_reads else "")

    while not stopping:
        row[W.HEARTBEAT_NS] = time.time_ns()
        if os.getppid() != parent:
            log.warning("the server (pid %d) is gone: exiting", parent)
            break
        try:
            d = req.pop(timeout=0.5)
        except RingTimeout:
            continue
        except (PeerDead, PeerClosed):
            log.warning("the server closed the request ring: exiting")
            break
        except RingError as exc:
            log.error("request ring failed: %s", exc)
            break
        row[W.INFLIGHT_SEQ] = d.seq
        t0 = time.perf_counter_ns()
        status, nbytes, flags = 0, 0, 0
        ns, key, rank, world, offset, length = P.decode_io_job(d.flags, d.args)
        block = BlockId(ns, key, rank, world)
        fp = ns.hex()
        was_direct = io.o_direct
        try:
            if d.kind == P.SPILL:
                nbytes, existed = io.write(fp, block, offset, length)
                flags |= P.IO_EXISTED if existed else 0
                row[W.BYTES_SAVED] += nbytes
            elif d.kind == P.PROMOTE:
                nbytes = io.read(fp, block, offset, length)
                row[W.BYTES_LOADED] += nbytes
            else:
                status = P.E_BAD_REQUEST
        except CorruptFile as exc:
            status = P.E_CORRUPT
            try:
                dest = io.quarantine(fp, block)
                errors.log(logging.ERROR, "corrupt", "KV file %s-r%d of namespace %s is corrupt (%s): "
                           "moved to %s; the block will be recomputed", key.hex(), rank, fp, exc, dest)
            except OSError as qexc:
                errors.log(logging.ERROR, "corrupt", "KV file %s-r%d of namespace %s is corrupt (%s) "
                           "and could not be quarantined: %s", key.hex(), rank, fp, exc, qexc)
        except OSError as exc:
            status = -(exc.errno or errno.EIO)
        except ValueError as exc:  # a job outside the pool: a server bug, never a file problem
            errors.log(logging.ERROR, "bad-job", "IO job seq %d rejected: %s", d.seq, exc)
            status = P.E_BAD_REQUEST
        if was_direct and not io.o_direct:
            flags |= P.IO_DIRECT_FALLBACK
            log.warning("O_DIRECT was refused with EINVAL on %s although the start-up probe "
                        "passed: this worker uses buffered IO from now on", spec["storage"])
        row[W.BUSY_NS] += time.perf_counter_ns() - t0
        row[W.JOBS] += 1
        if status:
            row[W.JOBS_FAILED] += 1
        try:
            resp.push(P.COMPLETION if status == 0 else P.ERROR, d.seq, nbytes, status=status,
                      flags=flags, timeout=5.0)
        except RingError as exc:
            log.warning("cannot post the completion of seq %d: %s", d.seq, exc)
        row[W.INFLIGHT_SEQ] = 0

    row[W.STATE] = WorkerState.STOPPED
    req.close()
    resp.close()
    io.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

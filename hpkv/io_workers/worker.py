"""An IO worker process: spills pool slots to KV files and promotes KV files into pool slots.

Started and supervised by the server (``python -m hpkv.io_workers.worker SPEC_JSON``).
It pops SPILL / PROMOTE descriptors (:func:`hpkv.protocol.wire.io_job`) from its
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
import logging
import sys

from hpkv.common.pool import PoolFile
from hpkv.common.priority import BE_DEFAULT, BE_LOWEST, set_io_priority
from hpkv.common.ratelimit import RateLimitedLog
from hpkv.engine.worker_process import WorkerRuntime
from hpkv.io_workers.kvfile import BlockId, CorruptFile, KvFileIO
from hpkv.protocol import wire as P
from hpkv.protocol.errors import Status
from hpkv.protocol.stats import W

log = logging.getLogger("hpkv.io")


def main(argv: list[str]) -> int:
    rt = WorkerRuntime(argv, log)
    spec, row = rt.spec, rt.row
    pool = PoolFile.attach(spec["pool"], warm_limit=rt.pool_warm_bytes)
    io = KvFileIO(
        spec["storage"],
        memoryview(pool.mm),
        o_direct=bool(spec["o_direct"]),
        fsync=bool(spec.get("fsync")),
        bounce_reads=bool(spec.get("bounce_reads")),
    )
    errors = RateLimitedLog(log)
    # Spills run at the lowest best-effort IO priority, promotes (a request waits) at the
    # default. The CPU priority stays the engine's: a niced worker starved promotes on a
    # loaded machine until they timed out (then vLLM recomputes, which costs more).
    io_level = BE_DEFAULT

    def io_priority(level: int) -> None:
        nonlocal io_level
        if level != io_level and set_io_priority(level) is None:
            io_level = level

    log.info(
        "IO worker ready: storage %s, %s IO%s%s",
        spec["storage"],
        "O_DIRECT" if io.o_direct else "buffered",
        ", fsync before rename" if io.fsync else "",
        ", reads through a private buffer" if io.bounce_reads else "",
    )

    def job(d) -> tuple[int, int, int]:
        status, nbytes, flags = 0, 0, 0
        ns, key, rank, world, offset, length = P.decode_io_job(d.flags, d.args)
        block = BlockId(ns, key, rank, world)
        fp = ns.hex()
        was_direct = io.o_direct
        try:
            if d.kind == P.SPILL:
                io_priority(BE_LOWEST)  # write-through: after everything a request waits for
                nbytes, existed = io.write(fp, block, offset, length)
                flags |= P.IO_EXISTED if existed else 0
                row[W.BYTES_SAVED] += nbytes
            elif d.kind == P.PROMOTE:
                io_priority(BE_DEFAULT)
                nbytes = io.read(fp, block, offset, length)
                row[W.BYTES_LOADED] += nbytes
            else:
                status = Status.BAD_REQUEST
        except CorruptFile as exc:
            status = Status.CORRUPT
            try:
                dest = io.quarantine(fp, block)
                errors.log(
                    logging.ERROR,
                    "corrupt",
                    "KV file %s-r%d of namespace %s is corrupt (%s): "
                    "moved to %s; the block will be recomputed",
                    key.hex(),
                    rank,
                    fp,
                    exc,
                    dest,
                )
            except OSError as qexc:
                errors.log(
                    logging.ERROR,
                    "corrupt",
                    "KV file %s-r%d of namespace %s is corrupt (%s) and could not be quarantined: %s",
                    key.hex(),
                    rank,
                    fp,
                    exc,
                    qexc,
                )
        except OSError as exc:
            status = -(exc.errno or errno.EIO)
        except ValueError as exc:  # a job outside the pool: a server bug, never a file problem
            errors.log(logging.ERROR, "bad-job", "IO job seq %d rejected: %s", d.seq, exc)
            status = Status.BAD_REQUEST
        if was_direct and not io.o_direct:
            flags |= P.IO_DIRECT_FALLBACK
            log.warning(
                "O_DIRECT was refused with EINVAL on %s although the start-up probe "
                "passed: this worker uses buffered IO from now on",
                spec["storage"],
            )
        return status, nbytes, flags

    try:
        # The server owns the request ring: when it closes it, we are done.
        return rt.serve(job, exit_when_producer_gone=True)
    finally:
        io.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

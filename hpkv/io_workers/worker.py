"""An IO worker process: spills pool slots to KV files and promotes KV files into pool slots.

Started and supervised by the server (``python -m hpkv.io_workers.worker SPEC_JSON``).
It pops SPILL / PROMOTE descriptors (:func:`hpkv.protocol.wire.io_job`) from its
request ring, moves the bytes straight between its mapping of the pool and the file
(O_DIRECT when the server's probe said so, see :mod:`hpkv.io_workers.kvfile`), and
pushes a COMPLETION or an ERROR carrying the job's seq, the bytes moved and the
-errno (or E_CORRUPT after it quarantined a bad file). The server's end of the
completion ring is bound to the server's doorbell, so a completion wakes it.

A promote's checks (header, padding, CRC32C, the copy out of the bounce buffer) run on a
second thread while the job loop reads the next file (:class:`ReadAhead`), so one read per
worker is always on its way to the device; completions may leave out of order.

The worker keeps no state the server needs: if it dies, the server fails the jobs
it had taken (the ring's order tells which), removes its temporary file and
starts a replacement on the same rings.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

from hpkv.common.pool import PoolFile
from hpkv.common.priority import BE_DEFAULT, BE_LOWEST, set_io_priority
from hpkv.common.ratelimit import RateLimitedLog
from hpkv.io_workers.kvfile import BlockId, CorruptFile, FetchedFile, KvFileIO, ReadSlot
from hpkv.io_workers.tree import DIR_CACHE_MAX, StorageTree
from hpkv.protocol import wire as P
from hpkv.protocol.errors import Status
from hpkv.protocol.stats import W
from hpkv.runtime.worker import WorkerRuntime

log = logging.getLogger("hpkv.io")


def main(argv: list[str]) -> int:
    rt = WorkerRuntime(argv, log)
    spec, row = rt.spec, rt.row
    pool = PoolFile.attach(spec["pool"], warm_limit=rt.pool_warm_bytes)
    # The storage root the server verified, or nothing: this worker never resolves it by
    # name again (see hpkv.io_workers.tree).
    try:
        # A worker holds few other descriptors: room for twice the server's directories.
        tree = StorageTree.attach(spec["storage"], spec["storage_id"], max_dirs=2 * DIR_CACHE_MAX)
    except OSError as exc:
        log.critical("IO worker cannot use the storage directory: %s", exc)
        return 1
    io = KvFileIO(
        tree,
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

    def verified(d, fetched: FetchedFile, flags: int) -> None:
        """Second half of a promote, on the verifier thread (see ReadAhead)."""
        try:
            nbytes = io.verify(fetched)
        except Exception as exc:  # noqa: BLE001 - every job is answered
            status = _failure_status(exc, d, fetched.block.namespace.hex(), fetched.block, io, errors)
            rt.finish(d, status, 0, flags)
            return
        row[W.BYTES_LOADED] += nbytes
        rt.finish(d, 0, nbytes, flags)

    read_ahead = ReadAhead(io, verified)

    def job(d) -> tuple[int, int, int] | None:
        status, nbytes, flags = 0, 0, 0
        fetched: FetchedFile | None = None
        ns, key, rank, world, offset, length = P.decode_io_job(d.flags, d.args)
        block = BlockId(ns, key, rank, world)
        fp = ns.hex()
        was_direct, was_read_direct = io.o_direct, io.read_direct
        try:
            if d.kind == P.SPILL:
                io_priority(BE_LOWEST)  # write-through: after everything a request waits for
                nbytes, existed = io.write(fp, block, offset, length)
                flags |= P.IO_EXISTED if existed else 0
                row[W.BYTES_SAVED] += nbytes
            elif d.kind == P.PROMOTE:
                io_priority(BE_DEFAULT)
                fetched = read_ahead.fetch(fp, block, offset, length)
            else:
                status = Status.BAD_REQUEST
        except Exception as exc:  # noqa: BLE001 - every job is answered
            status = _failure_status(exc, d, fp, block, io, errors)
        flags |= _direct_fallback(io, was_direct, was_read_direct, spec)
        if fetched is not None:
            read_ahead.verify_later(d, fetched, flags)  # that thread answers the job
            return None
        return status, nbytes, flags

    try:
        # The server owns the request ring: when it closes it, we are done.
        return rt.serve(job, exit_when_producer_gone=True, drain=read_ahead.close)
    finally:
        io.close()
        tree.close()


def _direct_fallback(io: KvFileIO, was_direct: bool, was_read_direct: bool, spec: dict[str, Any]) -> int:
    """IO_DIRECT_FALLBACK, logged once, if the job just done turned O_DIRECT off; else 0."""
    if was_direct and not io.o_direct:
        log.warning(
            "O_DIRECT was refused with EINVAL on %s although the start-up probe "
            "passed: this worker uses buffered IO from now on",
            spec["storage"],
        )
        return P.IO_DIRECT_FALLBACK
    if was_read_direct and not io.read_direct:
        log.warning(
            "O_DIRECT reads were refused with EINVAL on %s (%s) although the start-up probe "
            "passed: the read was retried buffered, and this worker reads buffered from now on "
            "(writes keep O_DIRECT)",
            spec["storage"],
            spec.get("fs_type", "?"),
        )
        return P.IO_DIRECT_FALLBACK
    return 0


def _failure_status(
    exc: BaseException, d: Any, fp: str, block: BlockId, io: KvFileIO, errors: RateLimitedLog
) -> int:
    """The status of a job that raised ``exc``; a corrupt file is quarantined first."""
    if isinstance(exc, CorruptFile):
        try:
            dest = io.quarantine(fp, block)
            errors.log(
                logging.ERROR,
                "corrupt",
                "KV file %s-r%d of namespace %s is corrupt (%s): moved to %s; the block will be recomputed",
                block.key.hex(),
                block.rank,
                fp,
                exc,
                dest,
            )
        except OSError as qexc:
            errors.log(
                logging.ERROR,
                "corrupt",
                "KV file %s-r%d of namespace %s is corrupt (%s) and could not be quarantined: %s",
                block.key.hex(),
                block.rank,
                fp,
                exc,
                qexc,
            )
        return Status.CORRUPT
    if isinstance(exc, OSError):
        return -(exc.errno or errno.EIO)
    if isinstance(exc, ValueError):  # a job outside the pool: a server bug, never a file problem
        errors.log(logging.ERROR, "bad-job", "IO job seq %d rejected: %s", d.seq, exc)
        return Status.BAD_REQUEST
    errors.log(logging.ERROR, "bug", "IO job seq %d failed: %r", d.seq, exc)
    return Status.INTERNAL


class ReadAhead:
    """Reads the next KV file while the last one is verified.

    A promote is IO (open, read) then CPU (header and padding checks, the payload's
    CRC32C, with bounce reads its copy into the pool: about a quarter of a 1 MiB promote on
    the dev VM). The job loop fetches a file into one of two :class:`ReadSlot` s and hands it
    to a verifier thread, which checks it and answers the job, while the loop reads the next
    file into the other slot: one read per worker on the device at a time, as before, and
    the checks off its path. Both halves drop the GIL for their long parts (the read, the
    native CRC)."""

    def __init__(self, io: KvFileIO, verified: Callable[[Any, FetchedFile, int], None], depth: int = 2):
        self.io = io
        self._verified = verified
        self._slots: queue.SimpleQueue[ReadSlot] = queue.SimpleQueue()
        self._owned = [ReadSlot() for _ in range(depth)]
        for slot in self._owned:
            self._slots.put(slot)
        self._todo: queue.SimpleQueue[tuple[Any, FetchedFile, int] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="verify", daemon=True)
        self._thread.start()

    def fetch(self, fp: str, block: BlockId, offset: int, length: int) -> FetchedFile:
        """Read a block's file into a free slot (waits for one); raises what the read raised
        (the slot is then free again). Hand the result to :meth:`verify_later`."""
        slot = self._slots.get()
        try:
            return self.io.fetch(fp, block, offset, length, slot)
        except BaseException:
            self._slots.put(slot)
            raise

    def verify_later(self, d: Any, fetched: FetchedFile, flags: int) -> None:
        self._todo.put((d, fetched, flags))

    def _run(self) -> None:
        while (item := self._todo.get()) is not None:
            d, fetched, flags = item
            slot = fetched.slot
            try:
                self._verified(d, fetched, flags)
            except BaseException:  # noqa: BLE001 - a dead verifier would leave jobs unanswered
                log.critical("verifier thread failed on IO job seq %d: exiting", d.seq, exc_info=True)
                os._exit(70)  # the server fails the jobs this worker took and starts another
            finally:
                del item, fetched  # its views of the slot's buffers, before the slot is reused
                self._slots.put(slot)

    def close(self) -> None:
        """Verify and answer what was fetched, then free the slots."""
        self._todo.put(None)
        self._thread.join()
        for slot in self._owned:
            slot.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

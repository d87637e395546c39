"""The remote worker process: the one owner of this node's Mooncake Store client.

Started and supervised by the server like an IO worker (``python -m
hpkv.io_workers.remote_worker SPEC_JSON``, server-owned rings). It sets the client up, registers
the pool mapping once, and serves three kinds of job, each one rank's shard of one block
(:func:`hpkv.protocol.wire.io_job`):

* SPILL: publish the pool slot as an object, unless one exists under its name already (a put
  of an existing key would keep the old bytes anyway: :data:`P.IO_EXISTED`);
* PROMOTE: read the object into the pool slot, then verify it exactly as a KV file is
  verified (:meth:`KvFileIO.verify`) before the completion makes the slot readable; a
  mismatch removes the object (forced: a plain remove fails for 10 s after any get) and
  answers E_CORRUPT. Read in batches, one after the other, by a thread of its own, each
  batch verified by another thread while the next one is read (:class:`Getter`);
* LOOKUP: does the object of every rank exist? (the completion's a0: 1 or 0). Answered by a
  thread of its own (:class:`Checker`), the lookups queued at once in one ``batch_is_exist``.

An object is the KV file image, byte for byte: the 4096-byte header (namespace fingerprint,
key, rank, world size, payload length, CRC32C; :func:`kvfile.pack_header`) and the payload
zero-padded to 4096, put and got as one object from two buffers (the header page and the
slot) with no copy. Its name carries the format version (:func:`mooncake_api.object_key`).

The Mooncake calls block (for seconds when the master is gone), which is why they run here
and not in the server: a parked call's deadline bounds what a client waits, and a dead or
hung worker is restarted by the supervisor with its jobs failed.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import queue
import sys
import threading
import time
from typing import Any

from hpkv.common.pool import PoolFile
from hpkv.common.ratelimit import RateLimitedLog
from hpkv.io_workers import kvfile, mooncake_api
from hpkv.io_workers.checksum import crc32c
from hpkv.io_workers.kvfile import BlockId, CorruptFile, FetchedFile, KvFileIO, ReadSlot
from hpkv.protocol import wire as P
from hpkv.protocol.errors import Status
from hpkv.protocol.stats import W
from hpkv.runtime.worker import WorkerRuntime

log = logging.getLogger("hpkv.remote")

LOCAL_BUFFER = 16 << 20  # Mooncake's own staging buffer (hpkv moves bytes from registered memory)
PUT_ATTEMPTS = 3  # a put placed in a dead node's segment is tried again (placed anew)
# After a call the master did not answer, puts fail at once for this long instead of each
# blocking ~4.3 s: the publishes queued when the master died end in moments, not minutes
# (their blocks stay unevictable until then). The server's probes (exists) always ask.
MASTER_DOWN_LATCH_S = 1.0
# Promotes: one thread reads up to GET_BATCH objects a call, one call after the other, while
# another checks the batch before (each get reads its object's header into a page of its own).
# A connector promotes a load in parts of 8 blocks of Qwen2.5-7B's shape, two at once: a batch
# of 8 answers the first part after its own transfer, not after both parts'.
GET_BATCH = 8
READ_AHEAD = 2  # batches read or being checked at once (header pages: READ_AHEAD * GET_BATCH)
# A node whose get failed (TRANSFER_FAIL: the process holding the segment is gone) is taken for
# dead this long: the master lists its objects for ~10.8 s more (exists says yes, gets fail),
# so meanwhile an object only it holds is answered missing (the replicas' holders are asked).
DEAD_HOLDER_S = 12.0


def _address(buf: Any) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


class RemoteStore:
    """The jobs against one set-up client; ``pool`` is the writable mapping of the whole pool."""

    def __init__(self, store: Any, pool: memoryview, pool_address: int):
        self.store = store
        self.pool = pool
        self.pool_address = pool_address
        self.slot = ReadSlot()  # the header page, registered once
        self.master_down_until = 0.0  # (monotonic) puts fail at once until then
        self._dead: dict[str, float] = {}  # transport endpoint -> (monotonic) taken for dead until
        self._dead_mu = threading.Lock()  # (the checking thread writes it, the exists thread reads)
        self.hdr_address = _address(self.slot.hdr)
        for addr, size in ((pool_address, len(pool)), (self.hdr_address, kvfile.HEADER_BYTES)):
            rc = store.register_buffer(addr, size)
            if rc != 0:
                raise RuntimeError(f"register_buffer of {size} bytes failed: {mooncake_api.describe(rc)}")

    def _bufs(self, offset: int, length: int, hdr_address: int = 0) -> tuple[list[int], list[int]]:
        padded = kvfile.align_up(length)
        if offset < 0 or offset + padded > len(self.pool):
            raise ValueError(f"pool range {offset}+{padded} is outside the pool")
        return [hdr_address or self.hdr_address, self.pool_address + offset], [kvfile.HEADER_BYTES, padded]

    def header_page(self) -> tuple[ReadSlot, int]:
        """A header page of its own (registered) for one get in flight."""
        slot = ReadSlot()
        addr = _address(slot.hdr)
        rc = self.store.register_buffer(addr, kvfile.HEADER_BYTES)
        if rc != 0:
            raise RuntimeError(f"register_buffer of a header page failed: {mooncake_api.describe(rc)}")
        return slot, addr

    def exists(self, names: list[str]) -> int:
        """1 when every object exists, 0 when one does not; raises OSError when the store fails."""
        got = self.store.batch_is_exist(names)
        bad = [c for c in got if c < 0]
        if bad:
            raise self._failure(bad[0], "batch_is_exist")
        return int(all(c == 1 for c in got))

    def holder_lost(self, name: str) -> None:
        """A get of ``name`` failed because its holder is gone: that node is dead for
        DEAD_HOLDER_S (what :meth:`exists_many` answers for the objects it holds)."""
        try:
            ends = _endpoints(self.store.get_replica_desc(name))
        except Exception as exc:  # noqa: BLE001 - the get's answer stands without it
            log.warning("the holder of %s is gone but could not be named: %r", name, exc)
            return
        until = time.monotonic() + DEAD_HOLDER_S
        with self._dead_mu:
            for end in ends:
                if end not in self._dead:
                    log.warning("remote store: node %s is gone (a get from it failed): its objects are "
                                "missing for %gs", end, DEAD_HOLDER_S)  # fmt: skip
                self._dead[end] = until

    def exists_many(self, names: list[str]) -> list[int]:
        """``batch_is_exist`` of ``names`` (1, 0, or a negative code each), except while a node is
        taken for dead: then an object counts as existing when a replica is held by another node
        (the master still lists the dead one's)."""
        now = time.monotonic()
        with self._dead_mu:
            for end in [e for e, until in self._dead.items() if until <= now]:
                del self._dead[end]
            dead = set(self._dead)
        if not dead:
            return list(self.store.batch_is_exist(names))
        found = self.store.batch_get_replica_desc(names)
        return [int(bool(_endpoints(found.get(n, [])) - dead)) for n in names]

    def _failure(self, code: int, what: str) -> OSError:
        if code == mooncake_api.RPC_FAIL:
            self.master_down_until = time.monotonic() + MASTER_DOWN_LATCH_S
        return OSError(mooncake_api.errno_of(code), f"{what}: {mooncake_api.describe(code)}")

    def put(self, block: BlockId, offset: int, length: int) -> tuple[int, bool]:
        """Publish the slot as the block's object; (bytes, existed)."""
        name = mooncake_api.object_key(block)
        ptrs, sizes = self._bufs(offset, length)
        if time.monotonic() < self.master_down_until:
            raise OSError(errno.ETIMEDOUT, f"put of {name} not tried: the master did not answer a moment ago")
        if self.exists([name]):
            return 0, True
        payload = self.pool[offset : offset + sizes[1]]
        payload[length:] = bytes(sizes[1] - length)  # the slot's tail is ours: zero padding
        kvfile.pack_header(self.slot.hdr, block, length, crc32c(payload[:length]))
        for _ in range(PUT_ATTEMPTS):
            rc = self.store.batch_put_from_multi_buffers([name], [ptrs], [sizes])[0]
            if rc != mooncake_api.TRANSFER_FAIL:
                break
        if rc == mooncake_api.TRANSFER_FAIL:
            # the master placed it in the segment of a node that is gone (listed for ~10 s
            # after): not published, and no failure of the store
            raise OSError(errno.EHOSTUNREACH, f"put of {name}: {mooncake_api.describe(rc)}")
        if rc != 0:
            raise self._failure(rc, f"put of {name}")
        return kvfile.file_size(length), False

    def verify(self, block: BlockId, offset: int, length: int, slot: ReadSlot, got: int) -> int:
        """Check what a get of the block's object into ``slot``'s header page and the pool slot
        answered (``got``: its bytes, or a Mooncake code) as a KV file is checked; returns the
        bytes. Raises FileNotFoundError when the object is gone, ConnectionError when its holder is (the
        other objects it holds are missing for DEAD_HOLDER_S: :meth:`holder_lost`), OSError when the store
        failed, :class:`CorruptFile` (after removing the object) when it does not match."""
        name = mooncake_api.object_key(block)
        if got == mooncake_api.TRANSFER_FAIL:
            # the node holding its segment is gone (the master still lists the object for ~10 s
            # after): this object is lost, and so are the others that node holds; the store is
            # not failing
            self.holder_lost(name)
            raise ConnectionError(errno.EHOSTUNREACH, f"object {name}: {mooncake_api.describe(got)}")
        if got == mooncake_api.OBJECT_NOT_FOUND:
            raise FileNotFoundError(errno.ENOENT, f"no object {name} ({mooncake_api.describe(got)})")
        try:
            if got == mooncake_api.INVALID_PARAMS:  # an object larger than the header + slot
                raise CorruptFile("the object is larger than the block's image")
            if got < 0:  # (a master that did not answer latches the puts, as for an exists)
                raise self._failure(got, f"get of {name}")
            if got != kvfile.file_size(length):
                raise CorruptFile(f"object is {got} bytes, expected {kvfile.file_size(length)}")
            payload = self.pool[offset : offset + kvfile.align_up(length)]
            return KvFileIO.verify(FetchedFile(block, length, payload, payload, slot))
        except CorruptFile:
            self.store.remove(name, True)  # forced: a plain remove fails for 10 s after a get
            raise


def _endpoints(replicas: Any) -> set[str]:
    """The transport endpoints (holders) of an object's memory replicas."""
    return {
        r.get_memory_descriptor().buffer_descriptor.transport_endpoint
        for r in replicas
        if r.is_memory_replica()
    }


def main(argv: list[str]) -> int:
    rt = WorkerRuntime(argv, log)
    spec, row = rt.spec, rt.row
    os.environ["MC_TCP_BIND_ADDRESS"] = spec["local_hostname"]
    try:
        store = mooncake_api.store_class()()
    except mooncake_api.MooncakeUnavailable as exc:
        log.critical("remote worker: %s", exc)
        return 1
    rc = store.setup(
        spec["local_hostname"],
        spec["metadata"],
        int(spec["segment"]),
        LOCAL_BUFFER,
        spec["protocol"],
        spec["devices"],
        spec["master"],
    )
    if rc != 0:
        log.critical(
            "remote worker: Mooncake setup (master %s, metadata %s, local %s) failed: %s",
            spec["master"],
            spec["metadata"],
            spec["local_hostname"],
            mooncake_api.describe(rc),
        )
        return 1
    pool = PoolFile.attach(spec["pool"], warm_limit=rt.pool_warm_bytes)
    remote = RemoteStore(store, memoryview(pool.mm), pool.address)
    errors = RateLimitedLog(log)
    log.info("remote worker ready: Mooncake master %s, local %s", spec["master"], spec["local_hostname"])

    checker = Checker(remote, rt, errors)
    getter = Getter(remote, rt, errors)

    def drain() -> None:
        checker.close()
        getter.close()

    def job(d) -> tuple[int, int, int] | None:
        if d.kind == P.LOOKUP:
            checker.put(d)  # answered by the checker thread, batched with the lookups queued by then
            return None
        if d.kind == P.PROMOTE:
            getter.put(d)  # read in a batch and verified by a getter thread
            return None
        ns, key, rank, world, offset, length = P.decode_io_job(d.flags, d.args)
        block = BlockId(ns, key, rank, world)
        try:
            if d.kind == P.SPILL:
                nbytes, existed = remote.put(block, offset, length)
                row[W.BYTES_SAVED] += nbytes
                return 0, nbytes, P.IO_EXISTED if existed else 0
            return Status.BAD_REQUEST, 0, 0
        except OSError as exc:
            errors.log(logging.WARNING, "store", "remote job failed: %s", exc)
            return -(exc.errno or errno.EIO), 0, 0
        except ValueError as exc:
            errors.log(logging.ERROR, "bad-job", "remote job seq %d rejected: %s", d.seq, exc)
            return Status.BAD_REQUEST, 0, 0

    try:
        return rt.serve(job, exit_when_producer_gone=True, drain=drain)
    finally:
        store.close()


class Checker:
    """Answers LOOKUP jobs on a thread of its own, so a lookup never waits behind a put or a
    get: whatever lookups are queued when it wakes up are asked about in one
    ``batch_is_exist`` (every rank's object of every key). A job's answer (a0) is 1 when
    every rank's object exists, else 0; a failing store answers -EIO."""

    def __init__(self, remote: RemoteStore, rt: WorkerRuntime, errors: RateLimitedLog):
        self.remote = remote
        self.rt = rt
        self.errors = errors
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="exists", daemon=True)
        self._thread.start()

    def put(self, d: Any) -> None:
        self._q.put(d)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()

    def _run(self) -> None:
        done = False
        while not done:
            batch = [self._q.get()]
            while True:
                try:
                    batch.append(self._q.get_nowait())
                except queue.Empty:
                    break
            done = batch[-1] is None or None in batch
            jobs = [d for d in batch if d is not None]
            if jobs:
                self._answer(jobs)

    def _answer(self, jobs: list[Any]) -> None:
        names: list[str] = []
        spans = []
        for d in jobs:
            ns, key, _, world, _, _ = P.decode_io_job(d.flags, d.args)
            spans.append((len(names), world))
            names += [mooncake_api.object_key(BlockId(ns, key, r, world)) for r in range(world)]
        try:
            got = self.remote.exists_many(names)
        except Exception as exc:  # noqa: BLE001 - every job is answered
            self.errors.log(logging.WARNING, "exists", "batch_is_exist failed: %r", exc)
            got = [-1] * len(names)
        for d, (start, world) in zip(jobs, spans, strict=True):
            mine = got[start : start + world]
            bad = [c for c in mine if c < 0]
            if bad:
                self.errors.log(
                    logging.WARNING, "exists", "batch_is_exist: %s", mooncake_api.describe(bad[0])
                )
                self.rt.finish(d, -mooncake_api.errno_of(bad[0]), 0)
            else:
                self.rt.finish(d, 0, int(all(c == 1 for c in mine)))


class Getter:
    """Answers PROMOTE jobs on two threads of their own. The reader takes the promotes queued
    when it wakes up (at most :data:`GET_BATCH`) and reads them in one
    ``batch_get_into_multi_buffers`` (each into a header page of its own and the pool slot),
    then the next batch; the checker checks each object of a batch read
    (:meth:`RemoteStore.verify`) and answers it meanwhile. Transfers never overlap one another:
    on a 2-CPU node two batch gets at once each took 1.5-2x one alone (so the first part of a
    load waited for both), while the checks (CRC32C of every byte) run beside the next
    transfer and only the last batch's checks add to a load."""

    def __init__(self, remote: RemoteStore, rt: WorkerRuntime, errors: RateLimitedLog):
        self.remote = remote
        self.rt = rt
        self.errors = errors
        self._pages: queue.SimpleQueue[tuple[ReadSlot, int]] = queue.SimpleQueue()
        for _ in range(READ_AHEAD * GET_BATCH):  # the reader waits for a page: bounded ahead
            self._pages.put(remote.header_page())
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._read_q: queue.SimpleQueue[list[Any] | None] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read_loop, name="get", daemon=True)
        self._checker = threading.Thread(target=self._check_loop, name="check", daemon=True)
        self._reader.start()
        self._checker.start()

    def put(self, d: Any) -> None:
        self._q.put(d)

    def close(self) -> None:
        self._q.put(None)
        self._reader.join()  # it hands the checker its end after its last batch
        self._checker.join()

    def _read_loop(self) -> None:
        done = False
        while not done:
            batch = [self._q.get()]
            while batch[-1] is not None and len(batch) < GET_BATCH:
                try:
                    batch.append(self._q.get_nowait())
                except queue.Empty:
                    break
            done = batch[-1] is None
            jobs = [d for d in batch if d is not None]
            if jobs:
                self._read_q.put(self._read(jobs))
        self._read_q.put(None)

    def _check_loop(self) -> None:
        while (items := self._read_q.get()) is not None:
            self._verify(items)

    def _read(self, jobs: list[Any]) -> list[tuple[Any, BlockId, int, int, tuple[ReadSlot, int], int]]:
        todo, names, ptrs, sizes = [], [], [], []
        for d in jobs:
            ns, key, rank, world, offset, length = P.decode_io_job(d.flags, d.args)
            block = BlockId(ns, key, rank, world)
            page = self._pages.get()
            try:
                p, n = self.remote._bufs(offset, length, page[1])
            except ValueError as exc:
                self._pages.put(page)
                self.errors.log(logging.ERROR, "bad-job", "remote job seq %d rejected: %s", d.seq, exc)
                self.rt.finish(d, Status.BAD_REQUEST, 0)
                continue
            todo.append((d, block, offset, length, page))
            names.append(mooncake_api.object_key(block))
            ptrs.append(p)
            sizes.append(n)
        if not todo:
            return []
        try:
            got = self.remote.store.batch_get_into_multi_buffers(names, ptrs, sizes)
        except Exception as exc:  # noqa: BLE001 - every job is answered
            self.errors.log(logging.WARNING, "get", "batch_get_into_multi_buffers failed: %r", exc)
            got = [-1] * len(todo)
        return [(*item, g) for item, g in zip(todo, got, strict=True)]

    def _verify(self, items: list[tuple[Any, BlockId, int, int, tuple[ReadSlot, int], int]]) -> None:
        for d, block, offset, length, page, got in items:
            try:
                nbytes = self.remote.verify(block, offset, length, page[0], got)
                self.rt.row[W.BYTES_LOADED] += nbytes
                self.rt.finish(d, 0, nbytes)
            except FileNotFoundError:
                self.rt.finish(d, -errno.ENOENT, 0)
            except ConnectionError:  # its holder is gone
                self.rt.finish(d, -errno.EHOSTUNREACH, 0)
            except CorruptFile as exc:
                self.errors.log(logging.ERROR, "corrupt", "remote object of block %s-r%d is corrupt (%s): "
                                "removed; the block will be recomputed", block.key.hex(), block.rank, exc)  # fmt: skip
                self.rt.finish(d, Status.CORRUPT, 0)
            except OSError as exc:
                self.errors.log(logging.WARNING, "store", "remote get failed: %s", exc)
                self.rt.finish(d, -(exc.errno or errno.EIO), 0)
            except Exception:  # noqa: BLE001 - a dead getter would leave jobs unanswered
                log.critical("remote getter failed on job seq %d: exiting", d.seq, exc_info=True)
                os._exit(70)  # the server fails this worker's jobs and starts another
            finally:
                self._pages.put(page)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

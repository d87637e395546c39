"""The storage tier: KV files, IO workers, write-through, promote, persistence, limits.

Servers, IO workers and mounts are real; every process and mount a test makes is
removed in a fixture or a ``finally``. Storage directories live under pytest's
tmp_path (ext4 on the root disk here, so O_DIRECT is real) unless a test mounts a
small tmpfs (ENOSPC) or a ramfs (a file system that refuses O_DIRECT).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from hpkv.client import HpkvClient, connect
from hpkv.common.pool import PoolFile
from hpkv.common.priority import BE_LOWEST
from hpkv.engine.storage.probe import probe_o_direct
from hpkv.engine.storage.tier import NEGATIVE_TTL_S
from hpkv.io_workers import kvfile
from hpkv.io_workers.kvfile import BlockId, CorruptFile, KvFileIO
from hpkv.protocol import wire as P
from hpkv.protocol.keys import block_keys, namespace_fingerprint
from hpkv.testing.server import ServerProcess, private_env, running, wait_for

FP = namespace_fingerprint({"model": "storage-test", "layers": 4})
STORAGE_FIELDS = {
    "path",
    "remote",
    "files",
    "bytes",
    "capacity_bytes",
    "free_bytes",
    "o_direct",
    "o_direct_reason",
    "io_errors",
    "quarantined",
    "spill_paused",
    "bytes_written",
    "bytes_read",
    "spills",
    "promotes",
    "evicted_files",
    "spills_pending",
    "state",
    "degraded_reason",
    "degraded_since",
    "lookups_bounded",
    "stat_timeouts",
    "stat_saturated",
    "gone",
    "spills_dropped",
    "promote_timeouts",
    "degraded_misses",
    "admit_deferred",
    "admitted",
}


# ------------------------------------------------------------------ helpers
@contextlib.contextmanager
def mounted(fstype: str, directory: Path, options: str = ""):
    directory.mkdir(parents=True, exist_ok=True)
    cmd = ["mount", "-t", fstype] + (["-o", options] if options else []) + [fstype, str(directory)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount {fstype} here: {r.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True)


class Writer:
    """A client that puts random blocks into the pool, commits them, and reads pool bytes."""

    def __init__(self, srv: ServerProcess, world: int = 1, shard: int = 100_000, fp: str = FP, seed: int = 0):
        self.srv = srv
        self.clients = [connect(srv.cfg, spawn=False, call_timeout=30.0) for _ in range(world)]
        self.c: HpkvClient = self.clients[0]
        self.world, self.shard, self.fp = world, shard, fp
        self.ns = self.c.attach_namespace(fp, world, shard, name="storage-test")
        for r, cl in enumerate(self.clients[1:], 1):
            cl.attach_namespace(fp, world, shard, rank=r)
        self.pool = PoolFile.attach(os.path.join(srv.pool_dir, P.POOL_FILE))
        self.rng = np.random.default_rng(seed)
        self.data: dict[bytes, list[bytes]] = {}

    def keys(self, names) -> list[bytes]:
        return block_keys(self.fp, [n if isinstance(n, bytes) else str(n).encode() for n in names])

    def put(self, keys: list[bytes]) -> None:
        slots = P.slot_offset(self.c.reserve(self.ns.ns_id, keys))  # written here, not by a worker
        assert (slots >= 0).all(), slots
        for k, row in zip(keys, slots, strict=False):
            shards = []
            for off in row:
                d = self.rng.integers(0, 256, self.shard, dtype=np.uint8)
                self.pool.array[off : off + self.shard] = d
                shards.append(d.tobytes())
            self.data[k] = shards
        for r, cl in enumerate(self.clients):
            cl.commit(self.ns.ns_id, keys, rank=r)

    def storage(self) -> dict:
        return self.c.stats()["storage"]

    def wait_storage(self, cond, timeout: float = 30.0, what: str = "") -> dict:
        deadline = time.monotonic() + timeout
        while True:
            s = self.storage()
            if cond(s):
                return s
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {s}\n{self.srv.log()[-4000:]}"
            time.sleep(0.02)

    def wait_spilled(self, n_files: int, timeout: float = 30.0) -> dict:
        return self.wait_storage(lambda s: s["spills"] >= n_files, timeout, f"{n_files} files spilled")

    def check_rows(self, keys, rows) -> None:
        for k, row in zip(keys, rows, strict=False):
            assert (row >= 0).all(), f"block {k.hex()} not loaded"
            for r, off in enumerate(row):
                assert self.pool.array[off : off + self.shard].tobytes() == self.data[k][r], (
                    f"block {k.hex()} rank {r} differs"
                )

    def path(self, key: bytes, rank: int = 0) -> str:
        return kvfile.file_path(self.srv.cfg.storage_path, self.fp, key, rank)

    def close(self) -> None:
        for cl in self.clients:
            cl.close()
        self.pool.close()


def io_worker_pids(w: Writer) -> list[int]:
    return [x["pid"] for x in w.c.stats()["workers"] if x["kind"] == "io"]


def storage_files(root, suffix: str) -> list[Path]:
    return [p for p in Path(root).rglob(f"*{suffix}") if kvfile.QUARANTINE_DIR not in p.parts]


def open_files_under(pid: int, root: str) -> list[tuple[str, int]]:
    """(path, open flags) of the process's descriptors on files under ``root``."""
    out = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if not target.startswith(root):
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                flags = next(int(line.split()[1], 8) for line in f if line.startswith("flags:"))
            if flags & os.O_PATH:
                continue  # glibc's fchmodat(AT_SYMLINK_NOFOLLOW) holds one on a new directory; no IO
            if flags & os.O_DIRECTORY:
                continue  # the storage tree's directory descriptors (hpkv.io_workers.tree); no IO
            out.append((target, flags))
        except (OSError, StopIteration):
            continue
    return out


def verify_file(path: str, fp: str, key: bytes, rank: int, world: int, shard: int) -> bytes:
    """Read a KV file through the format module; returns its payload (raises CorruptFile)."""
    mm = mmap.mmap(-1, kvfile.align_up(shard))
    io = KvFileIO(str(Path(path).parents[3]), memoryview(mm), o_direct=False)
    try:
        io.read(fp, BlockId(kvfile.fingerprint_bytes(fp), key, rank, world), 0, shard)
        return mm[:shard]
    finally:
        io.close()


# ------------------------------------------------------------------ the file format, in process
@pytest.fixture
def pool_buf():
    mm = mmap.mmap(-1, 1 << 20)
    yield memoryview(mm)


BLOCK = BlockId(kvfile.fingerprint_bytes(FP), b"\x07" * 16, 1, 2)


@pytest.mark.parametrize("bounce", [False, True], ids=["direct", "bounce"])
@pytest.mark.parametrize("length", [4096, 100_000, 1 << 19])
def test_kv_file_round_trips_and_is_laid_out_as_documented(tmp_path, pool_buf, length, bounce):
    payload = np.random.default_rng(length).integers(0, 256, length, dtype=np.uint8).tobytes()
    pool_buf[:length] = payload
    io = KvFileIO(str(tmp_path), pool_buf, o_direct=True, bounce_reads=bounce)
    written, existed = io.write(FP, BLOCK, 0, length)
    path = kvfile.file_path(str(tmp_path), FP, BLOCK.key, BLOCK.rank)
    assert (written, existed) == (kvfile.file_size(length), False)
    assert path.endswith(f"{FP}/07/07/{'07' * 16}-r1.kv")
    raw = Path(path).read_bytes()
    assert len(raw) == 4096 + kvfile.align_up(length) and raw[:8] == kvfile.MAGIC
    h = kvfile.unpack_header(memoryview(raw))
    assert (h.block, h.payload_len) == (BLOCK, length)
    assert raw[4096 : 4096 + length] == payload and not any(raw[4096 + length :])
    pool_buf[: 1 << 20] = bytes(1 << 20)
    assert io.read(FP, BLOCK, 4096 * 8, length) == len(raw)
    assert pool_buf[4096 * 8 : 4096 * 8 + length] == payload
    assert io.write(FP, BLOCK, 0, length) == (0, True), "a complete file is not written again"
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(kvfile.TMP_SUFFIX)]


@pytest.mark.parametrize("bounce", [False, True], ids=["direct", "bounce"])
@pytest.mark.parametrize("where", ["magic", "namespace", "header-padding", "payload", "payload-padding"])
def test_one_flipped_byte_anywhere_in_a_kv_file_is_detected(tmp_path, pool_buf, where, bounce):
    length = 10_000
    pool_buf[:length] = os.urandom(length)
    io = KvFileIO(str(tmp_path), pool_buf, o_direct=True, bounce_reads=bounce)
    io.write(FP, BLOCK, 0, length)
    path = kvfile.file_path(str(tmp_path), FP, BLOCK.key, BLOCK.rank)
    offset = {
        "magic": 3,
        "namespace": 20,
        "header-padding": 3000,
        "payload": 4096 + 5000,
        "payload-padding": 4096 + length + 7,
    }[where]
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))
    # The slot may hold the bad bytes afterwards (O_DIRECT reads into it; a bounce read is
    # summed while it is copied there): the promote fails, so the server frees the slot
    # unread (test_flipped_byte_is_quarantined_and_the_load_reported_failed).
    with pytest.raises(CorruptFile):
        io.read(FP, BLOCK, 8192, length)


def test_a_fetched_file_is_verified_later_while_its_read_slot_fetches_a_larger_one(tmp_path, pool_buf):
    # The IO worker verifies a fetched file on one thread while the next one is read on
    # another; a slot's bounce buffer grows for a larger file even while a view of the old
    # one is still held (closing it then raised BufferError: promotes failed with EIO).
    small, large = 8192, 300_000
    data = os.urandom(large)
    pool_buf[:large] = data
    io = KvFileIO(str(tmp_path), pool_buf, o_direct=True, bounce_reads=True)
    big_block = BLOCK._replace(key=b"\x08" * 16)
    io.write(FP, BLOCK, 0, small)
    io.write(FP, big_block, 0, large)
    pool_buf[: 1 << 20] = bytes(1 << 20)
    slot = kvfile.ReadSlot()
    try:
        first = io.fetch(FP, BLOCK, 4096 * 100, small, slot)
        assert pool_buf[4096 * 100 : 4096 * 100 + small] == bytes(small), "nothing in the pool before verify"
        second = io.fetch(FP, big_block, 4096 * 110, large, slot)
        assert io.verify(second) == kvfile.file_size(large)
        assert pool_buf[4096 * 110 : 4096 * 110 + large] == data
        assert second.dest.obj is not first.dest.obj, "the grown buffer is a new one"
        del first, second
    finally:
        slot.close()
    io.close()


def test_an_io_worker_whose_verifier_fails_exits_instead_of_leaving_its_jobs_unanswered(tmp_path):
    # A verifier thread that died would leave every job it was handed unanswered and the
    # promotes waiting for their deadline. The worker exits (70) instead: the server fails
    # the jobs it had taken and starts another worker.
    script = """
import types
from hpkv.io_workers.kvfile import ReadSlot
from hpkv.io_workers.worker import ReadAhead

def verified(d, fetched, flags):
    raise RuntimeError("a bug in the checks")

ahead = ReadAhead(io=None, verified=verified)
ahead.verify_later(types.SimpleNamespace(seq=7), types.SimpleNamespace(slot=ReadSlot()), 0)
ahead.close()  # joins the verifier: never returns, the process exits first
print("returned")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 70, out
    assert "returned" not in out.stdout
    assert "verifier thread failed on IO job seq 7: exiting" in out.stderr
    assert "a bug in the checks" in out.stderr


def test_a_file_of_another_block_or_length_is_rejected(tmp_path, pool_buf):
    io = KvFileIO(str(tmp_path), pool_buf, o_direct=True)
    io.write(FP, BLOCK, 0, 8192)
    os.rename(
        kvfile.file_path(str(tmp_path), FP, BLOCK.key, 1), kvfile.file_path(str(tmp_path), FP, BLOCK.key, 0)
    )
    with pytest.raises(CorruptFile, match="header names"):
        io.read(FP, BLOCK._replace(rank=0), 0, 8192)
    with pytest.raises(CorruptFile, match="bytes, expected"):
        io.read(FP, BLOCK._replace(rank=0), 0, 12288)


def test_probe_reports_o_direct_on_ext4_and_the_errno_and_fs_type_on_ramfs(tmp_path):
    ok = probe_o_direct(str(tmp_path))
    assert ok.ok and ok.reason is None
    with mounted("ramfs", tmp_path / "ram") as ram:
        bad = probe_o_direct(str(ram))
    assert not bad.ok and bad.reason == "EINVAL on ramfs (open)"


# ------------------------------------------------------------------ through the server
@pytest.mark.parametrize("bounce", ["0", "1"], ids=["direct-reads", "bounce-reads"])
@pytest.mark.parametrize("world,shard", [(1, 100_000), (1, 4 << 20), (2, 65536)])
def test_random_payloads_round_trip_byte_exact_through_the_io_workers(tmp_path, world, shard, bounce):
    env = private_env(pool_size="128m", storage=str(tmp_path), HPKV_STORAGE_READ_BOUNCE=bounce)
    with running(env) as srv:
        w = Writer(srv, world=world, shard=shard)
        keys = w.keys(range(8))
        w.put(keys)
        s = w.wait_spilled(8 * world)
        assert (s["files"], s["bytes"]) == (8 * world, 8 * world * kvfile.file_size(shard))
        assert s["bytes_written"] == s["bytes"] and s["o_direct"] and s["o_direct_reason"] is None
        for k in keys:
            for r in range(world):
                assert verify_file(w.path(k, r), FP, k, r, world, shard) == w.data[k][r]
        assert w.c.clear(w.ns.ns_id) == 8
        assert w.c.lookup(w.ns.ns_id, keys) == (8, [2] * 8), "evicted from DRAM: storage hits"
        rows = w.c.promote(w.ns.ns_id, keys)
        assert rows.shape == (8, world)
        w.check_rows(keys, rows)
        st = w.c.stats()
        assert st["storage"]["promotes"] == 8 * world and st["storage"]["bytes_read"] == s["bytes"]
        (n,) = st["namespaces"]
        assert n["blocks_pinned"] == 8 and n["blocks_storage"] == 8 and n["loads_storage"] == 8
        assert w.c.lookup(w.ns.ns_id, keys) == (8, [1] * 8), "promoted blocks are DRAM blocks"
        w.c.unpin(w.ns.ns_id, keys)
        io_rows = [x for x in st["workers"] if x["kind"] == "io"]
        assert len(io_rows) == 2
        assert sum(x["bytes_saved"] for x in io_rows) == s["bytes_written"]
        assert sum(x["bytes_loaded"] for x in io_rows) == s["bytes"]
        w.close()


def test_promotes_of_growing_file_sizes_through_one_io_worker_are_all_loaded(tmp_path):
    # One worker, bounce reads: its two read slots are reused for files of 64 KiB, then
    # 1 MiB, then 64 KiB again (each slot's bounce buffer grows once, between two files).
    env = private_env(
        pool_size="64m", storage=str(tmp_path), HPKV_STORAGE_READ_BOUNCE="1", HPKV_NUM_IO_WORKERS="1"
    )
    with running(env) as srv:
        writers = [
            Writer(srv, shard=shard, fp=namespace_fingerprint({"storage-test": shard}), seed=shard)
            for shard in (65536, 1 << 20)
        ]
        for w in writers:
            w.put(w.keys(range(12)))
        writers[0].wait_spilled(24)
        for w in writers + writers[:1]:
            keys = w.keys(range(12))
            w.c.clear(w.ns.ns_id)
            w.check_rows(keys, w.c.promote(w.ns.ns_id, keys))
            w.c.unpin(w.ns.ns_id, keys)
        s = writers[0].storage()
        assert s["io_errors"] == 0 and s["promotes"] == 36, s
        assert "failed" not in srv.log()
        for w in writers:
            w.close()


@pytest.mark.parametrize("inflight,readers", [("4m", 1), ("8m", 2), ("0", 2)])
def test_promote_reads_spread_over_io_workers_only_within_the_inflight_budget(tmp_path, inflight, readers):
    """HPKV_STORAGE_READ_INFLIGHT: 4 MiB files under a 4m budget are all read by one worker
    (two at once ran slower than one on a virtio disk); 8m or no limit spreads them."""
    env = private_env(
        pool_size="128m", storage=str(tmp_path), HPKV_STORAGE_READ_INFLIGHT=inflight, HPKV_NUM_IO_WORKERS="2"
    )
    with running(env) as srv:
        w = Writer(srv, shard=4 << 20)
        keys = w.keys(range(12))
        w.put(keys)
        s = w.wait_spilled(12)
        w.c.clear(w.ns.ns_id)
        w.check_rows(keys, w.c.promote(w.ns.ns_id, keys))
        w.c.unpin(w.ns.ns_id, keys)
        loaded = [x["bytes_loaded"] for x in w.c.stats()["workers"] if x["kind"] == "io"]
        assert sum(loaded) == s["bytes"] and sum(1 for b in loaded if b) == readers, loaded
        w.close()


def test_io_workers_spill_at_the_lowest_io_priority(tmp_path):
    with running(private_env(pool_size="64m", storage=str(tmp_path))) as srv:
        w = Writer(srv)
        pids = io_worker_pids(w)
        keys = w.keys(range(4))
        w.put(keys)
        w.wait_spilled(4)  # the workers are past their start-up now
        levels = {psutil.Process(p).ionice() for p in pids}
        # Whichever worker spilled switched to best-effort level 7; one that did not is unchanged.
        assert (psutil.IOPRIO_CLASS_BE, BE_LOWEST) in levels, levels
        w.close()


def test_files_are_opened_with_o_direct_when_the_probe_succeeds(tmp_path):
    shard = 32 << 20  # big writes: the worker holds each file open for ≈ 10 ms
    with running(private_env(pool_size="512m", storage=str(tmp_path))) as srv:
        w = Writer(srv, shard=shard)
        pids = io_worker_pids(w)
        keys = w.keys(range(12))
        w.put(keys)
        seen: list[tuple[str, int]] = []
        deadline = time.monotonic() + 30
        while not seen and time.monotonic() < deadline:
            for pid in pids:
                seen += open_files_under(pid, str(tmp_path))
        assert seen, "never caught an IO worker with a KV file open"
        for path, flags in seen:
            assert flags & os.O_DIRECT, f"{path} open without O_DIRECT (flags {flags:o})"
        w.wait_spilled(12)
        assert w.storage()["o_direct"]
        w.close()


def test_buffered_io_when_the_file_system_refuses_o_direct(tmp_path):
    with (
        mounted("ramfs", tmp_path / "ram") as ram,
        running(private_env(pool_size="64m", storage=str(ram))) as srv,
    ):
        w = Writer(srv)
        s = w.storage()
        assert not s["o_direct"] and s["o_direct_reason"] == "EINVAL on ramfs (open)"
        assert "O_DIRECT is not usable on" in srv.log() and "EINVAL on ramfs" in srv.log()
        keys = w.keys(range(4))
        w.put(keys)
        w.wait_spilled(4)
        w.c.clear(w.ns.ns_id)
        rows = w.c.promote(w.ns.ns_id, keys)
        w.check_rows(keys, rows)
        assert w.storage()["io_errors"] == 0
        w.close()


def test_a_block_that_has_a_file_is_not_written_again(tmp_path):
    with running(private_env(storage=str(tmp_path))) as srv:
        w = Writer(srv)
        keys = w.keys(range(3))
        w.put(keys)
        w.wait_spilled(3)
        w.c.clear(w.ns.ns_id)
        w.put(keys)  # the engine saved them again
        w.put(w.keys(["new"]))
        s = w.wait_spilled(4)
        time.sleep(0.3)
        assert w.storage()["spills"] == 4 and s["files"] == 4
        w.close()


def test_worker_killed_during_a_large_write_leaves_no_partial_file(tmp_path):
    shard = 32 << 20
    with running(private_env(pool_size="512m", storage=str(tmp_path))) as srv:
        w = Writer(srv, shard=shard)
        pids = io_worker_pids(w)
        keys = w.keys(range(12))
        w.put(keys)
        victim = None
        deadline = time.monotonic() + 30
        while victim is None and time.monotonic() < deadline:
            for pid in pids:
                if any(p.endswith(kvfile.TMP_SUFFIX) for p, _ in open_files_under(pid, str(tmp_path))):
                    os.kill(pid, signal.SIGKILL)
                    victim = pid
                    break
        assert victim, "never caught a worker writing a temporary file"
        for p in storage_files(tmp_path, ".kv"):  # nothing partial is visible under a final name
            key, rank = kvfile.parse_name(p.name)
            assert verify_file(str(p), FP, key, rank, 1, shard) == w.data[key][0]
        # the server fails the lost job, removes its temporary file, restarts the worker and retries
        w.wait_storage(lambda s: s["files"] == 12, 60, "every block on storage after the restart")
        workers = [x for x in w.c.stats()["workers"] if x["kind"] == "io"]
        assert victim not in [x["pid"] for x in workers] and sum(x["restarts"] for x in workers) == 1
        assert not storage_files(tmp_path, kvfile.TMP_SUFFIX)
        assert len(storage_files(tmp_path, ".kv")) == 12
        w.c.clear(w.ns.ns_id)
        w.check_rows(keys, w.c.promote(w.ns.ns_id, keys))
        w.close()


@pytest.mark.parametrize("bounce", ["0", "1"], ids=["direct", "bounce"])
@pytest.mark.parametrize("offset", [20, 4096 + 777], ids=["header", "payload"])
def test_flipped_byte_is_quarantined_and_the_load_reported_failed(tmp_path, offset, bounce):
    with running(private_env(storage=str(tmp_path), HPKV_STORAGE_READ_BOUNCE=bounce)) as srv:
        w = Writer(srv)
        keys = w.keys(range(3))
        w.put(keys)
        w.wait_spilled(3)
        w.c.clear(w.ns.ns_id)
        bad = w.path(keys[1])
        with open(bad, "r+b") as f:
            f.seek(offset)
            b = f.read(1)
            f.seek(offset)
            f.write(bytes([b[0] ^ 0x40]))
        rows = w.c.promote(w.ns.ns_id, keys)
        assert (rows[1] == -1).all(), "the corrupt block is reported failed"
        w.check_rows([keys[0], keys[2]], rows[[0, 2]])
        assert not os.path.exists(bad)
        (q,) = list((tmp_path / kvfile.QUARANTINE_DIR).iterdir())
        assert q.name.startswith(os.path.basename(bad))
        s = w.storage()
        assert s["quarantined"] == 1 and s["io_errors"] == 1 and s["files"] == 2
        assert w.c.lookup(w.ns.ns_id, keys) == (1, [1]), "the index forgot the corrupt block"
        assert "is corrupt" in srv.log() and "quarantine" in srv.log()
        w.close()


def test_restarted_server_serves_hits_from_existing_files(tmp_path):
    env = private_env(storage=str(tmp_path))
    with running(env) as first:
        w = Writer(first, world=2, shard=50_000)
        keys = w.keys(range(10))
        w.put(keys)
        w.wait_spilled(20)
        data = w.data
        w.close()
    # a lookup bound far above a stat's cost: this is about what the stats find, not how fast
    with running(private_env(storage=str(tmp_path), HPKV_STORAGE_LOOKUP_WAIT_MS="5000")) as second:
        w = Writer(second, world=2, shard=50_000)
        w.data = data
        # The namespace's journals load while this first lookup runs: its answer is the whole
        # prefix or, where a key's check was still running, unconfirmed (the engine asks
        # again), never a confirmed miss of a block whose files are there.
        first = w.c.probe(w.ns.ns_id, keys + w.keys(["missing"]))
        assert (first.hit, first.tiers) == (10, [2] * 10) or first.unconfirmed, first
        assert w.c.settled_lookup(w.ns.ns_id, keys + w.keys(["missing"]), 10.0) == (10, [2] * 10)
        s = w.wait_storage(lambda s: s["files"] == 20, 30, "the scan")
        assert s["bytes"] == 20 * kvfile.file_size(50_000)
        w.check_rows(keys, w.c.promote(w.ns.ns_id, keys))
        w.close()


def test_two_servers_share_one_storage_directory(tmp_path):
    slow_ok = {"HPKV_STORAGE_LOOKUP_WAIT_MS": "5000"}  # about what the stats find, not how fast
    with (
        running(private_env(storage=str(tmp_path))) as a,
        running(private_env(storage=str(tmp_path), **slow_ok)) as b,
    ):
        wa, wb = Writer(a), Writer(b)
        keys = wa.keys(range(6))
        assert wb.c.lookup(wb.ns.ns_id, keys) == (0, [])
        wa.put(keys)
        wa.wait_spilled(6)
        # b's scan found nothing when its namespace attached: a stat on the miss finds a's files,
        # once b's memory of the first key's miss (NEGATIVE_TTL_S) has expired
        t0 = time.monotonic()
        wait_for(lambda: wb.c.lookup(wb.ns.ns_id, keys) == (6, [2] * 6), 10, "b finds a's files")
        assert time.monotonic() - t0 < NEGATIVE_TTL_S + 2.0
        wb.data = wa.data
        wb.check_rows(keys, wb.c.promote(wb.ns.ns_id, keys))
        wa.close()
        wb.close()


def test_capacity_limit_evicts_least_recently_used_files(tmp_path):
    shard = 65536
    cap = 4 * kvfile.file_size(shard)
    with running(private_env(storage=str(tmp_path), HPKV_KV_STORAGE_SIZE=str(cap))) as srv:
        w = Writer(srv, shard=shard)
        keys = w.keys(range(6))
        for i in range(4):  # one at a time: a known spill order
            w.put(keys[i : i + 1])
            w.wait_spilled(i + 1)
        w.c.pin(w.ns.ns_id, keys[:1])  # block 0 is used: its file is recent now
        w.c.unpin(w.ns.ns_id, keys[:1])
        w.put(keys[4:5])
        w.wait_spilled(5)
        w.put(keys[5:6])
        s = w.wait_storage(lambda s: s["evicted_files"] == 2, 30, "two evictions")
        assert s["capacity_bytes"] == cap and s["bytes"] <= cap and s["files"] == 4
        assert [os.path.exists(w.path(k)) for k in keys] == [True, False, False, True, True, True]
        w.c.clear(w.ns.ns_id)
        assert w.c.lookup(w.ns.ns_id, keys[:1]) == (1, [2])
        assert w.c.lookup(w.ns.ns_id, keys[1:2]) == (0, []), "an evicted file is no hit"
        w.close()


def test_enospc_leaves_no_partial_file_keeps_reads_and_recovers(tmp_path):
    shard = 200_000
    # mode=0700: a world-writable storage root (tmpfs defaults to 1777) is refused
    with (
        mounted("tmpfs", tmp_path / "small", "size=2m,mode=0700") as root,
        running(private_env(storage=str(root), HPKV_STORAGE_MIN_FREE="0")) as srv,
    ):
        w = Writer(srv, shard=shard)
        early = w.keys([f"early-{i}" for i in range(2)])
        w.put(early)
        w.wait_spilled(2)
        free = os.statvfs(root).f_bavail * os.statvfs(root).f_frsize
        ballast = root / "ballast"
        with open(ballast, "wb") as f:  # leave room for less than one more file
            f.write(b"\0" * (free - kvfile.file_size(shard) // 2))
        fp2 = namespace_fingerprint({"model": "storage-test", "part": 2})
        w2 = Writer(srv, shard=shard, fp=fp2, seed=1)
        late = w2.keys(range(3))
        w2.put(late)
        w.wait_storage(lambda s: s["io_errors"] >= 3, 30, "ENOSPC failures")
        s = w.storage()
        assert s["spill_paused"] and s["files"] == 2
        assert not storage_files(root, kvfile.TMP_SUFFIX), "the temporary file was removed"
        assert sorted(p.name for p in storage_files(root, ".kv")) == sorted(
            kvfile.file_name(k, 0) for k in early
        )
        # reads are unaffected
        w.c.clear(w.ns.ns_id)
        w.check_rows(early, w.c.promote(w.ns.ns_id, early))
        w.c.unpin(w.ns.ns_id, early)
        time.sleep(2.5)  # let a retry or two fail: still logged once
        ballast.unlink()
        s = w2.wait_storage(lambda s: s["files"] == 5 and not s["spill_paused"], 60, "recovery")
        assert s["spills"] == 5
        w2.c.clear(w2.ns.ns_id)
        w2.check_rows(late, w2.c.promote(w2.ns.ns_id, late))
        log = srv.log()
        assert log.count("storage full (ENOSPC") == 1, log
        assert "spilling works again" in log
        w.close()
        w2.close()


def test_spilling_pauses_under_the_minimum_free_space_and_the_pool_still_evicts(tmp_path):
    with running(private_env(pool_size="8m", storage=str(tmp_path), HPKV_STORAGE_MIN_FREE="100")) as srv:
        w = Writer(srv, shard=1 << 20)
        keys = w.keys(range(12))  # 12 MiB through an 8 MiB pool
        for i in range(0, 12, 4):
            w.put(keys[i : i + 4])
        s = w.storage()
        assert s["spill_paused"] and s["spills"] == 0 and s["files"] == 0
        assert w.c.lookup(w.ns.ns_id, keys[8:]) == (4, [1] * 4)
        assert "under HPKV_STORAGE_MIN_FREE=100%" in srv.log()
        w.close()


def test_promote_answers_by_its_timeout_when_the_io_workers_are_stuck(tmp_path):
    with running(private_env(storage=str(tmp_path))) as srv:
        w = Writer(srv)
        keys = w.keys(range(4))
        w.put(keys)
        w.wait_spilled(4)
        w.c.clear(w.ns.ns_id)
        pids = io_worker_pids(w)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            rows = w.c.promote(w.ns.ns_id, keys, timeout=1.0)
            took = time.monotonic() - t0
            assert (rows == -1).all() and 0.9 < took < 2.5
            assert w.c.lookup(w.ns.ns_id, keys)[0] == 4, "the client is still usable"
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while w.c.lookup(w.ns.ns_id, keys) != (4, [1] * 4):
            assert time.monotonic() < deadline, "the late promotes did not complete"
            time.sleep(0.02)
        assert w.c.stats()["namespaces"][0]["blocks_pinned"] == 0, "nobody holds the late blocks"
        w.close()


def test_promote_pins_dram_blocks_and_reports_unknown_keys_failed(tmp_path):
    with running(private_env(storage=str(tmp_path))) as srv:
        w = Writer(srv)
        keys = w.keys(range(2))
        w.put(keys)
        rows = w.c.promote(w.ns.ns_id, keys + w.keys(["nowhere"]))
        assert (rows[2] == -1).all()
        w.check_rows(keys, rows[:2])
        assert w.c.stats()["namespaces"][0]["blocks_pinned"] == 2
        w.c.unpin(w.ns.ns_id, keys)
        w.close()


def test_storage_admit_reuse_writes_a_block_at_its_nth_dram_hit_and_never_a_block_not_reused(tmp_path):
    """HPKV_STORAGE_ADMIT=reuse:2: a saved block goes to storage at its second DRAM hit (a pin,
    or a promote that finds it in DRAM); a block hit less is never written, and the pool
    evicts it without files."""
    env = private_env(pool_size="64m", storage=str(tmp_path), HPKV_STORAGE_ADMIT="reuse:2")
    with running(env) as srv:
        w = Writer(srv, shard=1 << 20)
        ns = w.ns.ns_id
        keys = w.keys(range(4))
        w.put(keys)
        w.wait_storage(lambda s: s["admit_deferred"] == 4, 10, "4 blocks kept off storage")
        for hit in ([keys[0], keys[1], keys[2]], [keys[0]]):
            w.c.pin(ns, hit)
            w.c.unpin(ns, hit)
        w.check_rows([keys[1]], w.c.promote(ns, [keys[1]]))  # in DRAM: its second hit
        w.c.unpin(ns, [keys[1]])
        s = w.wait_spilled(2)
        assert s["admitted"] == 2
        time.sleep(0.5)
        assert w.storage()["spills"] == 2, "only the blocks hit twice are written"
        assert [os.path.exists(w.path(k)) for k in keys] == [True, True, False, False]
        # 80 new blocks through a 64 MiB pool: the blocks never admitted leave without files
        more = w.keys(range(100, 180))
        for i in range(0, len(more), 8):
            w.put(more[i : i + 8])
        assert w.c.lookup(ns, keys[2:3]) == (0, []) and w.c.lookup(ns, keys[3:4]) == (0, [])
        hit, tiers = w.c.lookup(ns, keys[:2])
        assert hit == 2, "the admitted blocks are still found (in DRAM or on storage)"
        w.close()


def test_stats_storage_section_has_exactly_the_monitor_fields(tmp_path):
    with running(private_env(storage=str(tmp_path), HPKV_KV_STORAGE_SIZE="1g")) as srv:
        w = Writer(srv)
        s = w.storage()
        assert set(s) == STORAGE_FIELDS
        assert s["path"] == str(tmp_path) and s["capacity_bytes"] == 1 << 30 and s["free_bytes"] > 0
        assert s["o_direct"] is True and s["o_direct_reason"] is None and s["spill_paused"] is False
        w.close()
    with running(private_env()) as srv:
        with connect(srv.cfg, spawn=False) as c:
            st = c.stats()
        assert set(st["storage"]) == STORAGE_FIELDS and st["storage"]["path"] is None
        assert not [x for x in st["workers"] if x["kind"] == "io"], "no storage, no IO workers"


def test_scan_removes_temporary_files_of_dead_writers_only(tmp_path):
    leaf = tmp_path / FP / "ab" / "cd"
    leaf.mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = kvfile.file_name(bytes.fromhex("abcd" + "00" * 14), 0)
    mine_dead = leaf / f".{name}.{kvfile.this_host()}.{dead.pid}{kvfile.TMP_SUFFIX}"
    mine_alive = leaf / f".{name}.{kvfile.this_host()}.{os.getpid()}{kvfile.TMP_SUFFIX}"
    other_new = leaf / f".{name}.otherhost.123{kvfile.TMP_SUFFIX}"
    other_old = leaf / f".{name}.otherhost.456{kvfile.TMP_SUFFIX}"
    for p in (mine_dead, mine_alive, other_new, other_old):
        p.write_bytes(b"partial")
    old = time.time() - 2 * 3600
    os.utime(other_old, (old, old))
    with running(private_env(storage=str(tmp_path))) as srv:
        w = Writer(srv)
        deadline = time.monotonic() + 10
        while mine_dead.exists() or other_old.exists():
            assert time.monotonic() < deadline, sorted(p.name for p in leaf.iterdir())
            time.sleep(0.05)
        assert mine_alive.exists() and other_new.exists(), "a live or recent writer keeps its file"
        w.close()


def test_fsync_option_reaches_the_io_workers(tmp_path):
    with running(private_env(storage=str(tmp_path), HPKV_STORAGE_FSYNC="1")) as srv:
        w = Writer(srv)
        keys = w.keys(range(2))
        w.put(keys)
        w.wait_spilled(2)
        w.c.clear(w.ns.ns_id)
        w.check_rows(keys, w.c.promote(w.ns.ns_id, keys))
        assert srv.log().count("fsync before rename") == 2, "both workers say so"
        w.close()


def test_unpinning_failed_promote_rows_never_releases_another_clients_pin(tmp_path):
    with running(private_env(storage=str(tmp_path))) as srv:
        w = Writer(srv)
        keys = w.keys(range(2))
        w.put(keys[:1])
        w.c.pin(w.ns.ns_id, keys[:1])  # client A holds block 0
        with connect(srv.cfg, spawn=False) as other:
            other.attach_namespace(FP, 1, w.shard)
            rows = other.promote(w.ns.ns_id, keys[1:])  # block 1 exists nowhere: -1
            assert (rows == -1).all()
            other.unpin(w.ns.ns_id, keys)  # sloppy: unpins everything it asked for
        assert w.c.stats()["namespaces"][0]["blocks_pinned"] == 1, "A's pin survives"
        w.c.unpin(w.ns.ns_id, keys[:1])
        assert w.c.stats()["namespaces"][0]["blocks_pinned"] == 0
        w.close()


# ------------------------------------------------------------------ stop: pending spills first
def _hpkv_stop(env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "hpkv", "stop"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_hpkv_stop_writes_pending_spills_before_it_exits(tmp_path):
    env = private_env(storage=str(tmp_path))
    with running(env) as srv:
        w = Writer(srv)
        pids = io_worker_pids(w)
        for pid in pids:  # spills queue up behind stalled IO workers
            os.kill(pid, signal.SIGSTOP)
        keys = w.keys(range(6))
        w.put(keys)
        w.close()
        stop = _hpkv_stop(env)
        time.sleep(0.5)
        assert stop.poll() is None, "hpkv stop waits while the server drains"
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        out, err = stop.communicate(timeout=60)
        assert stop.returncode == 0, err
        assert "6 pending block(s) written to storage first" in out, out
        assert sorted(os.listdir(srv.pool_dir)) == ["server.log"]
        assert len(storage_files(tmp_path, ".kv")) == 6
        for k in keys:
            assert verify_file(w.path(k), w.fp, k, 0, 1, w.shard) == w.data[k][0]
        assert "6 pending block(s) written to storage in" in srv.log()


def test_a_stop_drain_that_times_out_reports_the_blocks_it_did_not_write(tmp_path):
    env = private_env(storage=str(tmp_path), HPKV_STOP_DRAIN_TIMEOUT="1")
    with running(env) as srv:
        w = Writer(srv)
        pids = io_worker_pids(w)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            w.put(w.keys(range(5)))
            w.close()
            t0 = time.monotonic()
            out, err = _hpkv_stop(env).communicate(timeout=60)
            assert time.monotonic() - t0 < 20, "the drain is bounded by HPKV_STOP_DRAIN_TIMEOUT"
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        assert "5 of 5 pending block(s) were NOT written to storage" in out, (out, err)
        assert "5 block(s) were not written to storage: HPKV_STOP_DRAIN_TIMEOUT=1s expired" in srv.log()
        assert sorted(os.listdir(srv.pool_dir)) == ["server.log"]
        assert storage_files(tmp_path, ".kv") == []

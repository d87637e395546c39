"""Several hpkv servers on one storage directory, as two nodes would run them.

Each server has its own pool directory (its own node id) and, where a test says so, its own
bindfs view of one real storage directory with NFS-like caching (``entry_timeout``,
``attr_timeout``, ``negative_timeout``): what a node on NFS sees. Every server, view and
strace a test starts is stopped in a ``finally``; nothing leaves loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from test_storage import FP, Writer, running  # the storage tests' real-process helpers

from hpkv.engine.storage import journal as J
from hpkv.engine.storage.journal import JOURNAL_DIR, JournalReader, JournalWriter, Record
from hpkv.engine.storage.shared import LEASE_FILE, READ_EVERY_S, Lease, RecentReads
from hpkv.io_workers import kvfile
from hpkv.io_workers.tree import StorageTree
from hpkv.testing.mounts import bindfs_view
from hpkv.testing.server import private_env

POLL = 0.2  # HPKV_STORAGE_JOURNAL_POLL of these tests
TTL = 1.0  # the views' attribute, entry and negative cache


def env(storage, **extra: str) -> dict[str, str]:
    return private_env(storage=str(storage), HPKV_STORAGE_JOURNAL_POLL=str(POLL), **extra)


@contextlib.contextmanager
def view(src: Path, dst: Path, ttl: float = TTL):
    """A bindfs view of ``src`` at ``dst`` whose kernel caches for ``ttl`` seconds (NFS-like)."""
    with bindfs_view(src, dst, ttl):
        yield dst


@pytest.fixture
def shared_root(tmp_path):
    """(the real directory holding ``storage``, the storage directory)."""
    src = tmp_path / "src"
    src.mkdir(mode=0o755)
    (src / "storage").mkdir(mode=0o700)
    return src, src / "storage"


def directory_bytes(root: Path) -> int:
    """KV file bytes under ``root`` (what the capacity limits)."""
    total = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            if n.endswith(kvfile.SUFFIX) and not n.startswith("."):
                with contextlib.suppress(FileNotFoundError):
                    total += os.lstat(os.path.join(dirpath, n)).st_size
    return total


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def plant_files(root: Path, fp: str, n: int, shard: int, seed: int = 0) -> list[bytes]:
    """``n`` complete one-rank blocks with random keys (sparse files of the right size)."""
    keys = [bytes(k) for k in np.random.default_rng(seed).integers(0, 256, (n, 16), dtype=np.uint8)]
    for k in keys:
        path = Path(kvfile.file_path(str(root), fp, k, 0))
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.truncate(kvfile.file_size(shard))
    return keys


@contextlib.contextmanager
def traced(pid: int, out: Path, calls: str = "getdents64"):
    """strace ``calls`` of every thread of ``pid`` into ``out`` while the block runs (a
    descriptor argument is followed by its path: ``getdents64(5</dir>, ...``)."""
    if not shutil.which("strace"):
        pytest.skip("needs strace")
    proc = subprocess.Popen(
        ["strace", "-f", "-qq", "-y", "-e", f"trace={calls}", "-o", str(out), "-p", str(pid)]
    )
    try:
        time.sleep(1.0)  # attached to every thread
        yield
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(10)


def journal_bytes(d: Path) -> int:
    """Bytes of every journal in ``d`` (0 while there is none)."""
    return sum(p.stat().st_size for p in d.glob(f"*{J.SUFFIX}")) if d.exists() else 0


def listed(trace: Path) -> list[str]:
    """The directory of each ``getdents64`` call in a :func:`traced` file."""
    return re.findall(r"getdents64\(\d+<([^>]*)>", trace.read_text())


def lease_holder(storage: Path) -> int | None:
    try:
        return json.loads((storage / LEASE_FILE).read_text()).get("pid")
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------ the journal and the lease, in process
@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "storage"
    root.mkdir(mode=0o700)
    t = StorageTree.open(str(root))
    yield t
    t.close()


def rec(op: int, key: int, t: int) -> Record:
    return Record(op, 1, t, bytes([key]) * 16, 8192 if op == J.ADD else 0)


def test_a_reader_takes_whole_records_only_and_follows_a_compaction(tree):
    w = JournalWriter(tree, FP, "node-a")
    w.ensure_open()
    r = JournalReader(tree, FP)
    for x in (rec(J.ADD, 1, 10), rec(J.ADD, 2, 11), rec(J.ADD, 3, 12)):
        w.apply(x, mine=True)
    w.append([rec(J.ADD, 1, 10), rec(J.ADD, 2, 11)])
    got = r.poll()
    assert [x.key[0] for x in got["node-a.log"]] == [1, 2]
    path = Path(tree.path) / FP / JOURNAL_DIR / "node-a.log"
    with open(path, "ab") as f:  # a record not yet fully visible (the writer is mid-append)
        f.write(J.pack_record(rec(J.ADD, 3, 12))[:25])
    assert r.poll() == {}, "a torn record is not taken"
    with open(path, "ab") as f:
        f.write(J.pack_record(rec(J.ADD, 3, 12))[25:])
    assert [x.key[0] for x in r.poll()["node-a.log"]] == [3]
    w.apply(rec(J.DEL, 1, 20), mine=False)  # another node's evictor deleted block 1
    w.compact()
    assert sorted(x.key[0] for x in r.poll()["node-a.log"]) == [2, 3], "a new file: read from the start"
    w.close()
    assert J.unpack_header(path.read_bytes()).pid == 0, "a clean close"


def test_a_compaction_that_fails_for_space_leaves_no_temporary_file_and_the_journal_goes_on(
    tree, monkeypatch
):
    import errno

    w = JournalWriter(tree, FP, "node-a")
    w.ensure_open()
    for x in (rec(J.ADD, 1, 10), rec(J.ADD, 2, 11)):
        w.apply(x, mine=True)
    w.append([rec(J.ADD, 1, 10), rec(J.ADD, 2, 11)])
    write = os.write

    def full_for_snapshots(fd: int, data) -> int:  # the file system is full for the snapshot
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(fd, data)

    monkeypatch.setattr(J.os, "write", full_for_snapshots)
    with pytest.raises(OSError):
        w.compact()
    monkeypatch.undo()
    jdir = Path(tree.path) / FP / JOURNAL_DIR
    assert [p.name for p in jdir.iterdir()] == ["node-a.log"], "no half-written snapshot left"
    w.apply(rec(J.ADD, 3, 12), mine=True)
    w.append([rec(J.ADD, 3, 12)])
    assert sorted(x.key[0] for x in JournalReader(tree, FP).poll()["node-a.log"]) == [1, 2, 3]
    w.close()


def test_a_journal_stays_bounded_by_its_live_blocks(tree):
    w = JournalWriter(tree, FP, "node-a")
    w.ensure_open()
    for i in range(3 * J.COMPACT_MIN_RECORDS // 100):
        batch = [rec(J.ADD, i % 7, 100 * i + j) for j in range(100)]
        for x in batch:
            w.apply(x, mine=True)
        w.append(batch)
    size = (Path(tree.path) / FP / JOURNAL_DIR / "node-a.log").stat().st_size
    assert size <= J.HEADER_BYTES + (2 * 7 + J.COMPACT_MIN_RECORDS + 100) * J.RECORD_BYTES
    got = JournalReader(tree, FP).poll()["node-a.log"]
    assert len({x.key for x in got}) == 7


def test_a_blocks_read_is_journaled_at_most_once_per_period_in_a_fixed_table():
    reads = RecentReads(slots=4)
    a, b = bytes(16), b"\x02" + bytes(15)  # one slot (the same bytes 8..11), other keys
    assert reads.due(a, 100.0) and not reads.due(a, 100.0 + READ_EVERY_S / 2)
    assert reads.due(a, 100.0 + READ_EVERY_S), "the period is over"
    assert reads.due(b, 200.0) and reads.due(a, 200.0), "b took a's slot: a is journaled again, early"


def test_the_lease_is_held_by_one_node_and_taken_over_when_stale(tree):
    a, b = Lease(tree, "node-a", 2.0), Lease(tree, "node-b", 2.0)
    assert a.tick() and not b.tick() and b.holder == "node-a"
    # a hangs: its last renewal ran out more than half a lease ago
    body = json.loads((Path(tree.path) / LEASE_FILE).read_text())
    (Path(tree.path) / LEASE_FILE).write_text(json.dumps({**body, "until": time.time() - 1.1}))
    a.until = time.time() - 1.1
    assert not a.held(), "a holder past its lease does not evict"
    assert b.tick() and b.holder == "node-b"
    assert not a.tick() and a.holder == "node-b", "the old holder steps down"
    b.release()
    assert a.tick(), "released at a clean stop: taken at once"


# ------------------------------------------------------------------ discovery
def test_a_node_finds_another_nodes_files_within_the_poll_and_cache_ttl(tmp_path, shared_root):
    src, _ = shared_root
    with (
        view(src, tmp_path / "va") as va,
        view(src, tmp_path / "vb") as vb,
        running(env(va / "storage")) as a,
        running(env(vb / "storage")) as b,
    ):
        wa, wb = Writer(a), Writer(b)
        keys = wa.keys(range(6))
        assert wb.c.lookup(wb.ns.ns_id, keys) == (0, []), "b looked them up: misses are cached in its view"
        wa.put(keys)
        wa.wait_spilled(6)
        t0 = time.monotonic()
        wait_for(lambda: wb.c.lookup(wb.ns.ns_id, keys) == (6, [2] * 6), 30, "b's storage hits")
        found = time.monotonic() - t0
        bound = POLL + TTL + 1.5  # the documented time (journal poll + attribute cache) and a bound
        assert found <= bound, f"found after {found:.2f}s, documented within {bound:.2f}s"
        wb.data = wa.data
        wb.check_rows(keys, wb.c.promote(wb.ns.ns_id, keys))
        # blocks b never asked for: its catalog learns them from a's journal, no lookup needed
        more = wa.keys(range(6, 12))
        wa.put(more)
        wa.wait_spilled(12)
        t0 = time.monotonic()
        wb.wait_storage(lambda s: s["files"] == 12, 30, "b's catalog")
        assert time.monotonic() - t0 <= 2 * POLL + TTL + 1.5, "within two polls (a's append, b's read)"
        assert wb.c.lookup(wb.ns.ns_id, more) == (6, [2] * 6)
        wa.close()
        wb.close()


def test_a_block_another_node_deleted_becomes_a_miss_without_an_error(tmp_path, shared_root):
    src, storage = shared_root
    with (
        view(src, tmp_path / "va") as va,
        view(src, tmp_path / "vb") as vb,
        running(env(va / "storage")) as a,
        running(env(vb / "storage")) as b,
    ):
        wa, wb = Writer(a), Writer(b)
        keys = wa.keys(range(4))
        wa.put(keys)
        wa.wait_spilled(4)
        wait_for(lambda: wb.c.lookup(wb.ns.ns_id, keys) == (4, [2] * 4), 30, "b's storage hits")
        for k in keys[2:]:  # an operator (or another node's evictor) removes two blocks
            os.unlink(kvfile.file_path(str(storage), wa.fp, k, 0))
        wait_for(lambda: wb.c.lookup(wb.ns.ns_id, keys) == (2, [2] * 2), POLL + TTL + 5, "the miss")
        rows = wb.c.promote(wb.ns.ns_id, keys[:3])  # the hit and the next block, as a connector asks
        assert (rows[:2] >= 0).all() and (rows[2:] == -1).all()
        wb.c.unpin(wb.ns.ns_id, keys[:2])
        assert not [ln for ln in b.log().splitlines() if " ERROR " in ln], b.log()[-3000:]
        assert wb.storage()["io_errors"] == 0
        wa.close()
        wb.close()


def test_attach_reads_the_journals_instead_of_rescanning_the_tree(tmp_path, shared_root):
    _, storage = shared_root
    shard = 4096
    planted = plant_files(storage, FP, 3000, shard)  # files of an older hpkv: no journal
    with running(env(storage)) as a:  # the first attach scans the tree once and journals it
        with traced(a.proc.pid, tmp_path / "a.trace"):
            wa = Writer(a, shard=shard)
            wa.wait_storage(lambda s: s["files"] == 3000, 60, "a's scan")
        # the catalog counts the last leaf's blocks before the scan thread journals and logs
        wait_for(lambda: "scan of namespace" in a.log(), 10, "a's scan log line")
        scan_reads = len(listed(tmp_path / "a.trace"))
        # the journal directory is made at the attach; the scan's finds follow at a's next flush
        journaled = J.HEADER_BYTES + 3000 * J.RECORD_BYTES
        wait_for(lambda: journal_bytes(storage / FP / JOURNAL_DIR) >= journaled, 10, "a's journal")
        with running(env(storage)) as b:  # another node attaches: reads the journal
            with traced(b.proc.pid, tmp_path / "b.trace"):
                wb = Writer(b, shard=shard)
                wb.wait_storage(lambda s: s["files"] == 3000, 60, "b's journal read")
            # b tails the journal directory every poll (more listings the slower b is): only
            # a listing of any other directory is a rescan
            tree_reads = [d for d in listed(tmp_path / "b.trace") if Path(d).name != JOURNAL_DIR]
            assert "scan of namespace" not in b.log() and re.search(
                r"3000 block\(s\) from the journals", b.log()
            )
            assert scan_reads > 1000, f"the scan listed {scan_reads} directories"
            assert not tree_reads, (
                f"b listed {len(tree_reads)} directories of the tree (a rescan): {tree_reads[:3]}"
            )
            assert wb.c.lookup(wb.ns.ns_id, planted[:5]) == (5, [2] * 5)
            wb.close()
        wa.close()


# ------------------------------------------------------------------ capacity
def test_two_nodes_keep_the_directory_within_its_cap_and_spare_a_file_read_within_the_grace(
    tmp_path, shared_root
):
    src, storage = shared_root
    shard = 65536
    size = kvfile.file_size(shard)
    cap = 12 * size
    extra = {"HPKV_KV_STORAGE_SIZE": str(cap), "HPKV_STORAGE_READ_GRACE": "600"}
    with (
        view(src, tmp_path / "vb") as vb,
        running(env(storage, **extra)) as a,
        running(env(vb / "storage", **extra)) as b,
    ):
        wa, wb = Writer(a, shard=shard), Writer(b, shard=shard, seed=1)
        wait_for(lambda: lease_holder(storage) in (a.proc.pid, b.proc.pid), 10, "an evictor")
        holder, other = (wa, wb) if lease_holder(storage) == a.proc.pid else (wb, wa)
        old = wa.keys(["old"])
        wa.put(old)  # the oldest block: read by b, so it must survive
        wa.wait_spilled(1)
        wait_for(lambda: wb.c.lookup(wb.ns.ns_id, old) == (1, [2]), 30, "b finds a's block")
        wb.data.update(wa.data)
        wb.check_rows(old, wb.c.promote(wb.ns.ns_id, old))  # b's IO worker reads the file
        wb.c.unpin(wb.ns.ns_id, old)
        st = os.stat(wa.path(old[0]))
        assert st.st_atime_ns > st.st_mtime_ns, "b's reader left the access time through its view"
        peak = 0
        t0 = time.monotonic()
        for i in range(40):
            wa.put(wa.keys([f"a{i}"]))
            wb.put(wb.keys([f"b{i}"]))
            time.sleep(0.05)
            peak = max(peak, directory_bytes(storage))
        rate = 80 / (time.monotonic() - t0)  # blocks per second, both nodes
        # the documented slack: what all nodes write in two journal polls (a block is journaled at
        # its writer's next poll and seen at the evictor's next), plus half a second of
        # scheduling on this loaded machine
        slack = (int(rate * (2 * POLL + 0.5)) + 1) * size
        wait_for(lambda: directory_bytes(storage) <= cap, 10, "the directory under its cap")
        assert peak <= cap + slack, f"peak {peak} over cap {cap} + slack {slack}"
        assert os.path.exists(wa.path(old[0])), "b read it within the grace: kept"
        assert other.storage()["evicted_files"] == 0, "only the lease holder deletes"
        assert holder.storage()["evicted_files"] >= 80 - 12
        wa.close()
        wb.close()


def test_another_node_takes_the_evictor_lease_over_when_the_holder_is_killed(tmp_path, shared_root):
    _, storage = shared_root
    shard = 65536
    cap = 4 * kvfile.file_size(shard)
    extra = {"HPKV_KV_STORAGE_SIZE": str(cap), "HPKV_STORAGE_EVICTOR_LEASE": "2"}
    with running(env(storage, **extra)) as a:
        wait_for(lambda: lease_holder(storage) == a.proc.pid, 10, "a holds the lease")
        with running(env(storage, **extra)) as b:
            wb = Writer(b, shard=shard)
            time.sleep(1.0)
            assert lease_holder(storage) == a.proc.pid, "b waits while a renews"
            a.kill()  # SIGKILL of its process group: no release
            t0 = time.monotonic()
            wait_for(lambda: lease_holder(storage) == b.proc.pid, 15, "b takes the lease over")
            took = time.monotonic() - t0
            assert took <= 2 * 1.5 + POLL + 2.0, f"took {took:.1f}s (lease 2 s, stale after 1.5 x)"
            for i in range(8):
                wb.put(wb.keys([i]))
            wb.wait_storage(lambda s: s["evicted_files"] >= 4, 30, "b evicts")
            wait_for(lambda: directory_bytes(storage) <= cap, 10, "the directory under its cap")
            assert "took the lease over" in b.log()
            wb.close()

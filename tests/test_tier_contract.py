"""The tier contract in milliseconds: the logic the server composes over its tiers (the
tier list, with the index and the in-memory tier) and the file tier's bookkeeping (catalog,
spill completion and retry, the ENOSPC pause, capacity eviction, the scan) against a
links layer without worker processes. The end-to-end versions, with IO workers and real
files, are in test_storage.py and test_hardening_storage.py."""

from __future__ import annotations

import errno
import os
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest

from hpkv.config import load_config
from hpkv.engine.index import Index, Namespace, State
from hpkv.engine.storage import catalog as catalog_mod
from hpkv.engine.storage import upkeep as upkeep_mod
from hpkv.engine.storage.links import Completion, IoLinks
from hpkv.engine.storage.tier import FileTier
from hpkv.engine.tiers import LookupAnswer, ParkedLookup, TierList
from hpkv.io_workers import kvfile
from hpkv.protocol import wire as P
from hpkv.protocol.errors import Status
from hpkv.protocol.keys import block_keys, namespace_fingerprint
from hpkv.protocol.stats import G, NsCounter, StatsSegment
from hpkv.protocol.wire import Tier
from hpkv.ring import Doorbell
from hpkv.testing.memory_tier import MemoryTier

FP = namespace_fingerprint({"model": "tiers"})
SLOT = 4096


@dataclass
class FakeClient:
    cid: int = 1
    alive: bool = True


def keys_of(*names: str) -> list[bytes]:
    return block_keys(FP, [n.encode() for n in names])


def put(idx: Index, ns: Namespace, keys: list[bytes]):
    idx.reserve(ns.ns_id, keys)
    return idx.commit(ns.ns_id, keys, 0)


def lookup(
    idx: Index, tiers: TierList, ns: Namespace, keys: list[bytes], park: bool = True
) -> tuple[int, list[int]]:
    """What the server's _hot_lookup does: the index's prefix, then the tiers below; a parked
    call is answered (the lookup run again, not parked) when the tiers' poll says so."""
    hit, found = idx.lookup(ns.ns_id, keys)
    if tiers and (hit < len(keys) or max(found, default=0) >= Tier.STORAGE):
        call = ParkedLookup(FakeClient(), 1, ns, len(keys), time.monotonic()) if park else None
        hit, pending = tiers.lookup(ns, keys, hit, found, call)
        if pending and park:
            wait_answer(tiers)
            return lookup(idx, tiers, ns, keys, park=False)
    return hit, found


def wait_answer(tiers: TierList, timeout: float = 10.0) -> LookupAnswer:
    deadline = time.monotonic() + timeout
    while True:
        answers = [a for a in tiers.poll() if isinstance(a, LookupAnswer)]
        if answers:
            (answer,) = answers
            return answer
        assert time.monotonic() < deadline, "the parked lookup was never answered"
        time.sleep(0.001)


@pytest.fixture
def mem():
    idx = Index(4 * SLOT, storage_enabled=True)
    ns = Namespace(0, "m", FP, 1, SLOT)
    idx.add_namespace(ns)
    pool = np.zeros(4 * SLOT, np.uint8)
    tier = MemoryTier(idx, pool=pool)
    tiers = TierList([tier])
    tiers.attach(ns)
    return idx, ns, tier, tiers, pool


# ------------------------------------------------------------------ the server's side, memory tier
def test_a_lookup_extends_past_dram_into_the_tier(mem):
    idx, ns, tier, tiers, _ = mem
    a, b, c, d = keys_of("a", "b", "c", "d")
    put(idx, ns, [a, b])
    tier.put(ns, c)
    tier.put(ns, d)
    assert lookup(idx, tiers, ns, [a, b, c, d]) == (4, [Tier.DRAM, Tier.DRAM, Tier.STORAGE, Tier.STORAGE])
    assert idx.lookup(ns.ns_id, [c]) == (1, [Tier.STORAGE]), "the tier's keys are hits of the index now"


def test_a_promote_parks_and_is_answered_from_poll(mem):
    idx, ns, tier, tiers, pool = mem
    (k,) = keys_of("k")
    tier.put(ns, k, [b"\x07" * SLOT])
    client = FakeClient()
    assert tiers.promote(client, 5, ns, [k], timeout=1.0) is None, "parked: the data is below"
    (answer,) = tiers.poll()
    assert answer.client is client and answer.seq == 5
    off = int(answer.rows[0, 0])
    assert off >= 0 and pool[off : off + SLOT].tobytes() == b"\x07" * SLOT
    assert idx.blocks[k].state == State.READY and idx.blocks[k].pins == 1
    assert ns.counters[NsCounter.LOADS_STORAGE] == 1
    assert tiers.poll() == [], "answered once"


def test_a_slow_promote_is_answered_when_its_work_ends(mem):
    idx, ns, tier, tiers, _ = mem
    tier.delay_polls = 3
    (k,) = keys_of("k")
    tier.put(ns, k)
    assert tiers.promote(FakeClient(), 1, ns, [k], timeout=5.0) is None
    assert tiers.poll() == [] and tiers.poll() == []
    assert [a.seq for a in tiers.poll()] == [1]


def test_a_promote_past_its_deadline_answers_missing(mem):
    idx, ns, tier, tiers, _ = mem
    tier.delay_polls = 100
    (k,) = keys_of("k")
    tier.put(ns, k)
    assert tiers.promote(FakeClient(), 1, ns, [k], timeout=0.0) is None
    (answer,) = tiers.poll()
    assert (answer.rows == -1).all()


def test_a_failed_promote_answers_missing_and_keeps_the_key_below(mem):
    idx, ns, tier, tiers, _ = mem
    a, b = keys_of("a", "b")
    put(idx, ns, [a])
    tier.put(ns, b)
    tier.fail_promotes.add(b)
    assert tiers.promote(FakeClient(), 1, ns, [a, b], timeout=1.0) is None
    (answer,) = tiers.poll()
    assert answer.rows[0, 0] >= 0 and answer.rows[1, 0] == -1
    assert b not in idx.blocks and idx.alloc.used == SLOT, "the failed promote's slot is free again"
    assert lookup(idx, tiers, ns, [b]) == (1, [Tier.STORAGE]), "a failed read is no proof the data is gone"


def test_a_dropped_client_gets_no_answer(mem):
    idx, ns, tier, tiers, _ = mem
    (k,) = keys_of("k")
    tier.put(ns, k)
    client = FakeClient()
    assert tiers.promote(client, 1, ns, [k], timeout=1.0) is None
    tiers.client_gone(client)
    assert tiers.poll() == []


def test_a_committed_block_is_spilled_and_then_evictable(mem):
    idx, ns, tier, tiers, pool = mem
    keys = keys_of("0", "1", "2", "3")
    ready = put(idx, ns, keys)
    for i, b in enumerate(ready):
        pool[b.slots[0] : b.slots[0] + SLOT] = i + 1
    tiers.spill(ready)
    assert tiers.pending_spills() == 4
    (more,) = keys_of("more")
    assert idx.reserve(ns.ns_id, [more])[0, 0] == -2, "a block whose spill runs is not evicted"
    tiers.poll()
    assert tiers.pending_spills() == 0 and ns.counters[NsCounter.BLOCKS_STORAGE] == 4
    assert idx.reserve(ns.ns_id, [more])[0, 0] >= 0, "spilled: evictable"
    assert lookup(idx, tiers, ns, keys[:1]) == (1, [Tier.STORAGE])
    assert tier.medium[keys[0]] == [b"\x01" * SLOT]


def test_a_failed_spill_leaves_the_block_evictable_without_a_copy(mem):
    idx, ns, tier, tiers, _ = mem
    keys = keys_of("0", "1", "2", "3")
    tier.fail_spills.add(keys[0])
    tiers.spill(put(idx, ns, keys))
    tiers.poll()
    idx.reserve(ns.ns_id, keys_of("new"))
    assert lookup(idx, tiers, ns, keys[:1]) == (0, []), "evicted, and nothing below"


def test_a_lost_block_is_a_miss_not_an_error(mem):
    idx, ns, tier, tiers, _ = mem
    a, b = keys_of("a", "b")
    tier.put(ns, a)
    tier.put(ns, b)
    assert lookup(idx, tiers, ns, [a, b])[0] == 2
    tier.lose(a)
    assert lookup(idx, tiers, ns, [a, b]) == (0, []), "the lookup that sees it gone cuts the prefix"
    assert ns.counters[NsCounter.BLOCKS_STORAGE] == 1
    tier.lose(b)  # lost between the lookup and the promote
    assert tiers.promote(FakeClient(), 1, ns, [b], timeout=1.0) is None
    (answer,) = tiers.poll()
    assert (answer.rows == -1).all() and b not in tier.catalog and idx.lookup(ns.ns_id, [b]) == (0, [])


def test_a_key_below_belongs_to_its_namespace(mem):
    idx, ns, tier, tiers, _ = mem
    other = Namespace(1, "other", namespace_fingerprint({"m": "other"}), 1, SLOT)
    idx.add_namespace(other)
    (k,) = keys_of("k")
    tier.put(ns, k)
    assert lookup(idx, tiers, ns, [k])[0] == 1
    assert lookup(idx, tiers, other, [k]) == (0, []) and idx.reserve(other.ns_id, [k])[0, 0] == -2
    assert tiers.promote(FakeClient(), 1, other, [k], timeout=1.0) is not None, "no hit: answered at once"


def test_detach_forgets_the_namespace_below(mem):
    idx, ns, tier, tiers, _ = mem
    (k,) = keys_of("k")
    tier.put(ns, k)
    lookup(idx, tiers, ns, [k])
    assert idx.block_count() == 1
    assert idx.drop_namespace(ns)
    tiers.detach(ns)
    assert idx.block_count() == 0 and len(tier.catalog) == 0 and idx.lookup(ns.ns_id, [k]) == (0, [])


# ------------------------------------------------------------------ the file tier's bookkeeping
class ScriptedLinks(IoLinks):
    """IO links without workers: every queued job completes on the next poll, with the status
    ``status(job)`` gives (0 by default)."""

    def __init__(self, stats: StatsSegment, doorbell: Doorbell):
        super().__init__(stats, doorbell)
        self.status = lambda job: 0
        self.taken: list = []

    def dispatch(self, ns_raw: dict[int, bytes], spills: bool = True) -> None:
        queues = [self.promote_q, self.spill_q] if spills else [self.promote_q]
        for q in queues:
            while q:
                self.taken.append(q.popleft())

    def spills_pending(self) -> int:
        return len({id(j.op) for j in [*self.spill_q, *self.taken] if j.op.kind == P.SPILL})

    def collect(self) -> list[Completion]:
        taken, self.taken = self.taken, []
        return [Completion(job, self.status(job), 100, 0) for job in taken]


@pytest.fixture
def files(tmp_path, monkeypatch):
    root = tmp_path / "st"
    root.mkdir(mode=0o700)
    # a generous lookup bound: these tests are about what a lookup learns, not how fast
    cfg = load_config(
        {
            "HPKV_KV_STORAGE_PATH": str(root),
            "HPKV_KV_STORAGE_SIZE": "0",
            "HPKV_STORAGE_LOOKUP_WAIT_MS": "10000",
        }
    )
    stats = StatsSegment.create(str(tmp_path))
    bell = Doorbell.create(str(tmp_path), "server")
    idx = Index(4 * SLOT, storage_enabled=True)
    ns = Namespace(0, "m", FP, 1, SLOT)
    idx.add_namespace(ns)
    links = ScriptedLinks(stats, bell)
    monkeypatch.setattr(upkeep_mod, "ENOSPC_BACKOFF_S", (0.05, 0.1))  # a pause this short
    tier = FileTier(cfg, str(tmp_path), stats, idx, threading.RLock(), bell, "pool", links=links)
    tier.start([], maintenance=False)
    yield idx, ns, tier, links, stats.glob
    tier.shutdown()
    bell.close()
    stats.close()


def test_a_spill_completion_puts_the_block_in_the_catalog(files):
    idx, ns, tier, links, g = files
    (k,) = keys_of("k")
    tier.spill(put(idx, ns, [k]))
    assert tier.pending_spills() == 1 and idx.in_io(k)
    tier.poll()
    assert k in tier.catalog and not idx.in_io(k) and g[G.STORAGE_SPILLS] == 1
    assert g[G.STORAGE_FILES] == 1 and g[G.STORAGE_BYTES] == kvfile.file_size(SLOT)


def test_a_spill_of_a_dead_worker_is_retried_on_the_next_round(files):
    idx, ns, tier, links, g = files
    (k,) = keys_of("k")
    links.status = lambda job: Status.WORKER_DIED
    tier.spill(put(idx, ns, [k]))
    tier.poll()
    assert k not in tier.catalog and tier.pending_spills() == 1, "remembered for a retry"
    links.status = lambda job: 0
    tier.poll()  # the retry starts ...
    tier.poll()  # ... and completes
    assert k in tier.catalog and tier.pending_spills() == 0


def test_a_spill_failing_with_an_io_error_gives_up_after_its_attempts(files):
    idx, ns, tier, links, g = files
    (k,) = keys_of("k")
    links.status = lambda job: -errno.EIO
    tier.spill(put(idx, ns, [k]))
    for _ in range(5):
        tier.upkeep.retry_soon()
        tier.poll()
    assert k not in tier.catalog and tier.pending_spills() == 0
    assert g[G.STORAGE_IO_ERRORS] == 3, "three attempts (MAX_SPILL_ATTEMPTS), then it stays in DRAM only"


def test_enospc_pauses_spilling_and_the_skipped_blocks_spill_on_resume(files):
    idx, ns, tier, links, g = files
    a, b, c = keys_of("a", "b", "c")
    links.status = lambda job: -errno.ENOSPC if job.op.block.key == a else 0
    tier.spill(put(idx, ns, [a]))
    tier.poll()
    assert tier.upkeep.paused and g[G.STORAGE_SPILL_PAUSED] == 1
    tier.spill(put(idx, ns, [b, c]))
    assert not links.taken and not links.spill_q, "paused: nothing is spilled, the blocks are remembered"
    assert (idx.reserve(ns.ns_id, keys_of("x", "y", "z")) >= 0).all(), "evictable without files meanwhile"
    assert a not in idx.blocks and b not in idx.blocks and idx.in_dram(ns, c)
    links.status = lambda job: 0
    time.sleep(0.06)
    tier.upkeep.check_free_space()  # the maintenance thread's round: the back-off is over
    assert not tier.upkeep.paused and g[G.STORAGE_SPILL_PAUSED] == 0
    tier.poll()  # retries the spills of blocks still in DRAM ...
    tier.poll()  # ... which complete
    assert c in tier.catalog and a not in tier.catalog and b not in tier.catalog, "only c was still in DRAM"
    assert tier.pending_spills() == 0 and g[G.STORAGE_SPILLS] == 1


def test_capacity_eviction_takes_the_least_recent_and_skips_blocks_in_use(files):
    idx, ns, tier, links, g = files
    cat = tier.catalog
    k = keys_of("0", "1", "2", "3", "found")
    for key in k[:4]:
        cat.add(ns, key)
    cat.add(ns, k[4], recent=False)  # found by a scan: the cold end
    cat.touch(k[0])
    size = kvfile.file_size(SLOT)
    victims = cat.take_victims(2 * size, in_use=lambda key: key == k[1])
    assert [key for _, key in victims] == [k[4], k[2], k[3]], "scanned first, then LRU, the one in use kept"
    assert cat.keys() == [k[1], k[0]] and cat.bytes == 2 * size
    assert not cat.unknown(k[2]), "being deleted: a stat must not bring it back"
    cat.deleted([key for _, key in victims])
    assert cat.unknown(k[2])


def test_the_evictor_unlinks_the_least_recently_used_files_over_the_directory_capacity(files):
    idx, ns, tier, links, g = files
    k = keys_of("0", "1", "2")
    shared = tier.shared
    assert shared.attach_journals(ns) is None, "no journal yet: the namespace is scanned"
    for key in k:
        write_kv_file(tier.root, key)
        tier.catalog.add(ns, key)
        shared.added(ns, key)
        time.sleep(0.002)  # distinct journal times
    shared.used(ns, k[0])  # used after the others: the most recent
    shared.capacity = 2 * kvfile.file_size(SLOT)
    shared.tick()
    assert shared.evicting and shared.total == 2 * kvfile.file_size(SLOT)
    assert [os.path.exists(kvfile.file_path(tier.root, FP, key, 0)) for key in k] == [True, False, True]
    assert g[G.STORAGE_EVICTED_FILES] == 1 and g[G.STORAGE_FILES] == 2 and k[1] not in tier.catalog


def test_the_evictor_keeps_a_file_read_within_the_grace(files):
    idx, ns, tier, links, g = files
    k = keys_of("0", "1")
    shared = tier.shared
    shared.attach_journals(ns)
    for key in k:
        write_kv_file(tier.root, key)
        shared.added(ns, key)
        time.sleep(0.002)
    st = os.stat(kvfile.file_path(tier.root, FP, k[0], 0))
    os.utime(kvfile.file_path(tier.root, FP, k[0], 0), ns=(time.time_ns(), st.st_mtime_ns))  # a reader
    shared.capacity = kvfile.file_size(SLOT)
    shared.tick()
    assert os.path.exists(kvfile.file_path(tier.root, FP, k[0], 0)), "read within the grace: kept"
    assert not os.path.exists(kvfile.file_path(tier.root, FP, k[1], 0)), "the next least recent went"
    shared.grace_ns = 0
    write_kv_file(tier.root, k[1])
    shared.added(ns, k[1])
    shared.tick()
    assert not os.path.exists(kvfile.file_path(tier.root, FP, k[0], 0)), "past the grace it is evicted"


def test_a_server_that_is_not_the_evictor_deletes_nothing(files):
    idx, ns, tier, links, g = files
    shared = tier.shared
    shared.attach_journals(ns)
    (k,) = keys_of("0")
    write_kv_file(tier.root, k)
    shared.added(ns, k)
    shared.capacity, shared.evictor = 1, "never"
    shared.tick()
    assert not shared.evicting and os.path.exists(kvfile.file_path(tier.root, FP, k, 0))


def write_kv_file(root: str, key: bytes) -> None:
    path = kvfile.file_path(root, FP, key, 0)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(kvfile.file_size(SLOT))


def test_a_scan_merges_with_the_blocks_already_known(files):
    idx, ns, tier, links, g = files
    known, promoting, new = keys_of("known", "promoting", "new")
    for key in (known, promoting, new):
        write_kv_file(tier.root, key)
    tier.catalog.add(ns, known)
    tier.catalog.add(ns, promoting)
    assert tier.promote(FakeClient(), 1, ns, [promoting], timeout=1.0) is None
    tier.catalog.forget(promoting)  # (as a corrupt file would) but its promote still runs
    tier.attach(ns)
    deadline = time.monotonic() + 10
    while not tier.scanner.done[0] and time.monotonic() < deadline:
        time.sleep(0.001)
    assert tier.scanner.done == {0: True} and tier.take_catalog_dirty()
    assert new in tier.catalog and promoting not in tier.catalog
    assert tier.catalog.keys() == [new, known], "found by the scan: colder than what was used here"


def test_a_stat_finds_files_the_scan_has_not_reached_and_a_lookup_drops_deleted_ones(files, monkeypatch):
    idx, ns, tier, links, g = files
    a, b = keys_of("a", "b")
    write_kv_file(tier.root, a)
    write_kv_file(tier.root, b)
    tiers = TierList([tier])
    assert lookup(idx, tiers, ns, [a, b]) == (2, [Tier.STORAGE, Tier.STORAGE])
    os.unlink(kvfile.file_path(tier.root, FP, a, 0))
    monkeypatch.setattr(catalog_mod, "VERIFY_TTL_S", 0.0)  # every hit is checked again
    assert lookup(idx, tiers, ns, [a, b]) == (0, [])
    assert a not in tier.catalog and b in tier.catalog


# ------------------------------------------------------------------ two tiers: files, then a remote store
@pytest.fixture
def stacked():
    """The index over two in-memory tiers in the server's order: "files" (Tier.STORAGE), then
    a "remote" store (Tier.REMOTE); the data really moves through the pool."""
    idx = Index(8 * SLOT, storage_enabled=True)
    ns = Namespace(0, "m", FP, 1, SLOT)
    idx.add_namespace(ns)
    pool = np.zeros(8 * SLOT, np.uint8)
    files = MemoryTier(idx, pool=pool)
    remote = MemoryTier(idx, pool=pool, tier=Tier.REMOTE)
    tiers = TierList([files, remote])
    tiers.attach(ns)
    return idx, ns, files, remote, tiers, pool


def shard(i: int) -> bytes:
    return bytes([i]) * SLOT


def promote_all(tiers: TierList, ns: Namespace, keys: list[bytes], client=None) -> np.ndarray:
    """A PROMOTE as the server makes it: the rows now, or the one answer a later poll brings."""
    client = client or FakeClient()
    rows = tiers.promote(client, 7, ns, keys, timeout=5.0)
    for _ in range(100):
        if rows is not None:
            return rows
        answers = tiers.poll()
        if answers:
            (answer,) = answers
            assert answer.client is client and answer.seq == 7
            rows = answer.rows
    raise AssertionError("the promote was never answered")


def test_a_mixed_hit_across_dram_files_and_the_remote_store_is_one_byte_exact_hit(stacked):
    idx, ns, files, remote, tiers, pool = stacked
    keys = keys_of("d0", "d1", "f2", "f3", "r4", "r5")
    for i, b in enumerate(put(idx, ns, keys[:2])):
        pool[b.slots[0] : b.slots[0] + SLOT] = i
    files.put(ns, keys[2], [shard(2)])
    files.put(ns, keys[3], [shard(3)])
    remote.put(ns, keys[4], [shard(4)])
    remote.put(ns, keys[5], [shard(5)])
    D, S, R = Tier.DRAM, Tier.STORAGE, Tier.REMOTE
    hit, found = lookup(idx, tiers, ns, keys)
    assert (hit, found) == (6, [D, D, S, S, R, R]), "one hit across the three tiers"
    idx.count_lookup(ns, len(keys), found)  # (as the server counts its answer)
    assert ns.counters[NsCounter.HITS_REMOTE] == 2 and ns.counters[NsCounter.HITS_STORAGE] == 2

    rows = promote_all(tiers, ns, keys)
    assert [pool[off : off + SLOT].tobytes() for off in rows[:, 0]] == [shard(i) for i in range(6)]
    assert ns.counters[NsCounter.LOADS_DRAM] == 2
    assert ns.counters[NsCounter.LOADS_STORAGE] == 2, "files read from the file tier"
    assert ns.counters[NsCounter.LOADS_REMOTE] == 2, "the rest from the remote store"
    assert all(idx.blocks[k].pins == 1 for k in keys) and tiers.poll() == [], "answered once"
    assert lookup(idx, tiers, ns, keys) == (6, [D] * 6)


def test_the_file_tier_wins_over_the_remote_store_for_blocks_it_has(stacked):
    idx, ns, files, remote, tiers, pool = stacked
    (k,) = keys_of("k")
    files.put(ns, k, [shard(1)])
    remote.put(ns, k, [shard(9)])  # (never served while the files have the block)
    remote.catalog.add(ns, k)  # both tiers know they hold it, the store first
    files.catalog.add(ns, k)
    assert lookup(idx, tiers, ns, [k]) == (1, [Tier.STORAGE])
    (off,) = promote_all(tiers, ns, [k])[:, 0]
    assert pool[off : off + SLOT].tobytes() == shard(1)
    assert ns.counters[NsCounter.LOADS_STORAGE] == 1 and ns.counters[NsCounter.LOADS_REMOTE] == 0
    assert idx.unpin([k], owner=1) == 1 and idx.drop_dram([idx.blocks[k]]) == 1
    assert k not in idx.blocks and lookup(idx, tiers, ns, [k]) == (1, [Tier.STORAGE])
    files.lose(k)  # the files go: the store's copy is the hit now
    assert lookup(idx, tiers, ns, [k]) == (0, []), "the lookup that sees the files gone cuts there"
    assert idx.lookup(ns.ns_id, [k]) == (1, [Tier.REMOTE]), "and the key falls through to the store"


def test_a_committed_block_is_written_to_the_files_and_published_to_the_store(stacked):
    idx, ns, files, remote, tiers, pool = stacked
    keys = keys_of("0", "1")
    ready = put(idx, ns, keys)
    for i, b in enumerate(ready):
        pool[b.slots[0] : b.slots[0] + SLOT] = i + 1
    tiers.spill(ready)
    assert tiers.pending_spills() == 4, "each block once per tier"
    tiers.poll()
    assert tiers.pending_spills() == 0
    assert files.medium[keys[0]] == remote.medium[keys[0]] == [shard(1)]
    assert ns.counters[NsCounter.BLOCKS_STORAGE] == 2 and ns.counters[NsCounter.BLOCKS_REMOTE] == 2
    assert idx.drop_dram(ready) == 2, "with copies below: evictable"
    assert lookup(idx, tiers, ns, keys) == (2, [Tier.STORAGE] * 2)


def test_a_block_the_store_failed_to_take_is_still_written_to_the_files(stacked):
    idx, ns, files, remote, tiers, pool = stacked
    (k,) = keys_of("k")
    remote.fail_spills.add(k)
    tiers.spill(put(idx, ns, [k]))
    tiers.poll()
    assert k in files.catalog and k not in remote.catalog
    assert idx.drop_dram([idx.blocks[k]]) == 1 and lookup(idx, tiers, ns, [k]) == (1, [Tier.STORAGE])


def test_a_lookup_asks_both_tiers_at_once_and_stays_within_the_longer_bound(stacked):
    idx, ns, files, remote, tiers, _ = stacked
    files.presence_polls, files.lookup_wait = 3, 10.0
    remote.presence_polls, remote.lookup_wait = 1, 5.0
    a, b, c = keys_of("a", "b", "c")
    put(idx, ns, [a])
    remote.put(ns, b)
    remote.put(ns, c)
    t0 = time.monotonic()
    call, pending = park(tiers, idx, ns, [a, b, c])
    assert pending and call.outstanding == 2, "the files and the store are asked at once"
    assert t0 + 5.0 <= call.deadline <= time.monotonic() + 10.0, "the call waits at most the longer bound"
    wait_answer(tiers)
    assert lookup(idx, tiers, ns, [a, b, c], park=False)[:2] == (3, [Tier.DRAM, Tier.REMOTE, Tier.REMOTE])


def test_a_stop_waits_for_the_files_spills_while_the_store_is_down(stacked):
    idx, ns, files, remote, tiers, _ = stacked
    remote.degraded = True  # (the store down; its publishes still queued)
    files.delay_polls, remote.delay_polls = 1, 100
    tiers.spill(put(idx, ns, keys_of("k")))
    assert tiers.pending_spills() == 2 and not tiers.degraded, "the files' spill can still end"
    tiers.poll()
    assert tiers.pending_spills() == 1 and tiers.degraded, "only the down store's spill is left"


def test_a_promote_split_over_two_tiers_of_a_dropped_client_gets_no_answer(stacked):
    idx, ns, files, remote, tiers, _ = stacked
    a, b = keys_of("a", "b")
    files.put(ns, a)
    remote.put(ns, b)
    lookup(idx, tiers, ns, [a, b])
    client = FakeClient()
    assert tiers.promote(client, 1, ns, [a, b], timeout=5.0) is None
    client.alive = False
    tiers.client_gone(client)
    assert tiers.poll() == [] and tiers.poll() == []


# ------------------------------------------------------------------ lookups that ask a slow medium
def park(
    tiers: TierList, idx: Index, ns: Namespace, keys: list[bytes], client=None
) -> tuple[ParkedLookup, bool]:
    """A lookup's first pass as the server makes it: (its call, whether the tiers parked it)."""
    hit, found = idx.lookup(ns.ns_id, keys)
    call = ParkedLookup(client or FakeClient(), 1, ns, len(keys), time.monotonic())
    return call, tiers.lookup(ns, keys, hit, found, call).pending


def unconfirmed(idx: Index, tiers: TierList, ns: Namespace, keys: list[bytes]) -> bool:
    """Whether a lookup answered now (not parked) says the key after its prefix is still
    being checked (the server sends it with the answer: the engine may ask again)."""
    hit, found = idx.lookup(ns.ns_id, keys)
    return tiers.lookup(ns, keys, hit, found, None).pending


def test_a_slow_lookup_is_parked_and_answered_from_poll_when_its_check_ends(mem):
    idx, ns, tier, tiers, _ = mem
    tier.presence_polls, tier.lookup_wait = 2, 10.0
    a, b = keys_of("a", "b")
    put(idx, ns, [a])
    tier.put(ns, b)
    call, pending = park(tiers, idx, ns, [a, b])
    assert pending and call.outstanding == 1
    assert tiers.poll() == [], "the check is still running"
    (answer,) = tiers.poll()
    assert isinstance(answer, LookupAnswer) and answer.client is call.client and answer.n == 2
    assert lookup(idx, tiers, ns, [a, b], park=False) == (2, [Tier.DRAM, Tier.STORAGE])
    assert tiers.poll() == [], "answered once"


def test_past_its_bound_a_parked_lookup_answers_what_is_confirmed(mem):
    idx, ns, tier, tiers, _ = mem
    tier.presence_polls, tier.lookup_wait = None, 0.01  # a hung medium
    a, b, c = keys_of("a", "b", "c")
    put(idx, ns, [a, b])
    tier.put(ns, c)
    call, pending = park(tiers, idx, ns, [a, b, c])
    assert pending
    assert tiers.poll() == [] and tiers.next_deadline() == call.deadline
    time.sleep(0.02)
    (answer,) = tiers.poll()
    assert isinstance(answer, LookupAnswer)
    assert lookup(idx, tiers, ns, [a, b, c], park=False) == (2, [Tier.DRAM, Tier.DRAM]), "the DRAM prefix"
    assert unconfirmed(idx, tiers, ns, [a, b, c]), "c is still being asked about: the answer says so"


def test_a_lookup_of_dram_blocks_never_waits_for_the_medium(mem):
    idx, ns, tier, tiers, _ = mem
    tier.presence_polls = None
    keys = keys_of("a", "b")
    put(idx, ns, keys)
    _, pending = park(tiers, idx, ns, keys)
    assert not pending


def test_with_every_check_running_a_lookup_is_answered_at_once(mem):
    idx, ns, tier, tiers, _ = mem
    tier.presence_polls, tier.max_checks = None, 1
    a, b, c = keys_of("a", "b", "c")
    put(idx, ns, [a])
    assert park(tiers, idx, ns, [a, b])[1], "the first one parks"
    assert not park(tiers, idx, ns, [a, c])[1], "saturated: no more parking"
    assert tier.saturated == 1
    assert lookup(idx, tiers, ns, [a, c]) == (1, [Tier.DRAM])


def test_a_parked_lookup_of_a_dropped_client_gets_no_answer(mem):
    idx, ns, tier, tiers, _ = mem
    tier.presence_polls = 1
    (k,) = keys_of("k")
    client = FakeClient()
    assert park(tiers, idx, ns, [k], client)[1]
    tiers.client_gone(client)
    assert tiers.poll() == [] and tiers.next_deadline() is None


# ------------------------------------------------------------------ the file tier's stats, off the loop
@pytest.fixture
def hung_stats(files, monkeypatch):
    """The file tier with stats that block until ``release`` is set (a hung mount)."""
    from hpkv.engine.storage import stat as stat_mod

    release = threading.Event()
    real = stat_mod.stat_block

    def stat_block(tree, ns, key, by_open=False):
        release.wait(10)
        return real(tree, ns, key, by_open)

    monkeypatch.setattr(stat_mod, "stat_block", stat_block)
    idx, ns, tier, links, g = files
    tier.lookup_wait = 0.02
    try:
        yield (*files, release)
    finally:
        release.set()


def answer_when_due(tiers: TierList, timeout: float = 5.0) -> LookupAnswer:
    return wait_answer(tiers, timeout)


def test_a_hung_stat_makes_unknown_keys_misses_at_the_bound_and_dram_keeps_serving(hung_stats):
    idx, ns, tier, links, g, release = hung_stats
    tiers = TierList([tier])
    a, b, c = keys_of("a", "b", "c")
    put(idx, ns, [a, b])
    write_kv_file(tier.root, c)
    t0 = time.monotonic()
    assert park(tiers, idx, ns, [a, b, c])[1]
    answer_when_due(tiers)
    assert 0.015 < time.monotonic() - t0 < 2.0
    assert lookup(idx, tiers, ns, [a, b, c], park=False) == (2, [Tier.DRAM, Tier.DRAM])
    assert g[G.STORAGE_LOOKUPS_BOUNDED] == 1
    assert unconfirmed(idx, tiers, ns, [a, b, c]), "c's stat still runs: unconfirmed, not missing"
    assert not park(tiers, idx, ns, [a, b])[1], "DRAM hits are answered at once"
    release.set()
    wait_for_cond(lambda: (tiers.poll(), c in tier.catalog)[1])
    assert lookup(idx, tiers, ns, [a, b, c]) == (3, [Tier.DRAM, Tier.DRAM, Tier.STORAGE]), (
        "found once it returns"
    )


def test_stuck_stat_threads_saturate_the_pool_the_tier_degrades_and_recovers(hung_stats):
    idx, ns, tier, links, g, release = hung_stats
    tiers = TierList([tier])
    (a,) = keys_of("a")
    put(idx, ns, [a])
    unknown = keys_of(*[f"u{i}" for i in range(tier.stats_pool.max_batches + 1)])
    for k in unknown[:-1]:
        assert park(tiers, idx, ns, [a, k])[1]
    assert not park(tiers, idx, ns, [a, unknown[-1]])[1], "saturated: answered at once"
    assert g[G.STORAGE_STAT_SATURATED] == 1
    time.sleep(0.03)  # past the lookup bound
    tiers.poll()
    assert tier.health.degraded and g[G.STORAGE_DEGRADED] == 1
    assert tier.describe()["state"] == "degraded" and tier.describe()["degraded_reason"]
    assert tier.take_catalog_dirty(), "monitors are told"
    assert g[G.STORAGE_STAT_TIMEOUTS] >= 1
    release.set()
    wait_for_cond(lambda: (tiers.poll(), not tier.health.degraded)[1])
    assert g[G.STORAGE_DEGRADED] == 0 and tier.describe()["state"] == "ok"
    assert tier.stats_pool.submit(lambda: None), "the pool takes work again"


def test_a_hit_due_for_its_check_during_a_hung_stat_is_a_miss_not_forgotten(hung_stats, monkeypatch):
    idx, ns, tier, links, g, release = hung_stats
    tiers = TierList([tier])
    (k,) = keys_of("k")
    write_kv_file(tier.root, k)
    tier.catalog.add(ns, k)
    monkeypatch.setattr(catalog_mod, "VERIFY_TTL_S", 0.0)
    assert park(tiers, idx, ns, [k])[1]
    answer_when_due(tiers)
    assert lookup(idx, tiers, ns, [k], park=False) == (0, [])
    assert k in tier.catalog, "not proven gone: kept"


def wait_for_cond(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_key_stat_ed_missing_is_not_stat_ed_again_for_a_while(files, monkeypatch):
    from hpkv.engine.storage import tier as tier_mod

    idx, ns, tier, links, g = files
    tiers = TierList([tier])
    (k,) = keys_of("k")
    assert lookup(idx, tiers, ns, [k]) == (0, [])
    _, pending = park(tiers, idx, ns, [k])
    assert not pending, "remembered missing: no stat"
    write_kv_file(tier.root, k)
    tier._missing.prune(time.monotonic() + tier_mod.NEGATIVE_TTL_S)  # the TTL passed
    assert lookup(idx, tiers, ns, [k]) == (1, [Tier.STORAGE]), "after the TTL a stat finds it"


def test_a_key_a_promote_found_gone_comes_back_only_when_its_files_open(files, monkeypatch):
    """A caching mount (NFS attributes, a FUSE attr_timeout) shows a stat the files another
    node deleted: after a promote found them gone, the lookup's check opens them."""
    from hpkv.engine.storage import tier as tier_mod

    idx, ns, tier, links, g = files
    tiers = TierList([tier])
    (k,) = keys_of("k")
    write_kv_file(tier.root, k)
    path = kvfile.file_path(tier.root, FP, k, 0)
    cached = os.stat(path)
    monkeypatch.setattr(tier.tree, "stat", lambda rel, name: cached)  # the mount's attribute cache
    tier.catalog.add(ns, k)
    os.unlink(path)  # another node's evictor
    links.status = lambda job: -errno.ENOENT
    assert tier.promote(FakeClient(), 1, ns, [k], timeout=1.0) is None
    (answer,) = tier.poll()
    assert (answer.rows == -1).all() and k not in tier.catalog
    assert lookup(idx, tiers, ns, [k]) == (0, []), "gone when opened, whatever the stat says"
    write_kv_file(tier.root, k)  # written again, by another node
    tier._missing.prune(time.monotonic() + tier_mod.NEGATIVE_TTL_S)
    assert lookup(idx, tiers, ns, [k]) == (1, [Tier.STORAGE]), "opened: there again"


@pytest.mark.parametrize("err", [errno.ENOENT, errno.ESTALE])
def test_a_file_gone_under_a_promote_is_forgotten_and_counted_not_an_io_error(files, err, caplog):
    idx, ns, tier, links, g = files
    (k,) = keys_of("k")
    tier.catalog.add(ns, k)
    links.status = lambda job: -err
    caplog.set_level("INFO", logger="hpkv.storage")
    assert tier.promote(FakeClient(), 1, ns, [k], timeout=1.0) is None
    (answer,) = tier.poll()
    assert (answer.rows == -1).all() and k not in tier.catalog
    assert g[G.STORAGE_GONE] == 1 and g[G.STORAGE_IO_ERRORS] == 0
    assert [r.levelname for r in caplog.records if "removed" in r.getMessage()] == ["INFO"]
    assert not [r for r in caplog.records if r.levelno >= 40]


def test_a_stat_that_gets_estale_means_the_files_are_gone(files, monkeypatch):
    from hpkv.engine.storage import stat as stat_mod

    idx, ns, tier, links, g = files
    tiers = TierList([tier])
    (k,) = keys_of("k")
    tier.catalog.add(ns, k)

    def stale(tree, ns, key, by_open=False):
        raise OSError(errno.ESTALE, "Stale file handle")

    monkeypatch.setattr(stat_mod, "stat_block", stale)
    monkeypatch.setattr(catalog_mod, "VERIFY_TTL_S", 0.0)
    assert lookup(idx, tiers, ns, [k]) == (0, [])
    assert k not in tier.catalog and g[G.STORAGE_GONE] == 1 and g[G.STORAGE_IO_ERRORS] == 0


def test_while_degraded_spills_beyond_a_bound_are_dropped_and_counted(files):
    idx, ns, tier, links, g = files
    keys = keys_of("0", "1", "2")
    tier._spill_limit = SLOT  # one block's spill may be queued
    tier.health.update("a hung mount")
    ready = put(idx, ns, keys)
    links.dispatch = lambda ns_raw, spills=True: None  # a hung mount: nothing leaves the queue
    tier.spill(ready)
    assert g[G.STORAGE_SPILLS_DROPPED] == 2 and tier.pending_spills() == 1
    assert all(idx.in_dram(ns, k) for k in keys), "the DRAM copies stay"
    assert not idx.in_io(keys[1]) and not idx.in_io(keys[2]), "evictable without files"


def test_a_healthy_tier_queues_a_burst_of_spills_of_any_size(files):
    idx, ns, tier, links, g = files
    tier._spill_limit = SLOT
    links.dispatch = lambda ns_raw, spills=True: None
    tier.spill(put(idx, ns, keys_of("0", "1", "2")))
    assert g[G.STORAGE_SPILLS_DROPPED] == 0 and tier.pending_spills() == 3


def test_while_degraded_storage_blocks_are_misses_and_promotes_answer_at_once(files):
    idx, ns, tier, links, g = files
    tiers = TierList([tier])
    a, b = keys_of("a", "b")
    put(idx, ns, [a])
    tier.catalog.add(ns, b)
    tier.catalog.verified(b, time.monotonic())
    assert lookup(idx, tiers, ns, [a, b]) == (2, [Tier.DRAM, Tier.STORAGE])
    tier.health.update("a hung mount")
    assert lookup(idx, tiers, ns, [a, b]) == (1, [Tier.DRAM]), "no load promised that would wait on the mount"
    rows = tier.promote(FakeClient(), 1, ns, [a, b], timeout=5.0)
    assert rows is not None and rows[0, 0] >= 0 and rows[1, 0] == -1, "answered at once"
    assert g[G.STORAGE_DEGRADED_MISSES] == 2 and b in tier.catalog, "kept for when it recovers"
    tier.health.update(None)
    assert lookup(idx, tiers, ns, [a, b]) == (2, [Tier.DRAM, Tier.STORAGE])


def test_a_stat_thread_stuck_in_the_file_system_does_not_hold_up_a_stop(tmp_path):
    from hpkv.engine.storage.stat import StatPool

    stuck = threading.Event()
    pool = StatPool(tree=None, doorbell=None, threads=2, max_batches=2)  # type: ignore[arg-type]
    try:
        assert pool.submit(lambda: stuck.wait(30))
        assert pool.submit(lambda: stuck.wait(30))
        assert not pool.submit(lambda: None) and pool.saturated, "bounded: no third task queued"
        t0 = time.monotonic()
        pool.shutdown()
        assert time.monotonic() - t0 < 3.0
    finally:
        stuck.set()

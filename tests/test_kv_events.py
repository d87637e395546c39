"""KV events for cache-aware routers, below vLLM's publisher: the server's per-namespace event
log (ring, index and catalog hooks, the ``events`` control call on a real server), and the
connector's translation of its records into vLLM events with real vLLM requests and block
hashes. The end-to-end test with a real vLLM and a ZMQ subscriber is test_vllm_kv_events.py."""

from __future__ import annotations

import pytest
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
from vllm.v1.request import Request

from hpkv.connectors.vllm.events import SERVER_CHANGED, EventFeed, EventTranslator
from hpkv.connectors.vllm.layout import Layout
from hpkv.connectors.vllm.scheduler import SchedulerSide
from hpkv.engine import events as ev
from hpkv.engine.index import Index, Namespace
from hpkv.engine.storage.catalog import FileCatalog
from hpkv.io_workers import kvfile
from hpkv.protocol.errors import NamespaceNotAttached
from hpkv.protocol.events import REMOVED
from hpkv.protocol.keys import block_keys, namespace_fingerprint
from hpkv.protocol.wire import Tier
from hpkv.testing.memory_store import MemoryKvStore
from hpkv.testing.server import ServerProcess, client_of, private_env, wait_for

DRAM, STORAGE = int(Tier.DRAM), int(Tier.STORAGE)
BS = 4
FP = namespace_fingerprint({"model": "events-test"})


# ============================================================================ the server's log
def keys_of(*names: str) -> list[bytes]:
    return block_keys(FP, [n.encode() for n in names])


def test_the_log_returns_records_in_order_from_any_seq_and_says_where_to_go_on():
    log = ev.NsEventLog()
    a, b, c = keys_of("a", "b", "c")
    log.add(a, ev.STORED_DRAM)
    log.add_many([b, c], ev.REMOVED_STORAGE)
    records, seq, lost = log.read(0)
    assert seq == 3 and lost == 0
    assert ev_decode(records) == [(a, DRAM), (b, STORAGE | REMOVED), (c, STORAGE | REMOVED)]
    assert ev_decode(log.read(1, limit=1)[0]) == [(b, STORAGE | REMOVED)]
    assert log.read(-1) == (b"", 3, 0), "a new reader starts at the head"
    assert log.read(3) == (b"", 3, 0)


def test_a_reader_that_fell_behind_the_ring_is_told_how_many_records_it_lost():
    log = ev.NsEventLog()
    keys = keys_of(*(str(i) for i in range(ev.CAPACITY + 10)))
    for k in keys:
        log.add(k, ev.STORED_DRAM)
    records, seq, lost = log.read(0, limit=20)
    assert lost == 10 and seq == 30
    assert [k for k, _ in ev_decode(records)] == keys[10:30]
    records, seq, _ = log.read(ev.CAPACITY, limit=20)  # across the ring's wrap
    assert [k for k, _ in ev_decode(records)] == keys[
        ev.CAPACITY : ev.CAPACITY + 10
    ] and seq == ev.CAPACITY + 10


def ev_decode(records: bytes) -> list[tuple[bytes, int]]:
    from hpkv.protocol.events import decode

    return decode(records)


def index_with_events(slots: int = 2, storage: bool = False) -> tuple[Index, Namespace]:
    idx = Index(slots * 65536, storage_enabled=storage)
    ns = Namespace(0, "m", FP, 1, 65536)
    ns.events = ev.NsEventLog()
    idx.add_namespace(ns)
    return idx, ns


def logged(ns: Namespace, since: int = 0) -> list[tuple[bytes, int]]:
    assert ns.events is not None
    return ev_decode(ns.events.read(since)[0])


def test_the_index_logs_commits_evictions_and_clears_of_a_watched_namespace():
    idx, ns = index_with_events(slots=2)
    a, b, c = keys_of("a", "b", "c")
    idx.reserve(0, [a, b])
    assert logged(ns) == [], "a reservation is no block yet"
    idx.commit(0, [a, b], 0)
    assert logged(ns) == [(a, DRAM), (b, DRAM)]
    idx.reserve(0, [c])  # the pool holds two: the least recently used goes
    idx.commit(0, [c], 0)
    assert logged(ns, 2) == [(a, DRAM | REMOVED), (c, DRAM)]
    idx.clear_namespace(0)
    assert sorted(logged(ns, 4)) == sorted([(b, DRAM | REMOVED), (c, DRAM | REMOVED)])


def test_an_unwatched_namespace_logs_nothing():
    idx = Index(4 * 65536)
    ns = Namespace(0, "m", FP, 1, 65536)
    idx.add_namespace(ns)
    (a,) = keys_of("a")
    idx.reserve(0, [a])
    idx.commit(0, [a], 0)
    assert ns.events is None


def test_the_catalog_logs_files_written_and_gone_and_a_promote_logs_dram():
    idx, ns = index_with_events(slots=2, storage=True)
    files = FileCatalog(idx)
    a, b = keys_of("a", "b")
    idx.reserve(0, [a])
    idx.commit(0, [a], 0)
    files.add(ns, a)  # its spill is done
    files.add_found(ns, [b], skip=lambda k: False)  # found by a scan: nobody here knows its hash
    assert logged(ns) == [(a, DRAM), (a, STORAGE)]
    idx.clear_namespace(0)
    blk = idx.begin_promote(ns, a)
    assert blk is not None
    idx.finish_promote(a, ok=True)
    files.forget(a)  # deleted for capacity, corrupt or missing
    assert logged(ns, 2) == [(a, DRAM | REMOVED), (a, DRAM), (a, STORAGE | REMOVED)]


# ============================================================================ a real server
def test_a_real_server_answers_its_namespace_events_to_its_clients_only(tmp_path):
    shard = 65536
    cap = 2 * kvfile.file_size(shard)
    env = private_env(storage=str(tmp_path), HPKV_KV_STORAGE_SIZE=str(cap))
    with ServerProcess(env) as srv, client_of(srv) as c, client_of(srv) as other:
        ns = c.attach_namespace(FP, 1, shard, name="events-test").ns_id
        fp2 = namespace_fingerprint({"model": "events-test", "other": 1})
        ns2 = other.attach_namespace(fp2, 1, shard, name="other").ns_id
        start = c.events(ns, -1)
        assert start.records == [] and start.lost == 0
        with pytest.raises(NamespaceNotAttached):
            other.events(ns, -1)
        other.events(ns2, -1)
        keys = keys_of("a", "b", "c")
        for k in keys:  # one at a time: a known spill order, then the oldest file goes for capacity
            c.reserve(ns, [k])
            c.commit(ns, [k])
            wait_for(lambda: c.stats()["storage"]["spills"] >= keys.index(k) + 1, 30, "a spill")  # noqa: B023
        wait_for(lambda: c.stats()["storage"]["evicted_files"] >= 1, 30, "a storage eviction")
        got = c.events(ns, start.seq)
        assert got.records[:2] == [(keys[0], DRAM), (keys[0], STORAGE)]
        assert (keys[0], STORAGE | REMOVED) in got.records
        assert {(k, STORAGE) for k in keys} <= set(got.records)
        c.clear(ns)
        cleared = c.events(ns, got.seq)
        assert {k for k, code in cleared.records if code == DRAM | REMOVED} == set(keys)
        assert other.events(ns2, 0).records == [], "another namespace's engine hears nothing of these"


# ============================================================================ translation
@pytest.fixture(scope="module")
def hasher():
    init_none_hash(sha256)
    return get_request_block_hasher(BS, sha256)


def ext(h):
    """A hash (or hashes) as vLLM's own events carry them (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)."""
    return [maybe_convert_block_hash(x) for x in h] if isinstance(h, list) else maybe_convert_block_hash(h)


def vllm_request(hasher, rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)


def test_stored_blocks_of_one_chain_are_one_event_with_vllms_hashes_tokens_and_parent(hasher):
    r = vllm_request(hasher, "r", list(range(100, 113)))  # 3 full blocks of 4
    t = EventTranslator(BS)
    keys = keys_of("0", "1", "2")
    t.remember(r, keys, [0, 1, 2], [0, 0, 0])
    (stored,) = t.translate([(k, DRAM) for k in keys[1:]])
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == ext(r.block_hashes[1:3])
    assert stored.parent_block_hash == ext(r.block_hashes[0])
    assert stored.token_ids == list(range(104, 112)) and stored.block_size == BS
    assert stored.medium == "CPU" and stored.group_idx == 0
    assert stored.extra_keys == [None, None]
    (first,) = t.translate([(keys[0], STORAGE)])
    assert first.parent_block_hash is None and first.medium == "STORAGE"


def test_removals_are_published_once_per_tier_and_unknown_keys_are_skipped(hasher):
    r = vllm_request(hasher, "r", list(range(9)))
    t = EventTranslator(BS)
    keys = keys_of("0", "1")
    t.remember(r, keys, [0, 1], [0, 0])
    t.translate([(k, DRAM) for k in keys] + [(keys[0], STORAGE)])
    out = t.translate(
        [(k, DRAM | REMOVED) for k in keys]
        + [(keys[1], DRAM | REMOVED)]  # twice: nothing new
        + [(keys[1], STORAGE | REMOVED)]  # never announced on storage
        + [(keys_of("stranger")[0], DRAM)]
    )
    assert len(out) == 1 and isinstance(out[0], BlockRemoved)
    assert out[0].block_hashes == ext(r.block_hashes[:2]) and out[0].medium == "CPU"
    assert len(t) == 1, "a block in no tier is forgotten; one still on storage is kept"
    assert t.unknown == 3, "the forgotten block's later records, and the stranger's"


def test_the_bound_forgets_the_oldest_blocks(hasher):
    r = vllm_request(hasher, "r", list(range(17)))
    t = EventTranslator(BS, max_blocks=2)
    keys = keys_of("0", "1", "2", "3")
    t.remember(r, keys, [0, 1, 2, 3], [0] * 4)
    assert len(t) == 2 and t.forgotten == 2
    assert t.translate([(keys[0], DRAM)]) == []


def test_a_reset_clears_all_then_announces_again_what_storage_still_holds(hasher):
    r = vllm_request(hasher, "r", list(range(13)))
    t = EventTranslator(BS)
    keys = keys_of("0", "1", "2")
    t.remember(r, keys, [0, 1, 2], [0] * 3)
    t.translate([(k, DRAM) for k in keys] + [(k, STORAGE) for k in keys[:2]])
    out = t.cleared()
    assert isinstance(out[0], AllBlocksCleared)
    (again,) = out[1:]
    assert again.medium == "STORAGE" and again.block_hashes == ext(r.block_hashes[:2])
    assert t.translate([(k, DRAM | REMOVED) for k in keys]) == [], "the clear's own removals say nothing new"


def test_a_new_server_means_every_block_announced_in_dram_is_gone(hasher):
    r = vllm_request(hasher, "r", list(range(9)))
    t = EventTranslator(BS)
    keys = keys_of("0", "1")
    t.remember(r, keys, [0, 1], [0, 0])
    t.translate([(keys[0], DRAM), (keys[1], STORAGE)])
    (gone,) = t.translate([(SERVER_CHANGED, 0)])
    assert (
        isinstance(gone, BlockRemoved)
        and gone.medium == "CPU"
        and gone.block_hashes == ext(r.block_hashes[:1])
    )


# ============================================================================ the scheduler side
NS = 3
LAYOUT = Layout(fingerprint="cd" * 16, name="unit", world_size=1, block_size=BS, num_layers=2, page_bytes=64)


class Sched:
    """The scheduler side on an in-memory store, with events on and vLLM's block table faked."""

    def __init__(self, store: MemoryKvStore):
        self.store = store
        self.side = SchedulerSide(LAYOUT, 0, lambda: (store, NS), self.block_ids)
        self.side.hpkv.connect_now(timeout=5)
        self.side.enable_kv_events(interval_s=0.0)
        self.tables: dict[str, list[int]] = {}

    def block_ids(self, rid: str):
        return (self.tables[rid],) if rid in self.tables else None

    def run(self, r: Request) -> None:
        """Admit, schedule the whole prompt, save what the step says, as the workers would."""
        from types import SimpleNamespace

        self.side.on_new_request(r)
        n, _ = self.side.get_num_new_matched_tokens(r, 0)
        self.tables[r.request_id] = list(range(100 * len(self.tables), 100 * len(self.tables) + 10))
        self.side.update_state_after_alloc(r, (self.tables[r.request_id],), n)
        out = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, num_computed_tokens=n)],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
            num_scheduled_tokens={r.request_id: r.num_tokens - n},
            preempted_req_ids=set(),
        )
        for op in self.side.build_connector_meta(out).saves:
            self.store.commit(NS, op.keys)
        self.side.request_finished(r.request_id)

    def events(self, timeout: float = 5.0) -> list:
        """take_events until the feed thread delivered something (it fetches after a take)."""
        got: list = []
        wait_for(lambda: got.extend(self.side.take_events()) or got, timeout, "KV events")
        return got


def test_the_scheduler_publishes_its_saves_evictions_and_reset(hasher):
    store = MemoryKvStore()
    s = Sched(store)
    try:
        r = vllm_request(hasher, "a", list(range(200, 213)))
        s.run(r)
        stored = s.events()
        assert [(e.medium, e.block_hashes) for e in stored] == [
            ("CPU", ext(r.block_hashes[:1])),
            ("STORAGE", ext(r.block_hashes[:1])),
            ("CPU", ext(r.block_hashes[1:2])),
            ("STORAGE", ext(r.block_hashes[1:2])),
            ("CPU", ext(r.block_hashes[2:3])),
            ("STORAGE", ext(r.block_hashes[2:3])),
        ]
        keys = block_keys(LAYOUT.fingerprint, r.block_hashes)
        store.evict(NS, keys[2], Tier.STORAGE)
        (removed,) = s.events()
        assert removed.medium == "STORAGE" and removed.block_hashes == ext(r.block_hashes[2:3])
        assert s.side.reset_cache()
        out = s.events()
        assert isinstance(out[0], AllBlocksCleared)
        assert [(e.medium, e.block_hashes) for e in out[1:]] == [("STORAGE", ext(r.block_hashes[:2]))]
    finally:
        s.side.close()


def test_a_hit_announces_the_blocks_this_engine_did_not_save(hasher):
    store = MemoryKvStore()
    r = vllm_request(hasher, "a", list(range(300, 313)))
    keys = block_keys(LAYOUT.fingerprint, r.block_hashes)
    store.reserve(NS, keys)
    store.commit(NS, keys)  # another engine saved them (or the files outlived a restart)
    store.clear(NS)  # on storage only now
    s = Sched(store)
    try:
        s.run(vllm_request(hasher, "b", list(range(300, 313))))
        out = s.side.take_events()
        assert [(e.medium, e.block_hashes) for e in out] == [("STORAGE", ext(r.block_hashes[:3]))]
    finally:
        s.side.close()


def test_events_stop_when_hpkv_refuses_them_and_the_engine_goes_on(hasher):
    store = MemoryKvStore()
    store.fail.add("events")
    s = Sched(store)
    try:
        s.run(vllm_request(hasher, "a", list(range(9))))
        assert s.side.take_events() == []
        assert store.ready(NS) == 2, "saves go on"
    finally:
        s.side.close()


def test_the_feed_fetches_only_while_vllm_takes_events():
    store = MemoryKvStore()
    calls = []
    feed = EventFeed(lambda: store, lambda: NS, interval_s=0.0)
    store_events = store.events

    def counting(*a, **kw):
        calls.append(a)
        return store_events(*a, **kw)

    store.events = counting  # type: ignore[method-assign]
    feed.start()
    try:
        import time

        time.sleep(0.2)
        assert len(calls) == 1, "started watching, then idle until vLLM takes events"
        feed.take()
        wait_for(lambda: len(calls) >= 2, 5, "a fetch after take")
    finally:
        feed.close()


def test_a_request_events_cannot_describe_stops_events_not_the_engine(hasher):
    store = MemoryKvStore()
    s = Sched(store)
    try:

        class Odd:  # a request without the token ids events need
            def __init__(self, r: Request):
                self.request_id, self.num_tokens, self.num_computed_tokens = r.request_id, r.num_tokens, 0
                self.block_hashes, self.kv_transfer_params = r.block_hashes, None

        s.run(Odd(vllm_request(hasher, "a", list(range(9)))))  # type: ignore[arg-type]
        assert store.ready(NS) == 2, "saves go on"
        assert s.side.events is None and s.side.take_events() == []
    finally:
        s.side.close()

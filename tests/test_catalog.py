"""The storage catalog behaves like the list it was (an LRU of key → namespace with totals,
verify times and keys being deleted) while it keeps no Python object per entry."""

from __future__ import annotations

import os
from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from hpkv.engine.index import Index, Namespace
from hpkv.engine.storage.catalog import SLOT_BYTES, VERIFY_TTL_S, FileCatalog
from hpkv.io_workers import kvfile
from hpkv.protocol.keys import namespace_fingerprint
from hpkv.protocol.stats import NsCounter
from hpkv.protocol.wire import Tier

SHARD = 4096
SIZE = kvfile.file_size(SHARD)


def make(world: int = 1) -> tuple[Index, FileCatalog, Namespace, Namespace]:
    idx = Index(1 << 24, storage_enabled=True)
    a = Namespace(1, "a", namespace_fingerprint({"m": "a"}), world, SHARD)
    b = Namespace(2, "b", namespace_fingerprint({"m": "b"}), 1, SHARD)
    idx.add_namespace(a)
    idx.add_namespace(b)
    return idx, FileCatalog(idx), a, b


def keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def test_scanned_keys_are_colder_than_used_ones_and_the_latest_scanned_is_coldest():
    _, cat, ns, _ = make()
    used, found = keys(3), keys(3)
    for k in used:
        cat.add(ns, k)
    for k in found:
        cat.add(ns, k, recent=False)
    cat.touch(used[0])
    assert cat.keys() == found[::-1] + used[1:] + used[:1]


def test_a_scans_batch_enters_like_one_cold_add_after_another_and_skips_what_is_known():
    idx, cat, ns, other = make()
    used, batch = keys(2), keys(5)
    for k in used:
        cat.add(ns, k)
    cat.add(other, batch[1])  # another namespace's: known, left alone
    skipped = batch[3]
    assert cat.add_found(ns, batch, skip=lambda k: k == skipped) == 3
    fresh = [batch[0], batch[2], batch[4]]
    assert cat.keys() == fresh[::-1] + [used[0], used[1], batch[1]]
    assert cat.bytes == 6 * SIZE and ns.counters[NsCounter.BLOCKS_STORAGE] == 5
    assert idx.lookup(ns.ns_id, fresh) == (3, [Tier.STORAGE] * 3) and cat.unknown(skipped)
    assert cat.owner(batch[1]) is other


def test_a_scans_batch_with_a_key_held_in_dram_takes_the_index_checks_key_by_key():
    idx, cat, ns, other = make()
    mine, theirs, plain = keys(3)
    idx.reserve(ns.ns_id, [mine])
    idx.commit(ns.ns_id, [mine], 0)
    idx.reserve(other.ns_id, [theirs])
    assert cat.add_found(ns, [mine, theirs, plain], skip=lambda k: False) == 2
    assert cat.owner(mine) is ns and cat.owner(theirs) is None and cat.owner(plain) is ns
    assert cat.keys() == [plain, mine]
    assert idx.lookup(ns.ns_id, [mine, plain]) == (2, [Tier.DRAM, Tier.STORAGE])


def test_with_the_store_first_a_scans_batch_enters_in_one_native_call_and_the_stores_hits_stay(monkeypatch):
    """HPKV_TIER_ORDER=remote,files: the file catalog's batches (a scan, a journal) are not taken
    key by key because the files are the second tier: the keys the store's catalog has stay
    remote hits, the others become file hits, in one native call; while the store's catalog
    retires entries (a retired entry has no owner), key by key as before."""
    idx = Index(1 << 24, storage_enabled=True, below_order=[Tier.REMOTE, Tier.STORAGE])
    ns = Namespace(1, "a", namespace_fingerprint({"m": "a"}), 1, SHARD)
    idx.add_namespace(ns)
    remote, files = FileCatalog(idx, Tier.REMOTE), FileCatalog(idx)
    batch = keys(6)
    remote.add(ns, batch[1], recent=False)
    remote.add(ns, batch[4], recent=False)
    one_by_one: list[bytes] = []
    present_below = idx._present_below
    monkeypatch.setattr(idx, "_present_below", lambda k: (one_by_one.append(k), present_below(k)))
    assert files.add_found(ns, batch[:5], skip=lambda k: False) == 5
    assert not one_by_one, "no key taken one by one"
    want = [Tier.STORAGE, Tier.REMOTE, Tier.STORAGE, Tier.STORAGE, Tier.REMOTE]
    assert idx.lookup(ns.ns_id, batch[:5]) == (5, want)
    remote.retire_all(0.0)  # (every entry stale: no owner)
    assert files.add_found(ns, batch[5:], skip=lambda k: False) == 1
    assert one_by_one == batch[5:] and idx.lookup(ns.ns_id, batch[5:]) == (1, [Tier.STORAGE])


def test_victims_are_the_least_recent_and_one_in_use_stays_least_recent_for_the_next_round():
    _, cat, ns, _ = make()
    k = keys(6)
    for key in k:
        cat.add(ns, key)
    victims = cat.take_victims(4 * SIZE, in_use=lambda key: key == k[0])
    assert [v for _, v in victims] == [k[1], k[2]] and cat.bytes == 4 * SIZE
    assert cat.keys()[0] == k[0]
    victims = cat.take_victims(3 * SIZE, in_use=lambda key: False)
    assert [v for _, v in victims] == [k[0]], "no longer in use: it goes first"


def test_a_candidate_used_between_rounds_is_not_evicted_and_a_scanned_key_goes_first():
    _, cat, ns, _ = make()
    k = keys(5)
    for key in k:
        cat.add(ns, key)
    assert [v for _, v in cat.take_victims(4 * SIZE, in_use=lambda key: False)] == [k[0]]
    cat.touch(k[1])  # was the next candidate
    scanned = keys(1)[0]
    cat.add(ns, scanned, recent=False)
    victims = cat.take_victims(3 * SIZE, in_use=lambda key: False)
    assert [v for _, v in victims] == [scanned, k[2]]
    assert cat.keys() == [k[3], k[4], k[1]]


def test_everything_in_use_ends_the_eviction_over_capacity():
    _, cat, ns, _ = make()
    for key in keys(3):
        cat.add(ns, key)
    assert cat.take_victims(0, in_use=lambda key: True) == []
    assert len(cat) == 3 and cat.bytes == 3 * SIZE


def test_a_victim_is_known_until_deleted_and_a_new_add_meanwhile_survives_the_deletion():
    idx, cat, ns, _ = make()
    a, b = keys(2)
    cat.add(ns, a)
    cat.add(ns, b)
    cat.take_victims(0, in_use=lambda key: False)
    assert len(cat) == 0 and cat.bytes == 0 and not cat.unknown(a) and a not in cat
    assert idx.lookup(ns.ns_id, [a]) == (0, []), "no hit while its files go"
    cat.add(ns, b)  # written again while the unlink runs
    cat.deleted([a, b])
    assert cat.unknown(a) and b in cat and cat.owner(b) is ns and len(cat) == 1


def test_verify_times_expire_after_the_ttl_and_a_forget_clears_them():
    _, cat, ns, _ = make()
    (k,) = keys(1)
    cat.add(ns, k)
    now = 1000.0
    assert cat.needs_verify(ns, k, now)
    cat.verified(k, now)
    assert not cat.needs_verify(ns, k, now + VERIFY_TTL_S - 0.01)
    assert cat.needs_verify(ns, k, now + VERIFY_TTL_S)
    cat.verified(k, now)
    cat.forget(k)
    cat.add(ns, k)
    assert cat.needs_verify(ns, k, now + 0.5), "files found again are verified again"


def test_to_verify_names_the_keys_needs_verify_names():
    idx, cat, ns, other = make()
    k = keys(8)
    for key in k[:6]:
        cat.add(ns, key)
    cat.add(other, k[6])
    idx.reserve(ns.ns_id, [k[5]])
    idx.commit(ns.ns_id, [k[5]], 0)  # held in DRAM: no stat
    cat.verified(k[1], 100.0)
    cat.verified(k[2], 99.0)
    for now in (100.5, 101.5, 102.0, 103.0):
        want = [i for i, key in enumerate(k) if cat.needs_verify(ns, key, now)]
        assert cat.to_verify(ns, k, now) == want
    assert cat.to_verify(ns, k, 100.5) == [0, 3, 4]
    assert cat.to_verify(other, k, 100.5) == [6]


def test_a_key_held_in_dram_needs_no_verify_and_another_namespace_never_does():
    idx, cat, ns, other = make()
    k, held = keys(2)
    cat.add(ns, k)
    assert not cat.needs_verify(other, k, 5.0)
    idx.reserve(ns.ns_id, [held])
    idx.commit(ns.ns_id, [held], 0)
    cat.add(ns, held)
    assert not cat.needs_verify(ns, held, 5.0)


def test_forget_and_detach_keep_totals_counters_and_lookups_right():
    idx, cat, a, b = make(world=2)
    ka, kb = keys(3), keys(2)
    for k in ka:
        cat.add(a, k, recent=False)
    for k in kb:
        cat.add(b, k)
    assert cat.files == 2 * 3 + 2 and cat.bytes == (2 * 3 + 2) * SIZE
    assert idx.lookup(a.ns_id, ka) == (3, [Tier.STORAGE] * 3)
    assert cat.forget(ka[0]) is a and cat.forget(ka[0]) is None
    assert a.counters[NsCounter.BLOCKS_STORAGE] == 2 and idx.lookup(a.ns_id, ka[:1]) == (0, [])
    cat.detach(a)
    assert len(cat) == 2 and cat.files == 2 and cat.keys() == kb
    assert idx.lookup(a.ns_id, ka[1:]) == (0, []) and idx.lookup(b.ns_id, kb) == (2, [Tier.STORAGE] * 2)
    assert cat.owner(ka[1]) is None and cat.unknown(ka[1])


def test_a_namespace_id_taken_again_does_not_inherit_the_old_entries():
    idx, cat, a, _ = make()
    old = keys(2)
    for k in old:
        cat.add(a, k)
    again = Namespace(a.ns_id, "a2", namespace_fingerprint({"m": "a2"}), 1, SHARD)
    idx.add_namespace(again)
    new = keys(1)[0]
    cat.add(again, new)
    assert cat.owner(new) is again and all(cat.owner(k) is None for k in old) and len(cat) == 1


def test_an_entry_costs_a_table_slot_and_no_python_object():
    _, cat, ns, _ = make()
    n = 50_000
    for k in keys(n):
        cat.add(ns, k, recent=False)
    per_entry = cat.memory_bytes() / n
    assert per_entry <= SLOT_BYTES / 0.35, per_entry  # the table grows at 70 % load, doubling
    assert len(cat) == n and len(cat.keys()) == n


class Reference:
    """The catalog as it was: an OrderedDict, a verify dict and a deleting set."""

    def __init__(self) -> None:
        self.lru: OrderedDict[bytes, Namespace] = OrderedDict()
        self.deleting: set[bytes] = set()
        self.bytes = 0

    def add(self, ns: Namespace, key: bytes, recent: bool) -> bool:
        if key in self.lru:
            if recent and self.lru[key] is ns:
                self.lru.move_to_end(key)
            return False
        self.lru[key] = ns
        if not recent:
            self.lru.move_to_end(key, last=False)
        self.bytes += SIZE
        return True

    def forget(self, key: bytes) -> Namespace | None:
        ns = self.lru.pop(key, None)
        if ns is not None:
            self.bytes -= SIZE
        return ns

    def take_victims(self, capacity: int, in_use) -> list[bytes]:
        out, skipped = [], []
        while self.bytes > capacity and self.lru:
            key, ns = next(iter(self.lru.items()))
            if in_use(key):
                self.lru.popitem(last=False)
                skipped.append((key, ns))
                continue
            self.forget(key)
            self.deleting.add(key)
            out.append(key)
        for key, ns in reversed(skipped):
            self.lru[key] = ns
            self.lru.move_to_end(key, last=False)
        return out


POOL = [os.urandom(16) for _ in range(12)]
op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 11), st.booleans()),
    st.tuples(st.just("touch"), st.integers(0, 11), st.just(False)),
    st.tuples(st.just("forget"), st.integers(0, 11), st.just(False)),
    st.tuples(st.just("evict"), st.integers(0, 8), st.integers(0, 3)),
    st.tuples(st.just("deleted"), st.integers(0, 11), st.just(False)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=60))
def test_matches_the_ordered_dict_it_replaces(ops):
    _, cat, ns, _ = make()
    ref = Reference()
    for name, i, arg in ops:
        if name == "add":
            assert cat.add(ns, POOL[i], recent=arg) == ref.add(ns, POOL[i], recent=arg)
        elif name == "touch":
            cat.touch(POOL[i])
            if POOL[i] in ref.lru:
                ref.lru.move_to_end(POOL[i])
        elif name == "forget":
            assert cat.forget(POOL[i]) is ref.forget(POOL[i])
        elif name == "evict":
            in_use = set(POOL[arg::4]).__contains__
            got = cat.take_victims(i * SIZE, in_use=in_use)
            assert [k for _, k in got] == ref.take_victims(i * SIZE, in_use=in_use)
        else:
            cat.deleted([POOL[i]])
            ref.deleting.discard(POOL[i])
        assert cat.keys() == list(ref.lru) and cat.bytes == ref.bytes and len(cat) == len(ref.lru)
        assert all(cat.knows(k) == (k in ref.lru or k in ref.deleting) for k in POOL)

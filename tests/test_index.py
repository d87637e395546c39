"""The server's index and pool allocator, in process."""

from __future__ import annotations

import random

import pytest

from hpkv.engine.allocator import PoolAllocator
from hpkv.engine.index import Index, Namespace
from hpkv.engine.storage.catalog import FileCatalog
from hpkv.protocol.keys import block_key, block_keys, namespace_fingerprint
from hpkv.protocol.stats import NsCounter
from hpkv.protocol.wire import Tier

FP = namespace_fingerprint({"model": "m"})
SLOT = 64 * 1024


def make(capacity_slots: int = 4, world: int = 1, storage: bool = False) -> tuple[Index, Namespace]:
    idx = Index(capacity_slots * SLOT * world, storage_enabled=storage)
    ns = Namespace(0, "m", FP, world, SLOT)
    idx.add_namespace(ns)
    return idx, ns


def put(idx: Index, keys, world: int = 1):
    slots = idx.reserve(0, keys)
    for r in range(world):
        idx.commit(0, keys, r)
    return slots


def test_allocator_random_alloc_free_never_overlaps_and_coalesces():
    rng = random.Random(7)
    a = PoolAllocator(1 << 20)
    live: dict[int, int] = {}
    for _ in range(20000):
        if live and rng.random() < 0.5:
            off = rng.choice(list(live))
            a.free(off, live.pop(off))
        else:
            size = rng.choice([4096, 8192, 12288])
            off = a.alloc(size)
            if off is None:
                continue
            assert off % size == 0, "slots are naturally aligned"
            assert all(off + size <= o or o + s <= off for o, s in live.items())
            live[off] = size
        assert a.used == sum(live.values())
    for off, size in list(live.items()):
        a.free(off, size)
    assert a.free_bytes == 1 << 20 and a.alloc(1 << 20) == 0


def test_lookup_counts_leading_present_keys_only():
    idx, ns = make(8)
    keys = block_keys(FP, [b"a", b"b", b"c", b"d"])
    put(idx, keys[:2])
    put(idx, keys[3:])
    assert idx.lookup(0, keys) == (2, [Tier.DRAM, Tier.DRAM])
    assert idx.lookup(0, keys[2:]) == (0, [])


def test_reserved_block_is_not_a_hit_until_committed():
    idx, _ = make()
    k = [block_key(FP, b"x")]
    idx.reserve(0, k)
    assert idx.lookup(0, k) == (0, [])
    assert idx.reserve(0, k)[0, 0] == -1, "a block being written needs no second write"
    idx.commit(0, k, 0)
    assert idx.lookup(0, k) == (1, [Tier.DRAM])


def test_two_rank_block_invisible_until_both_ranks_commit():
    idx, ns = make(world=2)
    k = [block_key(FP, b"x")]
    slots = idx.reserve(0, k)
    assert slots.shape == (1, 2) and slots[0, 0] != slots[0, 1]
    idx.commit(0, k, rank=1)
    assert idx.lookup(0, k)[0] == 0
    idx.commit(0, k, rank=1)  # the same rank twice does not count twice
    assert idx.lookup(0, k)[0] == 0
    idx.commit(0, k, rank=0)
    assert idx.lookup(0, k)[0] == 1
    assert ns.counters[NsCounter.BLOCKS_DRAM] == 1


def test_eviction_takes_least_recently_used_first():
    idx, ns = make(capacity_slots=3)
    a, b, c, d = block_keys(FP, [b"a", b"b", b"c", b"d"])
    put(idx, [a, b, c])
    idx.pin(ns, [a])
    idx.unpin([a])  # a becomes most recently used
    put(idx, [d])  # evicts b, the least recently used
    assert idx.lookup(0, [b])[0] == 0
    assert [idx.lookup(0, [k])[0] for k in (a, c, d)] == [1, 1, 1]
    assert ns.counters[NsCounter.EVICTIONS] == 1


def test_lookup_has_no_side_effect_on_recency():
    idx, _ = make(capacity_slots=2)
    a, b, c = block_keys(FP, [b"a", b"b", b"c"])
    put(idx, [a, b])
    for _ in range(5):
        idx.lookup(0, [a])
    put(idx, [c])
    assert idx.lookup(0, [a])[0] == 0, "a lookup is not a use: a is still the oldest"


def test_pinned_blocks_are_never_evicted():
    idx, ns = make(capacity_slots=2)
    a, b, c = block_keys(FP, [b"a", b"b", b"c"])
    put(idx, [a, b])
    idx.pin(ns, [a, b])
    assert idx.reserve(0, [c])[0, 0] == -2, "pool full of pinned blocks: reserve fails, nothing evicted"
    assert ns.counters[NsCounter.RESERVE_FAILED] == 1
    assert idx.lookup(0, [a, b])[0] == 2
    idx.unpin([b])
    assert idx.reserve(0, [c])[0, 0] >= 0
    assert idx.lookup(0, [a])[0] == 1 and idx.lookup(0, [b])[0] == 0


def test_unspilled_block_is_not_dropped_when_storage_is_on():
    idx, ns = make(capacity_slots=1, storage=True)
    files = FileCatalog(idx)
    a, b = block_keys(FP, [b"a", b"b"])
    put(idx, [a])
    assert idx.reserve(0, [b])[0, 0] == -2
    files.add(ns, a)
    assert idx.reserve(0, [b])[0, 0] >= 0
    assert idx.lookup(0, [a]) == (1, [Tier.STORAGE]), "evicted from DRAM, still on storage"
    assert a not in idx.blocks and files.owner(a) is ns, "files only: the catalog's, no block of the index"


def test_two_namespaces_share_one_pool():
    idx = Index(6 * SLOT)
    small = Namespace(0, "small", namespace_fingerprint({"m": 1}), 1, SLOT)
    big = Namespace(1, "big", namespace_fingerprint({"m": 2}), 1, 2 * SLOT)
    idx.add_namespace(small)
    idx.add_namespace(big)
    ks = block_keys(small.fingerprint, [b"1", b"2"])
    kb = block_keys(big.fingerprint, [b"1", b"2"])
    assert ks[0] != kb[0], "the same engine hash in two namespaces is two blocks"
    s = idx.reserve(0, ks)
    idx.commit(0, ks, 0)
    b = idx.reserve(1, kb)
    idx.commit(1, kb, 0)
    spans = sorted([(o, SLOT) for o in s[:, 0]] + [(o, 2 * SLOT) for o in b[:, 0]])
    assert all(x[0] + x[1] <= y[0] for x, y in zip(spans, spans[1:], strict=False))
    assert idx.alloc.used == 6 * SLOT
    assert idx.lookup(0, ks)[0] == 2 and idx.lookup(1, kb)[0] == 2
    idx.clear_namespace(0)
    assert idx.lookup(0, ks)[0] == 0 and idx.lookup(1, kb)[0] == 2


def test_abort_frees_reservations_of_a_dead_owner():
    idx, _ = make(capacity_slots=2)
    a, b = block_keys(FP, [b"a", b"b"])
    idx.reserve(0, [a, b], owner=7)
    assert idx.alloc.free_bytes == 0
    assert idx.abort_owner(7) == 2
    assert idx.alloc.free_bytes == 2 * SLOT and not idx.blocks


@pytest.mark.parametrize("h", [b"\x01" * 32, 12345, -5])
def test_block_key_depends_on_namespace_and_hash(h):
    other = namespace_fingerprint({"model": "other"})
    assert block_key(FP, h) == block_key(FP, h)
    assert block_key(FP, h) != block_key(other, h)
    assert len(block_key(FP, h)) == 16


def two_namespaces(capacity_slots: int = 8, storage: bool = False) -> tuple[Index, Namespace, Namespace]:
    """A namespace of SLOT-byte shards and one of SLOT/4, which reuses the first one's keys."""
    idx = Index(capacity_slots * SLOT, storage_enabled=storage)
    big = Namespace(0, "big", FP, 1, SLOT)
    small = Namespace(1, "small", namespace_fingerprint({"m": "small"}), 1, SLOT // 4)
    idx.add_namespace(big)
    idx.add_namespace(small)
    return idx, big, small


def test_a_key_belongs_to_the_namespace_that_made_it():
    idx, big, small = two_namespaces()
    files = FileCatalog(idx)
    ready, live = block_keys(FP, [b"ready", b"live"])
    put(idx, [ready])
    idx.reserve(0, [live], owner=1)
    assert idx.lookup(1, [ready]) == (0, []), "another namespace's block is no hit"
    assert (idx.reserve(1, [ready, live], owner=2) == -2).all() and idx.conflicts == 2
    assert idx.commit(1, [live], 0) == [] and idx.retire([live], small) == []
    assert idx.pin(small, [ready], owner=2) == [None] and idx.blocks[ready].pins == 0
    idx.pin(big, [ready], owner=2)
    assert idx.unpin([ready], owner=2, ns=small) == 0 and idx.blocks[ready].pins == 1
    assert idx.unpin([ready], owner=2, ns=big) == 1
    assert not files.add(small, ready) and files.owner(ready) is None
    assert idx.clear_namespace(1) == 0 and idx.lookup(0, [ready])[0] == 1
    assert [b.ns for b in idx.commit(0, [live], 0)] == [big]
    assert idx.alloc.used == 2 * SLOT and small.counters[NsCounter.RESERVE_FAILED] == 0


def test_a_stored_block_is_never_given_slots_of_another_namespace():
    idx, big, small = two_namespaces(storage=True)
    files = FileCatalog(idx)
    (k,) = block_keys(FP, [b"k"])
    files.add(big, k)
    assert idx.lookup(1, [k]) == (0, []) and idx.lookup(0, [k]) == (1, [Tier.STORAGE])
    assert idx.reserve(1, [k])[0, 0] == -2
    assert k not in idx.blocks and idx.alloc.used == 0, "files only: no slots"
    assert idx.reserve(0, [k])[0, 0] >= 0 and idx.commit(0, [k], 0)[0].ns is big
    files.forget(k)
    assert idx.clear_namespace(0) == 1 and idx.alloc.used == 0 and not idx.blocks
    assert idx.reserve(1, [k])[0, 0] >= 0, "gone from its namespace: the key may be made again"


def test_the_allocator_refuses_a_free_of_another_size_or_twice():
    a = PoolAllocator(1 << 20)
    off = a.alloc(16384)
    assert off is not None
    with pytest.raises(RuntimeError, match="allocated with 16384 bytes"):
        a.free(off, 4096)
    a.free(off, 16384)
    with pytest.raises(RuntimeError, match="not allocated"):
        a.free(off, 16384)
    assert a.used == 0 and a.alloc(1 << 20) == 0, "the refused frees changed nothing"


def test_a_block_is_sealed_when_its_last_rank_commits_and_dropped_if_a_save_still_runs():
    """The slots of a block every rank committed take a new generation (no save for its
    reservation lands afterwards); one a copy still writes into is never made READY."""
    bumped: list[int] = []
    busy: set[int] = set()

    def bump(off: int) -> bool:
        bumped.append(off)
        return off not in busy

    idx = Index(1 << 20, fence_bump=bump)
    idx.add_namespace(Namespace(1, "m", "f" * 32, world_size=2, shard_bytes=4096))
    (ok_slots, torn_slots) = idx.reserve(1, [b"k" * 16, b"t" * 16]).tolist()
    assert idx.commit(1, [b"k" * 16, b"t" * 16], rank=0) == [] and bumped == []
    busy.add(torn_slots[1])  # rank 1's copy of the second block is still running
    ready = idx.commit(1, [b"k" * 16, b"t" * 16], rank=1)
    assert [b.key for b in ready] == [b"k" * 16] and idx.torn_commits == 1
    assert set(ok_slots) <= set(bumped)
    assert idx.lookup(1, [b"t" * 16]) == (0, [])
    assert idx.fenced == [(torn_slots[1], 4096)]  # back to the allocator once that copy ends
    busy.clear()
    assert idx.reclaim_fenced() == 1 and idx.alloc.used == 2 * 4096


def test_operator_pins_have_no_lease_count_once_per_key_and_stop_at_the_cap():
    from hpkv.engine.index import PinCapExceeded

    idx, ns = make(capacity_slots=4)
    keys = block_keys(FP, [b"a", b"b", b"c"])
    put(idx, keys)
    assert idx.operator_pin(ns, keys[:2], cap=2 * SLOT) == (2, 2 * SLOT, [])
    assert idx.operator_pin(ns, keys[:2], cap=2 * SLOT) == (0, 0, [])  # pinned already: no change
    with pytest.raises(PinCapExceeded):
        idx.operator_pin(ns, keys[2:], cap=2 * SLOT)
    assert idx.expired_pins(lease=0.0, now=1e12) == {}  # a client's pins would all be due
    victims, skipped = idx.dram_victims(ns, cutoff=None)
    assert [b.key for b in victims] == [keys[2]] and skipped["pinned"] == 2
    assert ns.counters[NsCounter.BYTES_PINNED_OPERATOR] == 2 * SLOT
    assert idx.operator_unpin(ns, None) == (2, 2 * SLOT)
    assert ns.counters[NsCounter.BYTES_PINNED_OPERATOR] == 0 and idx.pinned_bytes == 0


@pytest.mark.parametrize("eviction", ["lru", "s3fifo"])
def test_a_victim_kept_for_a_copy_below_stays_and_the_allocation_takes_the_next_one(eviction):
    """Index.before_evict (a publish on eviction): the victim it keeps stays readable, out of
    the eviction queue until its IO ends; the allocation evicts the next victim, never waits;
    once the IO ended with a copy below, the kept block is the next to go."""
    idx = Index(4 * SLOT, storage_enabled=True, eviction=eviction)
    ns = Namespace(0, "m", FP, 1, SLOT)
    idx.add_namespace(ns)
    keys = block_keys(FP, [f"v{i}".encode() for i in range(6)])

    def put_evictable(ks):
        assert (put(idx, ks) >= 0).all()
        for k in ks:
            idx.skip_spill(idx.blocks[k])  # evictable without a copy below (the evict write policy)

    put_evictable(keys[:4])
    kept = []

    def publish(b):
        if kept:
            return False
        idx.spill_started(b)
        kept.append(b)
        return True

    idx.before_evict = publish
    put_evictable([keys[4]])
    assert [b.key for b in kept] == [keys[0]], "the oldest victim is published first"
    assert keys[0] in idx.blocks and keys[1] not in idx.blocks, "the next victim was evicted instead"
    assert idx.lookup(0, [keys[0]]) == (1, [Tier.DRAM])
    remote = FileCatalog(idx, Tier.REMOTE)
    idx.set_io(kept[0], -1)
    assert keys[0] not in idx.evictable, "no copy below yet"
    remote.add(ns, keys[0], recent=True)  # the publish ended: in the store
    put_evictable([keys[5]])
    assert keys[0] not in idx.blocks and idx.lookup(0, [keys[0]]) == (1, [Tier.REMOTE]), "it went next"
    assert all(k in idx.blocks for k in keys[2:]) and ns.counters[NsCounter.EVICTIONS] == 2


def test_a_before_evict_hook_that_keeps_every_victim_makes_the_allocation_fail_not_hang():
    idx, ns = make(2, storage=True)
    keys = block_keys(FP, [b"a", b"b", b"c"])
    for k in keys[:2]:
        put(idx, [k])
        idx.skip_spill(idx.blocks[k])

    def keep(b):
        idx.spill_started(b)
        return True

    idx.before_evict = keep
    slots = idx.reserve(0, [keys[2]])
    assert (slots < 0).all(), "no slot: every block waits for its copy"
    assert keys[0] in idx.blocks and keys[1] in idx.blocks

"""DRAM eviction policies (HPKV_DRAM_EVICTION): the index's order of evictable blocks, in process."""

from __future__ import annotations

import random

import pytest

from hpkv.engine.eviction import S3Fifo
from hpkv.engine.index import Block, Index, Namespace, State
from hpkv.engine.storage.catalog import FileCatalog
from hpkv.protocol.keys import block_keys, namespace_fingerprint
from hpkv.protocol.stats import NsCounter
from hpkv.protocol.wire import Tier

FP = namespace_fingerprint({"model": "evict"})
SLOT = 64 * 1024


def make(slots: int, eviction: str, storage: bool = False) -> tuple[Index, Namespace]:
    idx = Index(slots * SLOT, storage_enabled=storage, eviction=eviction)
    ns = Namespace(0, "m", FP, 1, SLOT)
    idx.add_namespace(ns)
    return idx, ns


def keys(prefix: str, n: int) -> list[bytes]:
    return block_keys(FP, [f"{prefix}-{i}".encode() for i in range(n)])


def put(idx: Index, ks: list[bytes]) -> None:
    rows = idx.reserve(0, ks)
    idx.commit(0, [k for k, r in zip(ks, rows, strict=True) if r[0] >= 0], 0)


def hit(idx: Index, ns: Namespace, ks: list[bytes], owner: int = 5) -> None:
    """What a load does: pin the blocks, copy them out, release the pins."""
    assert all(s is not None for s in idx.pin(ns, ks, owner=owner))
    assert idx.unpin(ks, owner=owner) == len(ks)


def in_dram(idx: Index, ks: list[bytes]) -> int:
    return sum(idx.in_dram(idx.ns(0), k) for k in ks)


def queue(idx: Index, k: bytes) -> str | None:
    assert isinstance(idx.evictable, S3Fifo)
    return idx.evictable.queue_of(idx.blocks[k])


@pytest.mark.parametrize("eviction,kept", [("lru", 0), ("s3fifo", 8)])
def test_a_one_shot_scan_flushes_the_reused_prefix_under_lru_only(eviction, kept):
    idx, ns = make(32, eviction)
    reused = keys("system", 8)
    put(idx, reused)
    hit(idx, ns, reused)
    for i in range(8):  # one-shot prompts, 4x the pool, none ever sent again
        put(idx, keys(f"once{i}", 16))
    assert in_dram(idx, reused) == kept
    assert ns.counters[NsCounter.EVICTIONS] == 8 + 8 * 16 - 32


def test_s3fifo_a_block_hit_on_probation_moves_to_main_and_an_unused_one_leaves():
    idx, ns = make(10, "s3fifo")
    a, b = keys("ab", 2)
    put(idx, [a, b])
    assert queue(idx, a) == queue(idx, b) == "small", "a new block is on probation"
    hit(idx, ns, [a])
    assert S3Fifo.uses(idx.blocks[a]) == 1 and S3Fifo.uses(idx.blocks[b]) == 0
    # (its load pinned it: it queues again behind b)
    put(idx, keys("fill", 8))  # the pool is full
    put(idx, keys("more", 2))  # b leaves; at a's turn a moves to main and the next one leaves
    assert queue(idx, a) == "main" and S3Fifo.uses(idx.blocks[a]) == 0
    assert b not in idx.blocks and idx.lookup(0, [b]) == (0, [])
    assert keys("fill", 1)[0] not in idx.blocks
    assert idx.evictable.describe()["ghost"] == 2 and idx.evictable.moved_to_main == 1


def test_s3fifo_a_block_evicted_from_probation_and_saved_again_enters_main():
    idx, ns = make(4, "s3fifo")
    (g,) = keys("ghost", 1)
    put(idx, [g])
    put(idx, keys("fill", 4))  # g, never hit, leaves first
    assert g not in idx.blocks
    put(idx, [g])  # the engine recomputed it and saved it again: it was asked for twice
    assert queue(idx, g) == "main" and idx.evictable.ghost_hits == 1


def test_s3fifo_a_block_read_back_from_storage_enters_main():
    idx, ns = make(4, "s3fifo", storage=True)
    files = FileCatalog(idx)
    (k,) = keys("stored", 1)
    files.add(ns, k)  # files only: a storage hit
    b = idx.begin_promote(ns, k)
    assert b is not None
    assert idx.pin(ns, [k], owner=3) == [None], "promoting: nothing to pin yet"
    idx.finish_promote(k, True)
    assert idx.blocks[k].state == State.READY and queue(idx, k) == "main"
    (n,) = keys("new", 1)
    put(idx, [n])
    files.add(ns, n)
    assert queue(idx, n) == "small", "a block seen once is on probation"


def test_s3fifo_main_gives_a_used_block_another_round():
    idx, ns = make(10, "s3fifo")
    hot, cold = keys("hot", 3), keys("cold", 6)
    put(idx, hot + cold)
    hit(idx, ns, hot)
    hit(idx, ns, hot + cold)  # hot used twice: one use left once in main, where it is oldest
    for k in keys("scan", 30):  # a scan passes through the small queue only
        put(idx, [k])
    assert [queue(idx, k) for k in hot + cold] == ["main"] * 9
    assert [S3Fifo.uses(idx.blocks[k]) for k in hot + cold] == [1] * 3 + [0] * 6
    for i in range(3):  # new blocks used on probation join main, which must make room
        (n,) = keys(f"new{i}", 1)
        put(idx, [n])
        hit(idx, ns, [n])
        for k in keys(f"after{i}", 2):
            put(idx, [k])
    assert in_dram(idx, hot) == 3, "the oldest blocks, used again, got another round"
    assert in_dram(idx, cold) == 3, "the next oldest, unused in main, left"
    assert [S3Fifo.uses(idx.blocks[k]) for k in hot] == [0] * 3, "for one use each"


@pytest.mark.parametrize("eviction", ["lru", "s3fifo"])
def test_pinned_and_in_io_blocks_are_never_evicted(eviction):
    idx, ns = make(8, eviction, storage=True)
    files = FileCatalog(idx)
    pinned, spilling, unspilled = keys("pinned", 2), keys("spilling", 2), keys("unspilled", 2)
    for k in pinned + spilling:
        put(idx, [k])
        files.add(ns, k)
    put(idx, unspilled)  # no files yet, no spill: not evictable, the write must come first
    idx.pin(ns, pinned, owner=9)
    for k in spilling:  # a promote of another server, a re-spill: an IO job reads the slots
        idx.set_io(idx.blocks[k], +1)
    put(idx, keys("x", 2))  # the pool is full; none of the six may go
    assert idx.reserve(0, keys("y", 1))[0, 0] == -2, "only unevictable blocks left: refused"
    assert in_dram(idx, pinned + spilling + unspilled) == 6
    for k in keys("x", 2):
        assert k not in idx.blocks or not idx._is_evictable(idx.blocks[k])
    idx.unpin(pinned, owner=9)
    for k in spilling:
        idx.set_io(idx.blocks[k], -1)
    put(idx, keys("z", 4))
    assert in_dram(idx, unspilled) == 2 and in_dram(idx, pinned + spilling) == 0


class RandomTraffic:
    """Every way a block changes evictability, on random keys of one namespace."""

    def __init__(self, idx: Index, ns: Namespace, rng: random.Random):
        self.idx, self.ns, self.rng = idx, ns, rng
        self.files = FileCatalog(idx)
        self.universe = keys("k", 80)
        self.pins: list[bytes] = []
        self.io: list[bytes] = []

    def step(self) -> None:
        k = self.rng.choice(self.universe)
        b = self.idx.blocks.get(k)
        ready = b is not None and b.state == State.READY
        [
            self.save,
            self.pin,
            self.unpin,
            self.spill_start,
            self.spill_end,
            self.files_gone,
            self.promote,
            self.operator_evict,
            self.skip_spill,
        ][self.rng.randrange(9)](k, b if ready else None)

    def save(self, k: bytes, b: Block | None) -> None:
        rows = self.idx.reserve(0, [k], owner=1)
        if rows[0, 0] >= 0 and self.rng.random() < 0.1:
            self.idx.abort([k])
        elif rows[0, 0] >= 0:
            self.idx.commit(0, [k], 0)

    def pin(self, k: bytes, b: Block | None) -> None:
        if b is not None:
            self.idx.pin(self.ns, [k], owner=2)
            self.pins.append(k)

    def unpin(self, k: bytes, b: Block | None) -> None:
        if self.pins:
            self.idx.unpin([self.pins.pop(self.rng.randrange(len(self.pins)))], owner=2)

    def spill_start(self, k: bytes, b: Block | None) -> None:
        s = self.idx.spillable(k)
        if s is not None and k not in self.files:
            self.idx.spill_started(s)
            self.io.append(k)

    def spill_end(self, k: bytes, b: Block | None) -> None:
        if self.io:
            kk = self.io.pop(self.rng.randrange(len(self.io)))
            self.idx.set_io(self.idx.blocks[kk], -1)
            if self.rng.random() < 0.8:
                self.files.add(self.ns, kk)
            else:
                self.idx.skip_spill(self.idx.blocks[kk])

    def files_gone(self, k: bytes, b: Block | None) -> None:
        if k in self.files and not self.idx.in_io(k) and self.rng.random() < 0.3:
            self.files.forget(k)

    def promote(self, k: bytes, b: Block | None) -> None:
        if k not in self.idx.blocks and k in self.files and self.idx.begin_promote(self.ns, k) is not None:
            self.idx.finish_promote(k, self.rng.random() < 0.9)

    def operator_evict(self, k: bytes, b: Block | None) -> None:
        if self.rng.random() < 0.02:
            victims, _ = self.idx.dram_victims(self.ns, cutoff=None)
            self.idx.drop_dram(victims[: self.rng.randrange(4)])

    def skip_spill(self, k: bytes, b: Block | None) -> None:
        if b is not None and b.pins == 0 and b.io == 0:
            self.idx.skip_spill(b)


@pytest.mark.parametrize("eviction", ["lru", "s3fifo"])
def test_the_policy_holds_exactly_the_evictable_blocks_under_random_traffic(eviction):
    """Reserve, commit, abort, pin, unpin, spill start/end, files added/gone, promotes,
    operator drops in random order: the policy's blocks are the index's evictable ones, a victim
    is always one of them, and the pool's bytes add up."""
    idx, ns = make(24, eviction, storage=True)
    t = RandomTraffic(idx, ns, random.Random(11))
    for step in range(6000):
        t.step()
        evictable = {k for k, b in idx.blocks.items() if idx._is_evictable(b)}
        queued = {k for k in idx.blocks if k in idx.evictable}
        assert queued == evictable and len(idx.evictable) == len(evictable), f"step {step}"
        assert idx.alloc.used == SLOT * len(idx.blocks)
    ready = [k for k, b in idx.blocks.items() if b.state == State.READY and not b.pins and not b.io]
    idx.pin(ns, ready[:2], owner=3)
    idx.set_io(idx.blocks[ready[2]], +1)
    held = {k for k in idx.blocks if k in t.pins or k in t.io} | set(ready[:3])
    while idx._evict_one():
        pass
    assert held <= set(idx.blocks), "pinned and in-IO blocks outlive every eviction"
    assert not any(idx._is_evictable(b) for b in idx.blocks.values())


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="'fifo' is not one of lru, s3fifo"):
        Index(SLOT, eviction="fifo")


def test_a_lookup_sees_the_tier_after_an_s3fifo_eviction():
    idx, ns = make(2, "s3fifo", storage=True)
    files = FileCatalog(idx)
    a, b, c = keys("t", 3)
    for k in (a, b):
        put(idx, [k])
        files.add(ns, k)
    put(idx, [c])
    assert idx.lookup(0, [a]) == (1, [Tier.STORAGE]) and idx.lookup(0, [b]) == (1, [Tier.DRAM])


@pytest.mark.parametrize("eviction,kept", [("lru", 0), ("s3fifo", 2)])
def test_a_server_with_the_key_set_keeps_the_reused_blocks_through_a_scan(eviction, kept):
    """A real ``hpkv serve`` with HPKV_DRAM_EVICTION (a 64 MiB pool of 8 slots, no storage):
    two blocks loaded once, then one-shot saves of 3x the pool; the pinned one-shot block stays."""
    from hpkv.client import connect
    from hpkv.testing.server import ServerProcess, private_env

    srv = ServerProcess(private_env(pool_size="64m", HPKV_DRAM_EVICTION=eviction)).start()
    try:
        with connect(srv.cfg, spawn=False) as c:
            ns = c.attach_namespace(FP, 1, 8 << 20).ns_id
            reused = keys("system", 2)
            c.reserve(ns, reused)
            c.commit(ns, reused)
            assert all((row >= 0).all() for row in c.promote(ns, reused)), "a load pins them"
            c.unpin(ns, reused)
            once = keys("once", 24)
            for i, k in enumerate(once):
                assert (c.reserve(ns, [k]) >= 0).all(), "an evictable block always makes room"
                c.commit(ns, [k])
                if i == 0:
                    c.pin(ns, [k])
            assert [c.lookup(ns, [k])[0] for k in reused] == [1] * kept + [0] * (2 - kept)
            assert c.lookup(ns, once[:1])[0] == 1, "pinned: never evicted"
            assert c.stats()["namespaces"][0]["evictions"] == 2 + 24 - 8
    finally:
        srv.cleanup()


def test_the_ghost_keeps_its_keys_when_it_grows_and_forgets_a_key_once_taken():
    """Direct-mapped: a key whose slot a newer key took is forgotten (a hint that fades); sized
    to twice the blocks queued, it keeps most of them; growing loses none."""
    from hpkv.engine.eviction import Ghost

    g = Ghost()
    ks = keys("g", 600)
    for k in ks:
        g.fit(600)  # as S3-FIFO sizes it: twice the queued blocks
        g.add(k)
    held = len(g)
    assert 0.75 * 600 < held < 600
    g.fit(5000)  # 16384 slots: the fingerprints move along, none lost
    assert len(g) == held and sum(g.take(k) for k in ks) == held
    assert len(g) == 0 and not g.take(ks[0]), "taken once: no ghost any more"

"""The remote tier's rules on the server's side (:class:`hpkv.engine.remote.RemoteTier`), in
process: a fake remote worker takes its jobs from the request ring and answers them as the
real one does, so what the store cannot be made to do on demand (a burst of evictions, a
catalog of many keys, a holder that died mid-promote) is exercised here without Mooncake."""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hpkv.config import load_config
from hpkv.engine.index import Index, Namespace
from hpkv.engine.remote import FORGET_SLICE, GONE_TTL_S, MAX_QUEUED_SPILLS, RemoteTier
from hpkv.engine.tiers import ParkedLookup
from hpkv.protocol import wire as P
from hpkv.protocol.keys import block_keys, namespace_fingerprint
from hpkv.protocol.stats import StatsSegment
from hpkv.ring.desc import Desc

FP = namespace_fingerprint({"model": "remote-tier"})
SLOT = 4096


class FakeWorker:
    """The remote worker's rings: jobs pushed are kept (seq -> kind), answers are popped."""

    def __init__(self) -> None:
        self.jobs: dict[int, int] = {}
        self.answers: list[Desc] = []
        self.depth = 0

    # the request ring
    def try_push(self, kind: int, seq: int, *args: Any, flags: int = 0) -> bool:
        self.jobs[seq] = kind
        return True

    # the response ring
    def try_pop(self) -> Desc | None:
        return self.answers.pop(0) if self.answers else None

    def close(self) -> None:
        pass

    def answer(self, kind: int, status: int = 0, a0: int = 1, flags: int = 0) -> int:
        """Answer every job of ``kind`` taken so far; returns how many."""
        seqs = [s for s, k in self.jobs.items() if k == kind]
        for s in seqs:
            del self.jobs[s]
            self.answers.append(Desc(kind, flags, status, s, a0))
        return len(seqs)


class Client:
    cid = 1
    alive = True


def remote_tier(
    tmp_path: Path, slots: int, **keys: str
) -> tuple[RemoteTier, Namespace, FakeWorker, StatsSegment]:
    ini = tmp_path / "hpkv.ini"
    ini.write_text("")
    env = {"HPKV_CONFIG_FILE_PATH": str(ini), "HPKV_REMOTE_BACKEND": "mooncake", "HPKV_KV_STORAGE_PATH": ""}
    cfg = load_config({**env, **keys})
    stats = StatsSegment.create(str(tmp_path))
    idx = Index(slots * SLOT, storage_enabled=True, below_order=[P.Tier.REMOTE])
    ns = Namespace(0, "m", FP, 1, SLOT)
    idx.add_namespace(ns)
    t = RemoteTier(cfg, str(tmp_path), stats, idx, threading.RLock(), None, "")  # type: ignore[arg-type]
    w = FakeWorker()
    t._req = t._resp = w  # type: ignore[assignment]
    t.attach(ns)
    return t, ns, w, stats


def commit(t: RemoteTier, ns: Namespace, keys: list[bytes]) -> np.ndarray:
    idx = t.index
    slots = idx.reserve(ns.ns_id, keys)
    idx.commit(ns.ns_id, keys, 0)
    t.spill([idx.blocks[k] for k in keys if k in idx.blocks])
    return slots


def test_a_burst_of_evictions_publishes_victims_until_a_quarter_of_the_pool_waits_then_drops_one_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """HPKV_REMOTE_WRITE_POLICY=evict with a pool of more than 4 x MAX_QUEUED_SPILLS blocks: an
    allocation meeting only unpublished victims publishes them until a quarter of the pool
    waits (not 256 blocks, write-through's bound), then takes its slot from the next one
    (dropped, logged once); once the puts end, the published victims go first, none dropped."""
    slots = 6 * MAX_QUEUED_SPILLS
    quarter = slots // 4
    t, ns, w, stats = remote_tier(tmp_path, slots, HPKV_REMOTE_WRITE_POLICY="evict")
    caplog.set_level("INFO", logger="hpkv.remote")
    keys = block_keys(FP, [f"k{i}".encode() for i in range(slots + 2 + quarter)])
    assert (commit(t, ns, keys[:slots]) >= 0).all()  # the pool is full, every block evictable
    assert t.counts["dropped"] == 0 and not w.jobs, "nothing published at commit (evict policy)"
    assert (commit(t, ns, keys[slots : slots + 1]) >= 0).all()
    assert len(w.jobs) == quarter > MAX_QUEUED_SPILLS, "victims published up to a quarter of the pool"
    assert t.counts["dropped"] == 1, "the next victim gave its slot unpublished"
    assert (commit(t, ns, keys[slots + 1 : slots + 2]) >= 0).all()
    assert t.counts["dropped"] == 2 and caplog.text.count("evicted unpublished") == 1, "logged once"
    assert w.answer(P.SPILL, a0=SLOT) == quarter
    t.poll()
    assert t.counts["published"] == quarter and len(t.catalog) == quarter
    for k in keys[slots + 2 :]:  # one allocation each: the published victims go, none dropped
        assert (commit(t, ns, [k]) >= 0).all()
    assert t.counts["dropped"] == 2 and not w.jobs
    stats.close()


def lookup(t: RemoteTier, ns: Namespace, keys: list[bytes]) -> tuple[int, list[int], bool]:
    """The server's lookup of ``keys``: the index's prefix, then the tier's turn with a call to
    park (its checks go to the worker)."""
    hit, tiers = t.index.lookup(ns.ns_id, keys)
    call = ParkedLookup(Client(), 1, ns, len(keys), time.monotonic() + 1.0)
    got = t.lookup(ns, keys, hit, tiers, call)
    return got.hit, tiers[: got.hit], got.pending


def test_a_promote_whose_holder_died_is_a_miss_not_asked_again_until_the_store_forgot_it(
    tmp_path: Path,
) -> None:
    """A get that fails because the node holding the object is gone (the worker answers
    TRANSFER_FAIL as -ENOENT; the master lists the object ~10.8 s more): the promote answers
    -1 (recomputed, no failure), the key is counted gone and is a miss for lookups, not asked
    about again for GONE_TTL_S (past the store's liveness window); then asked again."""
    t, ns, w, stats = remote_tier(tmp_path, 16)
    keys = block_keys(FP, [b"held0", b"held1"])
    now = time.monotonic()
    for k in keys:  # found in the store by an earlier lookup
        t.catalog.add(ns, k, recent=False)
        t.catalog.verified(k, now)
    assert lookup(t, ns, keys) == (2, [P.Tier.REMOTE] * 2, False) and not w.jobs
    assert t.promote(Client(), 7, ns, keys, timeout=5.0) is None  # parked on the gets
    assert w.answer(P.PROMOTE, status=-errno.ENOENT, a0=0) == 2
    (answer,) = t.poll()
    assert answer.seq == 7 and (answer.rows == -1).all(), "a miss, recomputed, never an error"
    assert t.counts["gone"] == 2 and t.counts["errors"] == 0 and not t.degraded
    assert t.index.lookup(ns.ns_id, keys) == (0, []), "no longer a hit"
    for _ in range(3):  # asked again and again within the window: a miss, the store not asked
        assert lookup(t, ns, keys) == (0, [], False)
    assert not w.jobs and t.counts["asked"] == 0
    for k in keys:  # GONE_TTL_S later (the store has dropped the dead holder's objects by then)
        assert t._missing[k] >= now + GONE_TTL_S
        t._missing[k] = time.monotonic() - 0.001
    assert lookup(t, ns, keys) == (0, [], True), "asked again"
    assert w.answer(P.LOOKUP, a0=1) == 2  # (republished by another node meanwhile)
    t.poll()
    assert t.index.lookup(ns.ns_id, keys) == (2, [P.Tier.REMOTE] * 2)
    stats.close()


def test_going_down_retires_what_the_store_held_at_once_and_forgets_it_a_slice_a_poll(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The store went down (or a worker's segment was lost): nothing this node knew it held is a
    hit any more, at once, but the catalog is not walked under the lock at once: it is forgotten
    FORGET_SLICE entries a poll. What the store confirms meanwhile stays; the blocks still in
    the pool that it held are evictable and kept to publish again, the most recent first."""
    caplog.set_level("INFO", logger="hpkv.remote")
    t, ns, w, stats = remote_tier(tmp_path, 8)
    n = 3 * FORGET_SLICE + 5
    keys = block_keys(FP, [f"s{i}".encode() for i in range(n)])
    now = time.monotonic()
    for k in keys:
        t.catalog.add(ns, k, recent=False)
        t.catalog.verified(k, now)
    pool = block_keys(FP, [f"p{i}".encode() for i in range(8)])
    for k in pool:  # committed here and published: in the pool and in the store
        commit(t, ns, [k])
    assert w.answer(P.SPILL, a0=SLOT) == 8
    t.poll()
    assert len(t.catalog) == n + 8 and t.index.lookup(ns.ns_id, keys[:3]) == (3, [P.Tier.REMOTE] * 3)
    t._go_down("a test")
    assert len(t.catalog) == n + 8, "not walked at once"
    assert lookup(t, ns, keys[:3]) == (0, [], False), "no remote hit while down"
    assert not any(t.holds(ns, k) for k in keys[:3] + pool)
    assert t._republish_keys == pool[::-1], "the pool's blocks it held, the most recently used first"
    assert (commit(t, ns, block_keys(FP, [b"new"])) >= 0).all(), "the pool's blocks stay evictable"
    later = keys[:2]  # confirmed by the store again (here: found by a check answered late)
    for k in later:
        assert t.catalog.add(ns, k, recent=False)
        t.catalog.verified(k, time.monotonic())
    polls = 0
    while t.catalog.retiring:
        before = len(t.catalog)
        t.poll()
        polls += 1
        assert before - len(t.catalog) <= FORGET_SLICE
    assert polls == 4 and len(t.catalog) == 2 and all(k in t.catalog for k in later)
    assert "stale block(s) forgotten" in caplog.text
    stats.close()


def test_after_a_lost_segment_a_stale_hit_is_asked_about_again_and_kept_when_the_store_has_it(
    tmp_path: Path,
) -> None:
    """While the store is up (a restarted worker's segment was lost), a stale remote hit is
    asked about again in the lookup (parked on one batched exists), as a hit not confirmed for
    PRESENT_TTL_S is: the store's yes makes it a hit again, and the slices never forget it."""
    t, ns, w, stats = remote_tier(tmp_path, 8)
    keys = block_keys(FP, [b"a", b"b", b"c"])
    now = time.monotonic()
    for k in keys:
        t.catalog.add(ns, k, recent=False)
        t.catalog.verified(k, now)
    assert lookup(t, ns, keys) == (3, [P.Tier.REMOTE] * 3, False) and not w.jobs
    t._forget_known()
    assert lookup(t, ns, keys) == (3, [P.Tier.REMOTE] * 3, True), "parked on the question"
    assert len(w.jobs) == 3 and set(w.jobs.values()) == {P.LOOKUP}
    w.answers += [Desc(P.LOOKUP, 0, 0, s, int(i != 1)) for i, s in enumerate(sorted(w.jobs))]
    w.jobs.clear()
    while t.catalog.retiring:
        t.poll()
    assert t.index.lookup(ns.ns_id, keys) == (1, [P.Tier.REMOTE]), "b is gone, a and c stay"
    assert keys[0] in t.catalog and keys[1] not in t.catalog and keys[2] in t.catalog
    stats.close()

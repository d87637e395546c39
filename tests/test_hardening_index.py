"""Issue 26, item 2: a block is (namespace, key). A client that reuses one namespace's keys
in another namespace (another slot size) never sees, pins, commits, frees or sizes the
first namespace's blocks, and the honest engine keeps getting its own bytes back.

Real ``hpkv serve`` processes; the tests write and read blocks through a mapping of the
pool file, as a transfer worker does (a shard's bytes at the offset the server gave).
"""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from hpkv.protocol import wire as P
from hpkv.protocol.keys import block_keys, namespace_fingerprint
from hpkv.testing.server import ServerProcess, assert_serves_correctly, client_of, private_env, wait_for

FP_BIG = namespace_fingerprint({"model": "ident-honest", "layers": 4})
FP_SMALL = namespace_fingerprint({"model": "ident-reuser", "layers": 1})
BIG, SMALL = 16384, 4096  # shard bytes of the honest and of the key-reusing namespace


class Pool:
    """The pool file mapped like a transfer worker maps it."""

    def __init__(self, path: str):
        fd = os.open(path, os.O_RDWR)
        try:
            self.m = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        self.a = np.frombuffer(self.m, np.uint8)

    def write(self, slot: int, data: bytes) -> None:
        off = P.slot_offset(slot)  # a reserve's answer carries the slot's generation too
        self.a[off : off + len(data)] = np.frombuffer(data, np.uint8)

    def read(self, slot: int, n: int) -> bytes:
        off = P.slot_offset(slot)
        return self.a[off : off + n].tobytes()

    def close(self) -> None:
        del self.a
        self.m.close()


def payload(tag: bytes, i: int, n: int) -> bytes:
    return (tag + b"%d-" % i) * (n // (len(tag) + 4)) + b"\0" * n


def assert_clean(srv: ServerProcess) -> None:
    log = srv.log()
    assert "double free" not in log and "pool allocator" not in log, log[-3000:]
    assert "failed inside the server" not in log, log[-3000:]
    assert_serves_correctly(srv)


@pytest.mark.parametrize("world", [1, 2])
def test_a_key_reused_in_a_smaller_namespace_never_gets_a_slot_of_the_stored_block(tmp_path, world):
    """The 924ae3a sequence: a STORED block re-reserved under a namespace with smaller slots (and,
    for world 2, fewer ranks) got those slots; committed, the honest engine then loaded its
    neighbours' bytes, and freeing it broke the allocator."""
    env = private_env(pool_size="16m", storage=str(tmp_path / "st"))
    with ServerProcess(env) as srv, client_of(srv) as honest, client_of(srv) as reuser:
        pool = Pool(honest.pool_path)
        try:
            big = honest.attach_namespace(FP_BIG, world, BIG)
            keys = block_keys(FP_BIG, [b"h%d" % i for i in range(8)])
            slots = honest.reserve(big.ns_id, keys)
            assert (slots >= 0).all()
            want = {
                (i, r): payload(b"honest%d" % r, i, BIG)[:BIG] for i in range(len(keys)) for r in range(world)
            }
            for (i, r), data in want.items():
                pool.write(int(slots[i, r]), data)
            for r in range(world):
                honest.commit(big.ns_id, keys, rank=r)
            wait_for(lambda: honest.stats()["storage"]["spills"] >= len(keys) * world, what="spills")
            assert honest.clear(big.ns_id) == len(keys)  # now STORED: files only

            small = reuser.attach_namespace(FP_SMALL, 1, SMALL)
            reuser.attach_namespace(FP_BIG, world, BIG)
            assert reuser.lookup(small.ns_id, keys) == (0, []), "another namespace's blocks are no hits"
            got = reuser.reserve(small.ns_id, keys)[:, 0]  # checked below, after the harm it did
            # what its worker would have written into them, and the commit under the big namespace
            for off in got[got >= 0]:
                pool.write(int(off), payload(b"reuser", 0, SMALL)[:SMALL])
            for r in range(world):
                reuser.commit(big.ns_id, keys, rank=r)
            # more small blocks around, so an overrun would read someone else's bytes
            filler = block_keys(FP_SMALL, [b"f%d" % i for i in range(64)])
            for off in reuser.reserve(small.ns_id, filler)[:, 0]:
                if off >= 0:
                    pool.write(int(off), b"\xee" * SMALL)
            reuser.commit(small.ns_id, filler)

            rows = honest.promote(big.ns_id, keys)
            wrong = [
                (i, r)
                for (i, r), data in want.items()
                if rows[i, r] < 0 or pool.read(int(rows[i, r]), BIG) != data
            ]
            assert not wrong, (
                f"shards {wrong} not loaded with the honest engine's bytes (offsets {rows.tolist()})"
            )
            assert (got == -2).all(), f"small slots {got} were handed out for the big blocks"
            honest.unpin(big.ns_id, keys)
            spills = (len(keys) * world) + len(filler)
            wait_for(lambda: honest.stats()["storage"]["spills"] >= spills, what="spills")
            assert honest.clear(big.ns_id) == len(keys)  # frees the slots with the size they were made with
            assert reuser.clear(small.ns_id) == len(filler)
            honest.lookup(big.ns_id, keys[:1])  # a hot call publishes the pool's use (a clear does not)
            s = honest.stats()
            assert s["pool"]["used_bytes"] == 0, s["pool"]
            assert "belong to another namespace" in srv.log()
            # everyone's later reserves work
            again = honest.reserve(big.ns_id, block_keys(FP_BIG, [b"later"]))
            mine = reuser.reserve(small.ns_id, block_keys(FP_SMALL, [b"later"]))
            assert (again >= 0).all() and (mine >= 0).all()
        finally:
            pool.close()
        assert_clean(srv)


def test_calls_under_another_namespace_never_see_pin_commit_or_abort_a_block(server):
    with client_of(server) as honest, client_of(server) as reuser:
        pool = Pool(honest.pool_path)
        try:
            big = honest.attach_namespace(FP_BIG, 1, BIG)
            small = reuser.attach_namespace(FP_SMALL, 1, SMALL, rank=0)  # a writer of its namespace
            ready = block_keys(FP_BIG, [b"ready"])
            live = block_keys(FP_BIG, [b"live0", b"live1"])
            (off,) = honest.reserve(big.ns_id, ready)[:, 0]
            pool.write(int(off), b"\x5a" * BIG)
            assert honest.commit(big.ns_id, ready) == 1
            honest.reserve(big.ns_id, live)

            assert reuser.lookup(small.ns_id, ready + live) == (0, []), "924ae3a: a hit of another namespace"
            assert (reuser.pin(small.ns_id, ready) == -1).all(), "924ae3a: another namespace's slot pinned"
            assert server_pinned(honest) == 0
            reuser.unpin(small.ns_id, ready)
            reuser.abort(small.ns_id, live[:1])  # 924ae3a: released the honest reservation
            assert reuser.commit(small.ns_id, live[1:]) == 0
            assert (reuser.reserve(small.ns_id, ready + live) == -2).all()
            assert honest.lookup(big.ns_id, ready + live) == (1, [1]), "still reserved, not committed"
            assert honest.commit(big.ns_id, live) == 2, "the honest reservations survived"
            assert honest.lookup(big.ns_id, ready + live) == (3, [1, 1, 1])
            (pinned,) = honest.pin(big.ns_id, ready)[:, 0]
            assert pinned == off and pool.read(int(off), BIG) == b"\x5a" * BIG
            honest.unpin(big.ns_id, ready)
            assert server_pinned(honest) == 0
        finally:
            pool.close()
    assert_clean(server)


def server_pinned(c) -> int:
    return int(c.stats()["pool"]["pinned_bytes"])


@pytest.mark.parametrize("first", ["small", "big"])
def test_a_dram_block_reserved_in_two_namespaces_keeps_one_size_and_frees_cleanly(server, first):
    """Whichever namespace makes a key first owns it; the other's reserve is skipped, and all
    slots go back to the allocator with the size they were made with."""
    with client_of(server) as a, client_of(server) as b:
        ns = {
            "small": a.attach_namespace(FP_SMALL, 1, SMALL),
            "big": b.attach_namespace(FP_BIG, 1, BIG),
        }
        cl = {"small": a, "big": b}
        second = "big" if first == "small" else "small"
        keys = block_keys(FP_BIG, [b"k%d" % i for i in range(16)])
        assert (cl[first].reserve(ns[first].ns_id, keys) >= 0).all()
        assert (cl[second].reserve(ns[second].ns_id, keys) == -2).all()
        assert cl[second].commit(ns[second].ns_id, keys) == 0
        assert cl[first].commit(ns[first].ns_id, keys) == len(keys)
        assert cl[second].lookup(ns[second].ns_id, keys) == (0, [])
        for name in ("small", "big"):
            cl[name].clear(ns[name].ns_id)
        a.lookup(ns["small"].ns_id, keys[:1])  # a hot call publishes the pool's use (a clear does not)
        assert a.stats()["pool"]["used_bytes"] == 0
        # the key is free again once its owner's copy is gone: now the other namespace may make it
        assert (cl[second].reserve(ns[second].ns_id, keys) >= 0).all()
        assert cl[second].commit(ns[second].ns_id, keys) == len(keys)
        assert cl[first].lookup(ns[first].ns_id, keys) == (0, [])
    assert_clean(server)

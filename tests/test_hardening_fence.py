"""Issue 26, items 3, 4, 10 and one line of 11: a copy is tied to the reservation it writes,
not to a time; a hung worker is detected and slows nobody else.

* 3: a save submitted after its reservation was released (slot reused and committed by
  another key) is refused and changes none of the other key's bytes.
* 4: one engine's stopped transfer worker does not keep another engine's released slots
  from being reserved again.
* 10: a stopped transfer or IO worker is shown hung, killed, its jobs answered as failures,
  and restarted.
* 11: a copy job whose pool offset is not the start of a slot is refused (it used to be
  floored to one), counted and logged.

Real ``hpkv serve`` processes and real worker processes throughout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import numpy as np
import pytest

from hpkv.common.native import ffi, lib
from hpkv.common.pool import PoolFile
from hpkv.protocol import wire as P
from hpkv.protocol.errors import Status
from hpkv.protocol.keys import block_keys, namespace_fingerprint
from hpkv.testing.device import make_device
from hpkv.testing.server import (
    ServerProcess,
    assert_serves_correctly,
    client_of,
    private_env,
    status_json,
    wait_for,
)

FP = namespace_fingerprint({"model": "fence", "layers": 4})
LAYERS, BLOCKS, PAGE = 4, 16, 4096
SLOT = LAYERS * PAGE


def offset_of(value) -> int:
    """The pool offset of a reserve answer's slot value (the generation sits above bit 40)."""
    return int(value) & ((1 << 40) - 1)


@contextlib.contextmanager
def stopped(pid: int):
    """SIGSTOP ``pid`` for the block; SIGCONT after it even if the test fails (a no-op once
    the process is gone)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def running_workers(c, kind: str = "transfer") -> list[dict]:
    return [w for w in c.stats()["workers"] if w["kind"] == kind and w["state"] == "running"]


def engine(srv: ServerProcess, tmp_path, name: str):
    """One engine: a client with a namespace and a registered CPU device filled at random."""
    (tmp_path / name).mkdir()
    dev = make_device(tmp_path / name, LAYERS, BLOCKS, PAGE)
    dev.fill_random(np.random.default_rng(abs(hash(name)) % 1000))
    c = client_of(srv)
    ns = c.attach_namespace(FP, 1, SLOT, rank=0)
    handle = c.register_device(ns.ns_id, rank=0, **dev.spec)
    return c, ns, dev, handle


# ------------------------------------------------------------------ 3. a late save
def test_a_save_submitted_after_its_reservation_was_released_never_lands_in_the_reused_slot(tmp_path):
    with ServerProcess(private_env(pool_size="64m")) as srv:
        a, ns, dev, handle = engine(srv, tmp_path, "a")
        with a, client_of(srv) as b:
            sched = client_of(srv)  # engine A's scheduler: reserves, then goes away
            sched.attach_namespace(FP, 1, SLOT)
            k1 = block_keys(FP, [b"first"])
            (v1,) = sched.reserve(ns.ns_id, k1)[:, 0]
            assert v1 >= 0
            sched.close()
            wait_for(lambda: a.stats()["namespaces"][0]["blocks_reserved"] == 0, what="the release")
            # Another key gets the same slot at once (no grace) and is committed with its bytes.
            b.attach_namespace(FP, 1, SLOT)
            k2 = block_keys(FP, [b"second"])
            (v2,) = b.reserve(ns.ns_id, k2)[:, 0]
            off = offset_of(v2)
            assert off == offset_of(v1), "the released slot was not the one reused"
            pool = PoolFile.attach(os.path.join(srv.pool_dir, P.POOL_FILE))
            try:
                theirs = np.frombuffer(np.random.default_rng(7).bytes(SLOT), np.uint8)
                pool.array[off : off + SLOT] = theirs
                assert b.commit(ns.ns_id, k2) == 1
                # Engine A's worker now makes the save it was told to make for the first key.
                res = handle.wait(handle.submit(P.COPY_SAVE, np.array([3]), np.array([v1])), timeout=30)
                assert bytes(pool.array[off : off + SLOT]) == theirs.tobytes(), (
                    "the late save overwrote the other key's committed bytes"
                )
                assert list(res.values()) == [Status.STALE_SLOT], res
                assert (b.pin(ns.ns_id, k2)[:, 0] == off).all()
                b.unpin(ns.ns_id, k2)
                # The same save with the current generation (a live reservation) still writes.
                k3 = block_keys(FP, [b"third"])
                (v3,) = b.reserve(ns.ns_id, k3)[:, 0]
                assert handle.save(np.array([5]), np.array([v3]))
                o3 = offset_of(v3)
                assert bytes(pool.array[o3 : o3 + SLOT]) == dev.block_bytes(5)
            finally:
                pool.close()
            w = a.stats()["workers"][0]
            assert w["stale_saves"] == 1, w
        assert "refused, nothing written" in srv.log()
        assert_serves_correctly(srv)


def test_a_save_repeated_after_its_block_was_committed_cannot_change_the_served_block(tmp_path):
    """A committed block is sealed (new slot generations): a retried or duplicated save made
    for its reservation is refused, so what a load serves is what was committed."""
    with ServerProcess(private_env(pool_size="64m")) as srv:
        a, ns, dev, handle = engine(srv, tmp_path, "a")
        with a:
            keys = block_keys(FP, [b"sealed"])
            (v,) = a.reserve(ns.ns_id, keys)[:, 0]
            assert handle.save(np.array([2]), np.array([v])) and a.commit(ns.ns_id, keys) == 1
            res = handle.wait(handle.submit(P.COPY_SAVE, np.array([9]), np.array([v])), timeout=30)
            assert list(res.values()) == [Status.STALE_SLOT], res
            (pinned,) = a.pin(ns.ns_id, keys)[:, 0]
            assert handle.load(np.array([12]), np.array([pinned]))
            assert dev.block_bytes(12) == dev.block_bytes(2) != dev.block_bytes(9)
            a.unpin(ns.ns_id, keys)
        assert_serves_correctly(srv)


def test_a_slot_being_written_gets_no_new_generation_until_the_copy_ended(tmp_path):
    """The fence itself (native/fence.c): what the server and a worker do with one slot."""
    words = np.zeros(4, np.uint32)
    cw = ffi.from_buffer("uint32_t[]", words)
    offs = np.array([2 * P.SLOT_UNIT], np.int64)
    gens = np.array([0], np.uint32)

    def enter(g: int, holder: int = 3) -> int:
        gens[0] = g
        return lib.hpkv_fence_enter(
            cw,
            4,
            P.SLOT_UNIT,
            ffi.from_buffer("int64_t[]", offs),
            ffi.from_buffer("uint32_t[]", gens),
            1,
            holder,
        )

    assert enter(0) == 0  # a worker holds slot 2 for a save of generation 0
    assert lib.hpkv_fence_bump(cw, 4, 2) == -1  # the server cannot release it meanwhile
    assert enter(0, holder=4) == -1  # nor can another worker write it
    lib.hpkv_fence_leave(
        cw, 4, P.SLOT_UNIT, ffi.from_buffer("int64_t[]", offs), ffi.from_buffer("uint32_t[]", gens), 1, 3
    )
    assert lib.hpkv_fence_bump(cw, 4, 2) == 1  # copy ended: generation 1
    assert enter(0) == -1  # a late save for generation 0 is refused
    assert enter(1) == 0
    assert lib.hpkv_fence_clear_holder(cw, 4, 3) == 1  # its worker died: the hold is dropped
    assert lib.hpkv_fence_bump(cw, 4, 2) == 2
    words[1] = lib.HPKV_FENCE_GEN_MASK
    assert lib.hpkv_fence_bump(cw, 4, 1) == 0  # generations wrap within 23 bits
    assert (P.SLOT_GEN_MASK << P.SLOT_GEN_SHIFT | P.SLOT_OFFSET_MASK) < 2**63  # slot values stay >= 0


def test_a_pool_whose_offsets_would_reach_the_generation_bits_is_refused_by_the_config():
    from hpkv.config import ConfigError, load_config

    env = private_env(pool_size="1t")
    assert load_config(env).pool_size == 1 << P.SLOT_GEN_SHIFT
    with pytest.raises(ConfigError, match="above the maximum of 1.0 TiB"):
        load_config(private_env(pool_size="1025g"))


def test_a_released_slot_a_save_still_copies_into_is_handed_out_only_after_that_copy():
    """The server's side of the fence (Index): the bump fails while a worker holds the slot."""
    from hpkv.engine.index import Index, Namespace

    held: set[int] = set()
    idx = Index(2 * SLOT, fence_bump=lambda off: off not in held)
    idx.add_namespace(Namespace(0, "m", FP, 1, SLOT))
    (a,), (b,) = idx.reserve(0, block_keys(FP, [b"a", b"b"]), owner=1)
    held.add(a)  # a worker is copying into a's slot when a's owner goes away
    idx.free_retired(idx.retire(block_keys(FP, [b"a", b"b"])))
    again = idx.reserve(0, block_keys(FP, [b"c", b"d"]), owner=2)[:, 0]
    assert list(again) == [b, -2], "a slot being written was handed out again"
    held.clear()  # the copy ended
    assert list(idx.reserve(0, block_keys(FP, [b"e"]), owner=2)[:, 0]) == [a]
    assert idx.alloc.used == 2 * SLOT and not idx.fenced


# ------------------------------------------------------------------ 4. one hung worker, everyone's releases
def reserve_all(c, ns_id: int, keys: list[bytes]):
    """Every key reserved (the answer), or None with the partial reservations given back."""
    got = c.reserve(ns_id, keys)[:, 0]
    if (got >= 0).all():
        return got
    c.abort(ns_id, [k for k, o in zip(keys, got, strict=True) if o >= 0])
    return None


def test_a_stopped_transfer_worker_of_one_engine_does_not_hold_back_another_engines_released_slots(tmp_path):
    # 64 slots in all (the smallest pool); detection off, so only the release path is under test.
    slots = (1 << 20) // SLOT
    env = private_env(pool_size="1m", HPKV_WORKER_HANG_S="0")
    with ServerProcess(env) as srv:
        x, ns, _, handle = engine(srv, tmp_path, "x")
        with x, client_of(srv) as y:
            y.attach_namespace(FP, 1, SLOT)
            (w,) = wait_for(lambda: running_workers(x), what="x's worker running")
            with stopped(w["pid"]):
                (v,) = x.reserve(ns.ns_id, block_keys(FP, [b"x0"]))[:, 0]
                tickets = handle.submit(P.COPY_SAVE, np.array([0]), np.array([v]))  # queued, never run
                for rnd in range(3):
                    keys = block_keys(FP, [b"y%d-%d" % (rnd, i) for i in range(slots - 1)])
                    got = wait_for(
                        lambda keys=keys: reserve_all(y, ns.ns_id, keys),
                        timeout=5,
                        what=f"round {rnd}: y's released slots reserved again while x's worker is stopped",
                    )
                    assert len({offset_of(o) for o in got}) == slots - 1
                    y.abort(ns.ns_id, keys)
                assert handle.wait(tickets, timeout=0.1) != {tickets[0]: 0}
    # (the server's stop ends the stopped worker too)


# ------------------------------------------------------------------ 10. hung workers
def test_a_stopped_transfer_worker_is_shown_hung_killed_its_jobs_failed_and_restarted(tmp_path):
    env = private_env(HPKV_WORKER_HANG_S="2")
    with ServerProcess(env) as srv:
        x, ns, dev, handle = engine(srv, tmp_path, "x")
        with x, client_of(srv) as other:
            other.attach_namespace(FP, 1, SLOT)
            (w,) = wait_for(lambda: running_workers(x), what="the worker running")
            keys = block_keys(FP, [b"h%d" % i for i in range(4)])
            slots = x.reserve(ns.ns_id, keys)[:, 0]
            with stopped(w["pid"]):
                tickets = handle.submit(P.COPY_SAVE, np.arange(4), slots)
                # Meanwhile another client's reserve and release work as ever.
                mine = block_keys(FP, [b"o%d" % i for i in range(8)])
                assert (other.reserve(ns.ns_id, mine) >= 0).all()
                other.abort(ns.ns_id, mine)
                assert (other.reserve(ns.ns_id, mine) >= 0).all()
                other.abort(ns.ns_id, mine)
                seen = wait_for(
                    lambda: [v for v in x.stats()["workers"] if v["state"] == "hung"],
                    timeout=20,
                    what="the worker shown hung",
                )
                assert seen[0]["pid"] == w["pid"]
                res = handle.wait(tickets, timeout=20)
            assert list(res.values()) == [Status.WORKER_DIED], res
            (w2,) = wait_for(lambda: running_workers(x), what="the worker restarted")
            assert w2["pid"] != w["pid"] and w2["restarts"] == 1 and w2["hangs"] == 1, w2
            with pytest.raises(ProcessLookupError):
                os.kill(w["pid"], 0)
            st = status_json(srv.env)["workers"][0]
            assert st["hangs"] == 1 and st["restarts"] == 1, st
            x.abort(ns.ns_id, keys)
            # The replacement saves (new reservations; the old ones were aborted).
            keys2 = block_keys(FP, [b"r%d" % i for i in range(4)])
            slots2 = x.reserve(ns.ns_id, keys2)[:, 0]
            assert handle.save(np.arange(4), slots2)
            assert x.commit(ns.ns_id, keys2) == 4
        log = srv.log()
        assert "is hung: no heartbeat for" in log and "HPKV_WORKER_HANG_S=2" in log
        assert_serves_correctly(srv)


def test_a_stopped_io_worker_is_shown_hung_killed_and_restarted_and_its_spills_retried(tmp_path):
    storage = tmp_path / "storage"
    env = private_env(storage=str(storage), HPKV_WORKER_HANG_S="2", HPKV_NUM_IO_WORKERS="1")
    with ServerProcess(env) as srv, client_of(srv) as c:
        ns = c.attach_namespace(FP, 1, SLOT)
        (w,) = wait_for(lambda: running_workers(c, "io"), what="the IO worker running")
        keys = block_keys(FP, [b"s%d" % i for i in range(4)])
        with stopped(w["pid"]):
            c.reserve(ns.ns_id, keys)
            assert c.commit(ns.ns_id, keys) == 4  # write-through: 4 spills to the stopped worker
            seen = wait_for(
                lambda: [v for v in c.stats()["workers"] if v["kind"] == "io" and v["state"] == "hung"],
                timeout=20,
                what="the IO worker shown hung",
            )
            assert seen[0]["pid"] == w["pid"]
        (w2,) = wait_for(lambda: running_workers(c, "io"), what="the IO worker restarted")
        assert w2["pid"] != w["pid"] and w2["hangs"] == 1, w2
        wait_for(
            lambda: c.stats()["storage"]["spills"] >= 4,
            timeout=30,
            what="the spills written by the replacement",
        )
        assert "is hung: no heartbeat for" in srv.log()


# ------------------------------------------------------------------ 11. unaligned copy offsets
def test_a_copy_offset_that_is_not_the_start_of_a_slot_is_refused_counted_and_logged(tmp_path):
    with ServerProcess(private_env()) as srv:
        c, ns, dev, handle = engine(srv, tmp_path, "u")
        with c:
            (v,) = c.reserve(ns.ns_id, block_keys(FP, [b"u"]))[:, 0]
            pool = PoolFile.attach(os.path.join(srv.pool_dir, P.POOL_FILE))
            try:
                before = bytes(pool.array[: 4 * SLOT])
                for bad in (v + P.SLOT_UNIT, v + 1):  # inside the slot: used to be floored to it
                    res = handle.wait(handle.submit(P.COPY_SAVE, np.array([1]), np.array([bad])), timeout=30)
                    assert list(res.values()) == [Status.BAD_REQUEST], (bad, res)
                assert bytes(pool.array[: 4 * SLOT]) == before, "an unaligned save wrote into the pool"
            finally:
                pool.close()
            assert c.stats()["workers"][0]["bad_jobs"] == 2
            assert handle.save(np.array([1]), np.array([v]))  # the aligned one still works
        assert srv.log().count("is not the start of a") == 1, "the rejections are logged rate-limited"


def test_a_namespace_written_from_inside_the_engine_keeps_a_dead_owners_slots_for_the_grace():
    """SGLang's in-process mode and vLLM's CUDA fallback write the pool themselves, where no fence
    checks: a released reservation of such a namespace (no transfer-worker device for a rank) is
    reused only after the grace, as before the fence; one with devices for every rank at once."""
    with ServerProcess(private_env(pool_size="64m")) as srv, client_of(srv) as b:
        ns = b.attach_namespace(FP, 1, SLOT)
        owner = client_of(srv)
        owner.attach_namespace(FP, 1, SLOT)
        (v1,) = owner.reserve(ns.ns_id, block_keys(FP, [b"in-process"]))[:, 0]
        owner.close()  # the scheduler goes away; its in-process writer may still be copying
        wait_for(lambda: "1 reservations" in srv.log(), what="the owner's release", step=0.005)
        (v2,) = b.reserve(ns.ns_id, block_keys(FP, [b"right-after"]))[:, 0]
        assert offset_of(v2) != offset_of(v1), "an unfenced slot was reused within its grace"
        reused = wait_for(
            lambda: (
                offset_of(b.reserve(ns.ns_id, block_keys(FP, [b"later-%f" % time.monotonic()]))[0, 0])
                == offset_of(v1)
            ),
            timeout=10,
            what="the slot back after the grace",
        )
        assert reused

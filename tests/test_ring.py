"""Shared-memory rings and doorbells (hpkv.ring), exercised across real processes.

Every concurrent test runs its peer in a separate process (multiprocessing
"spawn", so the child attaches by name like an unrelated process would); the
``procs`` fixture kills and joins every process a test started, pass or fail.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import shutil
import signal
import stat
import tempfile
import time
from collections import deque

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hpkv.common.native import ffi, lib
from hpkv.ring import (
    DESC_DTYPE,
    Desc,
    Doorbell,
    Kind,
    PeerClosed,
    PeerDead,
    Ring,
    RingBusy,
    RingError,
    RingExists,
    RingNotFound,
    RingTimeout,
    new_descs,
    set_death_notices,
)

CTX = mp.get_context("spawn")
_MULT = np.array(
    [
        0x9E3779B97F4A7C15,
        0xC2B2AE3D27D4EB4F,
        0x165667B19E3779F9,
        0xD6E8FEB86659FD93,
        0xFF51AFD7ED558CCD,
        0xC4CEB9FE1A85EC53,
    ],
    dtype=np.uint64,
)


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture
def shm_dir():
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = tempfile.mkdtemp(prefix="hpkv-ring-test-", dir=base)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def procs():
    """start(target, *args) -> spawned, started Process; all killed and joined at teardown."""
    started: list[mp.Process] = []

    def start(target, *args):
        p = CTX.Process(target=target, args=args, daemon=True)
        p.start()
        started.append(p)
        return p

    try:
        yield start
    finally:
        for p in started:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)


def _fill(buf: np.ndarray, start: int, k: int) -> None:
    """Descriptors start..start+k, every field a function of seq (so the consumer can check all)."""
    s = np.arange(start, start + k, dtype=np.uint64)
    v = buf[:k]
    v["seq"] = s
    v["kind"] = s % 13 + 1
    v["flags"] = s & np.uint64(0xFFFF)
    v["status"] = -(s % np.uint64(1000)).astype(np.int32)
    v["arg"] = s[:, None] * _MULT[None, :]  # wraps mod 2**64


def _checksum(buf: np.ndarray, k: int) -> int:
    return int(np.bitwise_xor.reduce(buf["arg"][:k].ravel())) if k else 0


def _spin_for(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


# ---------------------------------------------------------------- child process bodies


def _child_stream_producer(directory, name, total, batch):
    ring = Ring.attach(directory, name, role="producer", wait=20)
    buf = new_descs(batch)
    sent, xsum = 0, 0
    while sent < total:
        k = min(batch, total - sent)
        _fill(buf, sent, k)
        xsum ^= _checksum(buf, k)
        if ring.push_batch(buf, k, timeout=30) != k:
            raise SystemExit(3)
        sent += k
    ring.push(Kind.SHUTDOWN, total, xsum, timeout=30)
    ring.close()


def _child_consume_all(directory, name, expect, results):
    ring = Ring.attach(directory, name, role="consumer", wait=20)
    got = [tuple(ring.pop(timeout=20)) for _ in range(expect)]
    results.put((got, ring.try_pop()))
    ring.close()


def _child_produce_slowly_in_odd_batches(directory, name, total):
    ring = Ring.attach(directory, name, role="producer", wait=20)
    buf = new_descs(7)
    sent, sizes = 0, [1, 3, 5, 7, 2]
    i = 0
    while sent < total:
        k = min(sizes[i % len(sizes)], total - sent)
        _fill(buf, sent, k)
        if ring.push_batch(buf, k, timeout=20) != k:
            raise SystemExit(3)
        sent += k
        i += 1
    ring.close()


def _child_echo(directory, req, resp, n, seed):
    """Pops a request, waits a random few µs, pushes the reply: both sides sleep (spin 0)."""
    rng = random.Random(seed)
    rin = Ring.attach(directory, req, role="consumer", wait=20, spin_us=0, slice_ms=60_000)
    rout = Ring.attach(directory, resp, role="producer", wait=20, spin_us=0, slice_ms=60_000)
    for _ in range(n):
        d = rin.pop(timeout=5)
        _spin_for(rng.random() * 30e-6)
        rout.push(Kind.COMPLETION, d.seq, d.a0 + 1, timeout=5)
    rin.close()
    rout.close()


def _child_produce_then_die(directory, name, n_before, delay):
    ring = Ring.attach(directory, name, role="producer", wait=20)
    for i in range(n_before):
        ring.push(Kind.COPY_SAVE, i)
    time.sleep(delay)
    os.kill(os.getpid(), signal.SIGKILL)


def _child_attach_in_a_thread_then_hold(directory, name, attached, release):
    """Attaches the producer end from a thread that then exits; the process lives on."""
    import threading

    box = []
    t = threading.Thread(target=lambda: box.append(Ring.attach(directory, name, role="producer", wait=20)))
    t.start()
    t.join()
    attached.set()
    release.wait(60)
    box[0].push(Kind.PIN, 7)
    time.sleep(60)  # stays alive until the test's teardown kills it


def _child_produce_then_die_without_notices(directory, name, n_before, delay):
    set_death_notices(False)
    _child_produce_then_die(directory, name, n_before, delay)


def _child_produce_hide_from_the_notice_then_die(directory, name):
    """Rewrites its end's life word to a TID that is not its keeper's, so the kernel's death notice
    misses it (as in the rare races it exists for), then pushes one descriptor and dies."""
    import mmap

    ring = Ring.attach(directory, name, role="producer", wait=20)
    with open(ring.path, "r+b") as f, mmap.mmap(f.fileno(), 4096) as mm:
        words = np.frombuffer(mm, dtype=np.uint32)
        i = lib.hpkv_ring_life_offset(lib.HPKV_RING_PRODUCER) // 4
        assert words[i] & 0x3FFFFFFF, "the producer's end is held through its keeper"
        words[i] ^= 1
        del words
    ring.push(Kind.SPILL, 0)
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)


def _child_consume_then_die(directory, name, n_pop, delay):
    ring = Ring.attach(directory, name, role="consumer", wait=20)
    for _ in range(n_pop):
        ring.pop(timeout=20)
    time.sleep(delay)
    os.kill(os.getpid(), signal.SIGKILL)


def _child_produce_and_close(directory, name, n):
    ring = Ring.attach(directory, name, role="producer", wait=20)
    for i in range(n):
        ring.push(Kind.SPILL, i)
    ring.close()


def _child_create_and_hold(directory, name, ready, release):
    ring = Ring.create(directory, name, 16, role="consumer")
    ready.set()
    release.wait(60)
    ring.close()


def _child_create_and_die(directory, name, ready):
    ring = Ring.create(directory, name, 16, role="producer")  # noqa: F841 (held until the kill)
    bell = Doorbell.create(directory, name)  # noqa: F841
    ready.set()
    os.kill(os.getpid(), signal.SIGKILL)


def _child_create_push_hold(directory, name, n, release):
    ring = Ring.create(directory, name, 64, role="producer")
    for i in range(n):
        ring.push(Kind.PIN, i, i * 10)
    release.wait(60)
    ring.close()


def _child_bell_producer(directory, names, ack_name, n, seed):
    """Pushes into a random one of the server's rings after a random few µs, then waits for the ack."""
    rng = random.Random(seed)
    rings = [Ring.attach(directory, nm, role="producer", wait=20) for nm in names]
    ack = Ring.attach(directory, ack_name, role="consumer", wait=20, spin_us=0, slice_ms=60_000)
    for i in range(n):
        _spin_for(rng.random() * 30e-6)
        rings[rng.randrange(len(rings))].push(Kind.LOOKUP, i, timeout=5)
        if ack.pop(timeout=5).seq != i:
            raise SystemExit(4)
    for r in rings:
        r.close()
    ack.close()


# ---------------------------------------------------------------- descriptor format


def test_descriptor_is_64_bytes_and_numpy_view_matches_c():
    assert ffi.sizeof("hpkv_desc") == 64 == DESC_DTYPE.itemsize
    for name in ("kind", "flags", "status", "seq", "arg"):
        assert DESC_DTYPE.fields[name][1] == ffi.offsetof("hpkv_desc", name)


def test_kinds_come_from_the_native_enum():
    assert Kind.COPY_SAVE == lib.HPKV_DESC_COPY_SAVE
    assert Kind.SHUTDOWN == lib.HPKV_DESC_SHUTDOWN
    expected = {
        "COPY_SAVE",
        "COPY_LOAD",
        "SPILL",
        "PROMOTE",
        "LOOKUP",
        "RESERVE",
        "COMMIT",
        "PIN",
        "UNPIN",
        "CLEAR",
        "COMPLETION",
        "ERROR",
        "SHUTDOWN",
    }
    assert expected <= set(Kind.__members__)
    assert len({int(k) for k in Kind}) == len(Kind)


def test_all_fields_round_trip(shm_dir):
    with Ring.create(shm_dir, "fields", 8) as p, Ring.attach(shm_dir, "fields") as c:
        big = (1 << 64) - 1
        assert p.try_push(Kind.ERROR, big, 1, 2, 3, 4, 5, big, status=-(1 << 31), flags=0xFFFF)
        assert c.try_pop() == Desc(int(Kind.ERROR), 0xFFFF, -(1 << 31), big, 1, 2, 3, 4, 5, big)


def test_single_descriptor_calls_take_python_arguments_and_reject_bad_ones(shm_dir):
    """push/try_push/pop/try_pop are native methods (hpkv._ringcall): same signature as documented."""
    with Ring.create(shm_dir, "args", 4) as p, Ring.attach(shm_dir, "args") as c:
        p.push(Kind.PIN, 5, 1, 2, a3=4, a5=6, status=-7, flags=3, timeout=1.0)
        p.push(kind=Kind.UNPIN, seq=np.uint64((1 << 64) - 1), a0=np.int32(9))  # numpy ints via __index__
        d = c.pop(1.0)
        assert d == Desc(int(Kind.PIN), 3, -7, 5, 1, 2, 0, 4, 0, 6)
        assert type(d) is Desc and d.a3 == 4 and d.args == (1, 2, 0, 4, 0, 6)
        assert hash(d) == hash(tuple(d)) and {tuple(d): 1}[d] == 1  # a real tuple (hash cache on 3.14)
        assert c.pop(timeout=1.0) == (int(Kind.UNPIN), 0, 0, (1 << 64) - 1, 9, 0, 0, 0, 0, 0)
        bad = [
            (TypeError, "missing required argument 'seq'", lambda: p.push(1)),
            (TypeError, "unexpected keyword argument 'bogus'", lambda: p.push(1, 2, bogus=3)),
            (TypeError, "unexpected keyword argument 'timeout'", lambda: p.try_push(1, 2, timeout=1)),
            (TypeError, "multiple values for argument 'seq'", lambda: p.push(1, 2, seq=3)),
            (TypeError, "at most 8 positional", lambda: p.push(*range(9))),
            (TypeError, "field seq must be an int, not float", lambda: p.push(1, 1.5)),
            (OverflowError, r"field seq must be in \[0, 2\*\*64\), not -1", lambda: p.push(1, -1)),
            (OverflowError, r"field kind must be in \[0, 65535\], not 70000", lambda: p.push(70000, 1)),
            (OverflowError, "field status", lambda: p.push(1, 1, status=1 << 31)),
            (OverflowError, "field a4", lambda: p.push(1, 1, a4=1 << 64)),
            (ValueError, "not nan", lambda: c.pop(float("nan"))),
            (TypeError, "pop\\(\\) takes one argument", lambda: c.pop(1, 2)),
            (TypeError, "pop\\(\\) takes one argument", lambda: c.pop(wait=1)),
        ]
        for exc, match, call in bad:
            with pytest.raises(exc, match=match):
                call()
        assert c.try_pop() is None, "a rejected call must not push anything"
        for i in range(4):
            assert p.try_push(Kind.SPILL, i)
        assert not p.try_push(Kind.SPILL, 4)
        with pytest.raises(RingTimeout, match="room for a descriptor"):
            p.push(Kind.SPILL, 4, timeout=0.05)
        assert [c.try_pop().seq for _ in range(4)] == [0, 1, 2, 3]
        with pytest.raises(RingTimeout, match="waited 0.05 s for a descriptor"):
            c.pop(0.05)


# ---------------------------------------------------------------- throughput and order


def test_ten_million_descriptors_keep_order_and_checksum(shm_dir, procs):
    total, batch = 10_000_000, 4096
    ring = Ring.create(shm_dir, "stream", 16384, role="consumer")
    producer = procs(_child_stream_producer, shm_dir, "stream", total, batch)
    out, expect = new_descs(batch), new_descs(batch)
    got, xsum = 0, 0
    t0 = time.monotonic()
    while got < total:
        n = ring.pop_batch(out, min(batch, total - got), timeout=30)
        assert n > 0, "producer stalled"
        _fill(expect, got, n)
        if not np.array_equal(out[:n].view(np.uint64), expect[:n].view(np.uint64)):
            bad = (
                int(np.nonzero(out["seq"][:n] != expect["seq"][:n])[0][0])
                if (out["seq"][:n] != expect["seq"][:n]).any()
                else -1
            )
            pytest.fail(f"descriptor mismatch in batch at seq {got} (first bad seq index {bad})")
        xsum ^= _checksum(out, n)
        got += n
    tail = ring.pop(timeout=30)
    elapsed = time.monotonic() - t0
    assert tail.kind == Kind.SHUTDOWN and tail.seq == total and tail.a0 == xsum
    producer.join(30)
    assert producer.exitcode == 0
    assert elapsed < 60, f"10M descriptors took {elapsed:.1f} s"
    ring.close()


def test_wrap_around_many_times_with_odd_batches(shm_dir, procs):
    total = 5000  # ≈ 600 wraps of a capacity-8 ring
    ring = Ring.create(shm_dir, "wrap", 8, role="consumer")
    procs(_child_produce_slowly_in_odd_batches, shm_dir, "wrap", total)
    out, expect = new_descs(6), new_descs(6)
    got = 0
    sizes = [6, 1, 4, 3]
    i = 0
    while got < total:
        n = ring.pop_batch(out, sizes[i % len(sizes)], timeout=20)
        assert n > 0
        _fill(expect, got, n)
        assert np.array_equal(out[:n].view(np.uint64), expect[:n].view(np.uint64))
        got += n
        i += 1
    assert ring.try_pop() is None
    ring.close()


def test_full_ring_refuses_push_and_empty_ring_returns_none(shm_dir, procs):
    ring = Ring.create(shm_dir, "full", 16, role="producer")
    for i in range(16):
        assert ring.try_push(Kind.SPILL, i, i)
    assert ring.depth == 16
    assert not ring.try_push(Kind.SPILL, 99)
    with pytest.raises(RingTimeout):
        ring.push(Kind.SPILL, 99, timeout=0.05)
    extra = new_descs(4)
    assert ring.push_batch(extra) == 0
    assert ring.push_batch(extra, timeout=0.05) == 0

    results = CTX.Queue()
    procs(_child_consume_all, shm_dir, "full", 16, results)
    got, after = results.get(timeout=30)
    assert [d[3] for d in got] == list(range(16))
    assert [d[4] for d in got] == list(range(16))
    assert after is None  # empty: try_pop reports it
    assert ring.depth == 0
    assert ring.try_push(Kind.SPILL, 16)  # room again
    ring.close()


def test_consumer_sees_empty_then_a_late_producer(shm_dir, procs):
    ring = Ring.create(shm_dir, "late", 8, role="consumer")
    assert ring.try_pop() is None
    assert ring.pop_batch(new_descs(4)) == 0
    assert ring.pop_batch(new_descs(4), timeout=0.02) == 0
    with pytest.raises(RingTimeout):
        ring.pop(timeout=0.02)  # producer not attached yet: quiet, not dead
    procs(_child_produce_and_close, shm_dir, "late", 3)
    assert [ring.pop(timeout=20).seq for _ in range(3)] == [0, 1, 2]
    ring.close()


# ---------------------------------------------------------------- wake-ups


def test_no_lost_wakeup_when_sleep_and_push_race(shm_dir, procs):
    """Both sides sleep at once (spin 0) and the push lands at random points of the
    peer's sleep entry; futex slices are 60 s, so a lost wake-up would surface as a
    RingTimeout (5 s) instead of being papered over by a slice."""
    n = 20_000
    req = Ring.create(shm_dir, "req", 64, role="producer", spin_us=0, slice_ms=60_000)
    resp = Ring.create(shm_dir, "resp", 64, role="consumer", spin_us=0, slice_ms=60_000)
    echo = procs(_child_echo, shm_dir, "req", "resp", n, 1234)
    rng = random.Random(99)
    worst = 0.0
    for i in range(n):
        t0 = time.perf_counter()
        req.push(Kind.LOOKUP, i, i, timeout=5)
        d = resp.pop(timeout=5)
        worst = max(worst, time.perf_counter() - t0)
        assert (d.seq, d.a0) == (i, i + 1)
        _spin_for(rng.random() * 30e-6)
    echo.join(20)
    assert echo.exitcode == 0
    assert resp.stats()["sleeps"] > n // 10, "the sleep path was not exercised"
    assert worst < 4.0, f"a round trip stalled {worst:.3f} s"
    req.close()
    resp.close()


def test_doorbell_wakes_consumer_of_many_rings_without_loss(shm_dir, procs):
    n, names = 5000, [f"client{i}" for i in range(4)]
    bell = Doorbell.create(shm_dir, "server", spin_us=0)
    rings = [Ring.create(shm_dir, nm, 16, role="consumer", doorbell=bell) for nm in names]
    ack = Ring.create(shm_dir, "ack", 16, role="producer", spin_us=0)
    procs(_child_bell_producer, shm_dir, names, "ack", n, 7)
    seen = 0
    while seen < n:
        assert bell.wait(timeout=5), f"doorbell never rang after {seen} requests"
        for r in rings:
            d = r.try_pop()
            if d is not None:
                assert d.seq == seen
                ack.push(Kind.COMPLETION, d.seq, timeout=5)
                seen += 1
    assert bell.stats()["sleeps"] > 0
    for r in rings:
        r.close()
    ack.close()
    bell.close()


def test_doorbell_ring_is_sticky_until_waited(shm_dir):
    bell = Doorbell.create(shm_dir, "sticky")
    assert not bell.wait(timeout=0.01)
    other = Doorbell.attach(shm_dir, "sticky")
    other.ring()
    assert bell.wait(timeout=0)
    assert not bell.wait(timeout=0.01)
    with pytest.raises(RingError, match="only its creator"):
        other.wait(0)
    other.close()
    bell.close()
    assert not os.path.exists(os.path.join(shm_dir, "sticky.bell"))


def test_signal_handler_exception_interrupts_a_blocking_pop(shm_dir):
    class Alarm(Exception):
        pass

    def handler(signum, frame):
        raise Alarm

    with (
        Ring.create(shm_dir, "sig", 8, role="consumer", slice_ms=60_000) as ring,
        Ring.attach(shm_dir, "sig", role="producer"),
    ):
        old = signal.signal(signal.SIGALRM, handler)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.1)
            t0 = time.monotonic()
            with pytest.raises(Alarm):
                ring.pop(timeout=None)
            assert time.monotonic() - t0 < 5
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


# ---------------------------------------------------------------- dead and closed peers


def test_producer_killed_mid_stream_raises_peer_dead(shm_dir, procs):
    ring = Ring.create(shm_dir, "victim", 64, role="consumer")
    child = procs(_child_produce_then_die, shm_dir, "victim", 10, 0.3)
    assert [ring.pop(timeout=20).seq for _ in range(10)] == list(range(10))
    t0 = time.monotonic()
    with pytest.raises(PeerDead, match=f"pid {child.pid}") as info:
        ring.pop(timeout=10)  # blocks while the child dies (unreaped: a zombie counts as dead)
    assert not isinstance(info.value, PeerClosed)
    assert time.monotonic() - t0 < 3, "PeerDead must come within one slice of the death"
    with pytest.raises(PeerDead):  # and quickly again, even with a timeout shorter than a slice
        ring.pop(timeout=0.01)
    with pytest.raises(PeerDead):
        ring.pop_batch(new_descs(4), timeout=0.5)
    # The kernel's notice comes when the keeper thread exits; on a loaded machine the rest of
    # the process (SIGKILL still pending in another thread) can take a moment to become a
    # zombie, and until then /proc shows it running.
    deadline = time.monotonic() + 2.0
    while ring.peer_alive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not ring.peer_alive
    ring.close()


def test_death_wakes_an_untimed_sleeper_at_once_without_slices(shm_dir, procs):
    """The kernel's death notice (robust futex of the peer's keeper thread) wakes a waiter that sleeps
    with no timeout and one-minute slices: PeerDead in well under a slice."""
    ring = Ring.create(shm_dir, "notice", 64, role="consumer", spin_us=0, slice_ms=60_000)
    child = procs(_child_produce_then_die, shm_dir, "notice", 3, 0.5)
    assert [ring.pop(timeout=20).seq for _ in range(3)] == [0, 1, 2]
    t0 = time.monotonic()
    with pytest.raises(PeerDead, match=f"pid {child.pid}"):
        ring.pop(timeout=None)
    assert time.monotonic() - t0 < 5, "woken by the death notice, not by a 60 s slice"
    assert ring.stats()["sleeps"] >= 1
    ring.close()


def test_a_missed_death_notice_is_caught_by_the_keepers_watchdog(shm_dir, procs):
    ring = Ring.create(shm_dir, "missed", 16, role="consumer", spin_us=0, slice_ms=60_000)
    child = procs(_child_produce_hide_from_the_notice_then_die, shm_dir, "missed")
    assert ring.pop(timeout=20).seq == 0
    t0 = time.monotonic()
    with pytest.raises(PeerDead, match=f"pid {child.pid}"):
        ring.pop(timeout=20)
    assert time.monotonic() - t0 < 5, "the watchdog (1 s) woke the sleeper, not its 20 s timeout"
    ring.close()


@pytest.mark.parametrize("slice_ms", [100, 60_000])
def test_death_without_notices_is_found_by_slices(shm_dir, procs, slice_ms):
    """The fallback: a producer that holds its end without a death notice. The waiter reads the
    peer's /proc entry after each slice (100 ms), or once its own timeout ends (2 s < a 60 s slice),
    and raises PeerDead either way; no notice woke it early."""
    ring = Ring.create(shm_dir, "nonotice", 64, role="consumer", spin_us=0, slice_ms=slice_ms)
    child = procs(_child_produce_then_die_without_notices, shm_dir, "nonotice", 2, 0.3)
    assert [ring.pop(timeout=20).seq for _ in range(2)] == [0, 1]
    child.join(20)
    t0 = time.monotonic()
    with pytest.raises(PeerDead, match=f"pid {child.pid}"):
        ring.pop(timeout=2.0 if slice_ms > 2000 else None)
    waited = time.monotonic() - t0
    if slice_ms > 2000:
        assert 1.5 < waited < 10, "found at the end of the caller's timeout, by the /proc check"
    else:
        assert waited < 5
    ring.close()


def test_clean_close_wakes_an_untimed_sleeper_at_once(shm_dir, procs):
    ring = Ring.create(shm_dir, "bye-now", 16, role="consumer", spin_us=0, slice_ms=60_000)
    procs(_child_produce_and_close, shm_dir, "bye-now", 2)
    assert [ring.pop(timeout=20).seq for _ in range(2)] == [0, 1]
    t0 = time.monotonic()
    with pytest.raises(PeerClosed):
        ring.pop(timeout=None)
    assert time.monotonic() - t0 < 5
    ring.close()


def test_an_end_outlives_the_thread_that_attached_it(shm_dir, procs):
    """Death notices follow the process, not the attaching thread: after that thread exits the peer
    is still alive, sleeping waits keep working, and no PeerDead is reported."""
    ring = Ring.create(shm_dir, "threaded", 16, role="consumer", spin_us=0, slice_ms=60_000)
    attached, release = CTX.Event(), CTX.Event()
    procs(_child_attach_in_a_thread_then_hold, shm_dir, "threaded", attached, release)
    assert attached.wait(30)
    with pytest.raises(RingTimeout):
        ring.pop(timeout=0.3)  # quiet, not dead
    assert ring.peer_alive
    release.set()
    assert ring.pop(timeout=20).seq == 7  # sleeps (spin 0) and is woken by the push
    ring.close()


def test_descriptors_pushed_before_death_are_delivered_first(shm_dir, procs):
    ring = Ring.create(shm_dir, "leftovers", 64, role="consumer")
    child = procs(_child_produce_then_die, shm_dir, "leftovers", 5, 0.0)
    child.join(20)
    assert child.exitcode == -signal.SIGKILL
    assert [ring.pop(timeout=1).seq for _ in range(5)] == list(range(5))
    with pytest.raises(PeerDead):
        ring.pop(timeout=1)
    ring.close()


def test_consumer_killed_fails_blocked_push_with_peer_dead(shm_dir, procs):
    ring = Ring.create(shm_dir, "stuck", 4, role="producer")
    procs(_child_consume_then_die, shm_dir, "stuck", 2, 0.2)
    for i in range(6):  # 2 consumed, then 4 fill the ring
        ring.push(Kind.SPILL, i, timeout=20)
    t0 = time.monotonic()
    with pytest.raises(PeerDead):
        ring.push(Kind.SPILL, 6, timeout=10)
    assert time.monotonic() - t0 < 3
    with pytest.raises(PeerDead) as info:
        ring.push_batch(new_descs(3), timeout=1)
    assert info.value.done == 0
    ring.close()


def test_clean_close_gives_peer_closed_after_draining(shm_dir, procs):
    ring = Ring.create(shm_dir, "bye", 16, role="consumer")
    child = procs(_child_produce_and_close, shm_dir, "bye", 3)
    child.join(20)
    assert child.exitcode == 0
    assert [ring.pop(timeout=1).seq for _ in range(3)] == [0, 1, 2]
    with pytest.raises(PeerClosed, match="closed its end"):
        ring.pop(timeout=5)
    assert ring.peer.state == "closed"
    ring.close()


def test_end_of_a_dead_consumer_can_be_taken_over(shm_dir, procs):
    ring = Ring.create(shm_dir, "takeover", 16, role="producer")
    for i in range(8):
        ring.push(Kind.PROMOTE, i)
    child = procs(_child_consume_then_die, shm_dir, "takeover", 3, 0.0)
    child.join(20)
    gen_before = ring.peer.generation
    with Ring.attach(shm_dir, "takeover", role="consumer") as successor:
        assert ring.peer.generation > gen_before and ring.peer.pid == os.getpid()
        assert [successor.pop(timeout=1).seq for _ in range(5)] == [3, 4, 5, 6, 7]
    ring.close()


def test_live_end_cannot_be_attached_twice(shm_dir):
    with (
        Ring.create(shm_dir, "solo", 8, role="producer"),
        Ring.attach(shm_dir, "solo"),
        pytest.raises(RingBusy, match=f"pid {os.getpid()}"),
    ):
        Ring.attach(shm_dir, "solo", role="consumer")


def test_wrong_role_and_closed_ring_raise_clear_errors(shm_dir):
    p = Ring.create(shm_dir, "roles", 8, role="producer")
    c = Ring.attach(shm_dir, "roles", role="consumer")
    with pytest.raises(RingError, match="producer end"):
        p.try_pop()
    with pytest.raises(RingError, match="consumer end"):
        c.try_push(Kind.PIN, 1)
    c.close()
    c.close()  # idempotent
    with pytest.raises(RingError, match="closed"):
        c.try_pop()
    with pytest.raises(ValueError):
        Ring.create(shm_dir, "bad", 12)
    with pytest.raises(ValueError):
        Ring.create(shm_dir, "../escape", 8)
    with pytest.raises(TypeError):
        p.push_batch(np.zeros(4, dtype=np.uint64))
    p.close()


# ---------------------------------------------------------------- life cycle


def test_attach_from_an_unrelated_process_started_later(shm_dir, procs):
    """The creator is one child; the consumer is a sibling started after it (not its child)."""
    release = CTX.Event()
    procs(_child_create_push_hold, shm_dir, "sibling", 5, release)
    results = CTX.Queue()
    try:
        procs(_child_consume_all, shm_dir, "sibling", 5, results)
        got, after = results.get(timeout=30)
    finally:
        release.set()
    assert [(d[3], d[4]) for d in got] == [(i, i * 10) for i in range(5)]
    assert after is None


def test_files_are_private_and_removed_on_clean_close(shm_dir):
    bell = Doorbell.create(shm_dir, "bell")
    ring = Ring.create(shm_dir, "mine", 8, role="consumer", doorbell=bell)
    for path in (ring.path, bell.path):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert sorted(os.listdir(shm_dir)) == ["bell.bell", "mine.ring"]  # no temporary left behind
    peer = Ring.attach(shm_dir, "mine", role="producer")
    assert peer.doorbell_name == "bell"
    peer.close()
    assert os.path.exists(ring.path)  # the attacher does not remove it
    ring.close()
    bell.close()
    assert os.listdir(shm_dir) == []


def test_unlink_removes_the_name_but_attached_ends_keep_working(shm_dir):
    p = Ring.create(shm_dir, "gone", 8)
    c = Ring.attach(shm_dir, "gone")
    assert c.unlink()
    assert not os.path.exists(p.path)
    with pytest.raises(RingNotFound):
        Ring.attach(shm_dir, "gone", role="consumer")
    p.push(Kind.CLEAR, 1)
    assert c.pop(timeout=1).seq == 1
    c.close()
    p.close()


def test_stale_file_of_a_dead_creator_is_replaced(shm_dir, procs):
    ready = CTX.Event()
    child = procs(_child_create_and_die, shm_dir, "stale", ready)
    child.join(20)
    assert child.exitcode == -signal.SIGKILL
    path = os.path.join(shm_dir, "stale.ring")
    old_inode = os.stat(path).st_ino
    with pytest.raises(RingExists, match=f"stale.*pid {child.pid}"):
        Ring.create(shm_dir, "stale", 16, replace_stale=False)
    ring = Ring.create(shm_dir, "stale", 16, role="producer")
    assert os.stat(path).st_ino != old_inode
    bell = Doorbell.create(shm_dir, "stale")  # the doorbell it left is replaced too
    with Ring.attach(shm_dir, "stale") as c:
        ring.push(Kind.COMMIT, 5)
        assert c.pop(timeout=1).seq == 5
    ring.close()
    bell.close()
    assert os.listdir(shm_dir) == []


def test_creating_over_a_live_creator_names_its_pid(shm_dir, procs):
    ready, release = CTX.Event(), CTX.Event()
    child = procs(_child_create_and_hold, shm_dir, "taken", ready, release)
    try:
        assert ready.wait(30)
        with pytest.raises(RingExists, match=f"pid {child.pid}.*alive"):
            Ring.create(shm_dir, "taken", 16)
        assert [f for f in os.listdir(shm_dir) if f.endswith(".tmp")] == []
    finally:
        release.set()
    child.join(20)
    assert not os.path.exists(os.path.join(shm_dir, "taken.ring"))  # creator closed = removed


def test_attach_waits_for_a_ring_created_later(shm_dir):
    with pytest.raises(RingNotFound, match="not created"):
        Ring.attach(shm_dir, "nothing")
    t0 = time.monotonic()
    with pytest.raises(RingNotFound):
        Ring.attach(shm_dir, "nothing", wait=0.1)
    assert time.monotonic() - t0 >= 0.1


def test_proc_start_time_detects_pid_reuse():
    me = os.getpid()
    start = lib.hpkv_proc_start_time(me)
    assert start > 0
    assert lib.hpkv_proc_alive(me, start)
    assert not lib.hpkv_proc_alive(me, start + 1)  # same pid, another process
    assert not lib.hpkv_proc_alive(0x3FFFFFFF, 0)


# ---------------------------------------------------------------- model-based (hypothesis)


class RingModel(RuleBasedStateMachine):
    """Random push/pop/batch sequences must match a deque bounded at the capacity."""

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="hpkv-ring-model-", dir="/dev/shm")
        self.seq = 0

    @initialize(capacity=st.sampled_from([2, 4, 8, 16]))
    def make(self, capacity):
        self.cap = capacity
        self.p = Ring.create(self.dir, "model", capacity, role="producer")
        self.c = Ring.attach(self.dir, "model", role="consumer")
        self.model: deque[int] = deque()
        self.buf = new_descs(20)
        self.out = new_descs(20)

    @rule(a=st.integers(0, 2**64 - 1))
    def push_one(self, a):
        ok = self.p.try_push(Kind.PIN, self.seq, a)
        assert ok == (len(self.model) < self.cap)
        if ok:
            self.model.append((self.seq, a))
            self.seq += 1

    @rule()
    def pop_one(self):
        d = self.c.try_pop()
        if not self.model:
            assert d is None
        else:
            assert (d.seq, d.a0) == self.model.popleft()

    @rule(k=st.integers(0, 20))
    def push_many(self, k):
        _fill(self.buf, self.seq, k)
        n = self.p.push_batch(self.buf, k)
        assert n == min(k, self.cap - len(self.model))
        for j in range(n):
            self.model.append((self.seq + j, int(self.buf["arg"][j, 0])))
        self.seq += n

    @rule(k=st.integers(0, 20))
    def pop_many(self, k):
        n = self.c.pop_batch(self.out, k)
        assert n == min(k, len(self.model))
        for j in range(n):
            assert (int(self.out["seq"][j]), int(self.out["arg"][j, 0])) == self.model.popleft()

    @precondition(lambda self: hasattr(self, "p"))
    @invariant()
    def depth_matches(self):
        assert self.p.depth == len(self.model) == self.c.depth

    def teardown(self):
        if hasattr(self, "p"):
            self.c.close()
            self.p.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TestRingModel = RingModel.TestCase
TestRingModel.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# ---------------------------------------------------------------- benchmark


def test_bench_ring_json_reports_every_measurement(shm_dir):
    """A short `hpkv bench ring --json` run: every key the issue names, plus both placements."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpkv",
            "bench",
            "ring",
            "--json",
            "--iters",
            "400",
            "--rounds",
            "2",
            "--descs",
            "20000",
            "--mpq-descs",
            "2000",
            "--dir",
            shm_dir,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    for key in (
        "ring_rtt_busy_p50_us",
        "ring_rtt_sleep_p50_us",
        "sem_rtt_p50_us",
        "pipe_rtt_p50_us",
        "mpq_rtt_p50_us",
        "ring_dps_batch1",
        "ring_dps_batch32",
        "mpq_dps",
        "ring_rtt_sleep_same_cpu_p50_us",
        "sem_rtt_same_cpu_p50_us",
    ):
        assert res[key] > 0, key
    assert res["ring_rtt_busy_p50_us"] <= res["ring_rtt_busy_p99_us"]
    assert set(res["targets_met"]) >= {
        "ring_rtt_busy_p50_us",
        "ring_rtt_sleep_vs_sem",
        "ring_dps_batch32",
        "ring_batch32_vs_mpq",
    }
    assert "same_cpu" in res["placements"]
    assert os.listdir(shm_dir) == [], "the benchmark leaves no ring files behind"

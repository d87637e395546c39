"""Issue 28, items 1 and 2: storage on a file system that hangs, caches or loses files under
hpkv (a hard NFS mount whose server is gone, another node's evictor) degrades the storage
tier and never stalls the server.

A FUSE view (bindfs) of a directory stands in for the network mount: SIGSTOP of its daemon
hangs every call into the view as a dead NFS server does, and entry/attr/negative caching
gives NFS-like stale answers. "Another node" works in the real directory underneath. The
ESTALE a real NFS client gets for a file another client removed is injected into a live IO
worker with strace (this kernel has no NFS). Real ``hpkv serve`` processes throughout; every
daemon is continued and every mount unmounted in a fixture.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from test_storage import Writer, io_worker_pids, running  # the storage tests' real-process helpers

from hpkv.client import connect
from hpkv.engine.storage.catalog import VERIFY_TTL_S
from hpkv.io_workers import kvfile
from hpkv.protocol.keys import namespace_fingerprint
from hpkv.testing.mounts import bindfs_view, stopped
from hpkv.testing.server import private_env, status_json, wait_for

FP = namespace_fingerprint({"model": "shared-storage", "layers": 4})
SHARD = 64_000
NO_CACHE, NFS_LIKE = 0, 20  # seconds the view caches entries, attributes and missing names


@contextlib.contextmanager
def storage_view(tmp_path: Path, ttl: float):
    """(real storage directory, the storage directory seen through a bindfs view, its daemon)."""
    src, view = tmp_path / "src", tmp_path / "view"
    src.mkdir(mode=0o755)
    (src / "storage").mkdir(mode=0o700)
    with bindfs_view(src, view, ttl) as daemon:
        yield src / "storage", view / "storage", daemon


def timed(fn):
    t0 = time.monotonic()
    value = fn()
    return value, time.monotonic() - t0


def write_foreign_file(real: Path, key: bytes, rank: int = 0) -> None:
    """A KV file of the right size written by "another node" (a stat finds it; only a promote
    would read its header)."""
    path = Path(kvfile.file_path(str(real), FP, key, rank))
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(kvfile.file_size(SHARD))


def test_a_hung_mount_costs_a_lookup_its_bound_and_dram_hits_nothing(tmp_path):
    with storage_view(tmp_path, NO_CACHE) as (real, view, daemon):
        env = private_env(storage=str(view), HPKV_NUM_IO_WORKERS="1")
        with running(env) as srv:
            w = Writer(srv, shard=SHARD, fp=FP)
            stored = w.keys(range(10, 14))  # on storage only
            w.put(stored)
            w.wait_spilled(4)
            assert w.c.clear(w.ns.ns_id) == 4
            dram = w.keys(range(4))
            w.put(dram)
            w.wait_spilled(8)
            assert w.c.lookup(w.ns.ns_id, stored) == (4, [2] * 4)
            other = connect(srv.cfg, spawn=False, call_timeout=10.0)  # client 2: another engine
            ns2 = other.attach_namespace(FP, 1, SHARD, name="storage-test")
            assert other.lookup(ns2.ns_id, dram) == (4, [1] * 4)
            (unknown,) = w.keys(["written-by-another-node"])
            with stopped(daemon):
                # client 1: DRAM blocks and a key only a stat could find, which hangs
                got, took = timed(lambda: w.c.lookup(w.ns.ns_id, [*dram, unknown]))
                assert got == (4, [1] * 4), "the DRAM prefix, at the bound"
                assert took < 1.0, f"answered after {took:.3f}s (bound 5 ms)"
                # client 2: pure DRAM lookups keep their latency while the stat hangs
                worst = max(timed(lambda: other.lookup(ns2.ns_id, dram))[1] for _ in range(50))
                assert worst < 0.2, f"a DRAM lookup took {worst:.3f}s with the mount hung"
                # more unknown keys: each lookup is answered; the stat threads saturate
                for i in range(20):
                    got, took = timed(lambda i=i: w.c.lookup(w.ns.ns_id, [*dram, *w.keys([f"u{i}"])]))
                    assert got == (4, [1] * 4) and took < 1.0
                # a commit (its spill hangs in the IO worker) is answered at once too
                _, took = timed(lambda: w.put(w.keys(["new"])))
                assert took < 1.0
                write_foreign_file(real, unknown)  # another node writes a block meanwhile
                st = wait_for(
                    lambda: (s := status_json(env)["storage"])["state"] == "degraded" and s, 10, "degraded"
                )
                assert st["degraded_reason"] and st["degraded_since"]
                assert (
                    st["stat_saturated"] >= 1 and st["lookups_bounded"] >= 1 and st["stat_timeouts"] >= 1
                ), {
                    k: st[k]
                    for k in (
                        "stat_saturated",
                        "lookups_bounded",
                        "stat_timeouts",
                        "degraded_reason",
                        "degraded_misses",
                    )
                }
                worst = max(timed(lambda: other.lookup(ns2.ns_id, dram))[1] for _ in range(20))
                assert worst < 0.2, f"a DRAM lookup took {worst:.3f}s while degraded"
                # degraded: storage blocks are misses, and a promote of them does not wait
                assert w.c.lookup(w.ns.ns_id, [*dram, *stored]) == (4, [1] * 4)
                rows, took = timed(lambda: w.c.promote(w.ns.ns_id, stored, timeout=10.0))
                assert (rows == -1).all() and took < 1.0, took
                assert status_json(env)["storage"]["degraded_misses"] >= 5
            # continued: it recovers by itself and finds what was written meanwhile
            wait_for(lambda: status_json(env)["storage"]["state"] == "ok", 20, "recovery")
            wait_for(
                lambda: w.c.lookup(w.ns.ns_id, [*dram, unknown]) == (5, [1, 1, 1, 1, 2]),
                10,
                "the file written while the mount hung",
            )
            assert w.c.lookup(w.ns.ns_id, stored) == (4, [2] * 4), "storage hits again"
            w.check_rows(stored, w.c.promote(w.ns.ns_id, stored, timeout=10.0))
            assert "Traceback" not in srv.log()
            other.close()
            w.close()


def test_a_slow_stat_delays_a_storage_hit_for_a_caller_that_waits_instead_of_missing_it(tmp_path):
    """A mount that answers in 0.3 s (beyond the 5 ms bound, short of the 1 s that degrades):
    the lookup's answer says the block is unconfirmed, and a caller that asks again (vLLM's
    scheduler, SGLang's prefetch thread: HPKV_STORAGE_LOOKUP_RETRY_MS) gets the hit."""
    with storage_view(tmp_path, NO_CACHE) as (real, view, daemon):
        env = private_env(storage=str(view), HPKV_NUM_IO_WORKERS="1")
        with running(env) as srv:
            w = Writer(srv, shard=SHARD, fp=FP)
            (k,) = w.keys(["written-by-another-node"])
            write_foreign_file(real, k)
            with stopped(daemon):
                resume = threading.Timer(0.3, lambda: daemon.send_signal(signal.SIGCONT))
                resume.start()
                try:
                    got, took = timed(lambda: w.c.probe(w.ns.ns_id, [k]))
                    assert got == (0, [], True) and took < 0.2, (got, took)
                    got, took = timed(lambda: w.c.settled_lookup(w.ns.ns_id, [k], 5.0))
                    assert got == (1, [2]), "asked again until the stat returned: a hit"
                    assert took < 3.0, took
                finally:
                    resume.cancel()
            assert status_json(env)["storage"]["state"] == "ok"
            w.close()


def test_files_another_node_deleted_behind_a_caching_mount_are_misses_not_errors(tmp_path):
    with storage_view(tmp_path, NFS_LIKE) as (real, view, daemon):
        env = private_env(storage=str(view), HPKV_NUM_IO_WORKERS="1")
        with running(env) as srv:
            w = Writer(srv, shard=SHARD, fp=FP)
            keys = w.keys(range(3))
            w.put(keys)
            w.wait_spilled(3)
            assert w.c.clear(w.ns.ns_id) == 3
            time.sleep(VERIFY_TTL_S + 0.2)  # the lookup stats the files: the view caches them
            assert w.c.lookup(w.ns.ns_id, keys) == (3, [2] * 3)
            for k in keys:  # another node's evictor, in the real directory
                os.unlink(kvfile.file_path(str(real), FP, k, 0))
            # the view's caches still promise the files: the promote finds them gone
            rows = w.c.promote(w.ns.ns_id, keys, timeout=10.0)
            assert (rows == -1).all()
            s = w.storage()
            assert s["gone"] == 3 and s["io_errors"] == 0, s
            assert w.c.lookup(w.ns.ns_id, keys) == (0, []), "forgotten: recomputed, not promised again"
            log = srv.log()
            assert " ERROR " not in log, log[-3000:]
            assert "INFO hpkv.storage" in log and "another server or an operator removed" in log
            w.close()


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (scripts/setup.sh installs it)")
def test_estale_on_a_promote_means_the_file_is_gone(tmp_path):
    """Real ESTALE needs NFS (not in this kernel): strace makes the IO worker's opens fail with it."""
    from test_hardening_storage import _traced_by

    env = private_env(storage=str(tmp_path / "storage"), HPKV_NUM_IO_WORKERS="1")
    with running(env) as srv:
        w = Writer(srv, shard=SHARD, fp=FP)
        keys = w.keys(range(2))
        w.put(keys)
        w.wait_spilled(2)
        assert w.c.clear(w.ns.ns_id) == 2
        (pid,) = io_worker_pids(w)
        tracer = subprocess.Popen(
            ["strace", "-f", "-qq", "-o", os.devnull, "-e", "trace=openat,openat2",
             "-e", "inject=openat,openat2:error=ESTALE", "-p", str(pid)],
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        try:
            wait_for(lambda: _traced_by(pid, tracer.pid) or tracer.poll() is not None, 20, "strace attached")
            assert tracer.poll() is None, tracer.stderr.read() if tracer.stderr else ""
            rows = w.c.promote(w.ns.ns_id, keys, timeout=10.0)
        finally:
            tracer.terminate()
            tracer.wait(10)
        assert (rows == -1).all()
        s = w.storage()
        assert s["gone"] == 2 and s["io_errors"] == 0, s
        assert s["files"] == 0, "an ESTALE block does not stay stored"
        assert " ERROR " not in srv.log()
        # only the worker's opens were made to fail: the files are there, and a stat finds them
        wait_for(lambda: w.c.lookup(w.ns.ns_id, keys) == (2, [2, 2]), 10, "the files found again")
        w.close()


def test_a_server_stops_within_seconds_while_its_storage_mount_hangs(tmp_path):
    """The stop sequence ends within seconds (no spill drain into a hung mount, bounded joins).
    The process itself is reaped only when the mount answers if a stat thread sits in a FUSE
    request the daemon had already read (such a wait cannot be killed; on NFS it can)."""
    with storage_view(tmp_path, NO_CACHE) as (real, view, daemon):
        env = private_env(storage=str(view), HPKV_NUM_IO_WORKERS="1")
        with running(env) as srv:
            w = Writer(srv, shard=SHARD, fp=FP)
            w.put(w.keys(range(4)))
            w.wait_spilled(4)
            assert srv.proc is not None
            with stopped(daemon):
                w.c.lookup(w.ns.ns_id, w.keys(["unknown"]))  # a stat thread hangs
                w.put(w.keys(range(10, 14)))  # spills that hang in the IO worker
                w.wait_storage(lambda s: s["state"] == "degraded", 10, "degraded")
                w.close()
                t0 = time.monotonic()
                srv.proc.send_signal(signal.SIGTERM)
                wait_for(lambda: "stopped; pool, rings and stats removed" in srv.log(), 20, "the stop")
                took = time.monotonic() - t0
                log = srv.log()
                assert "not written to storage: it is degraded" in log, log[-3000:]
            assert srv.proc.wait(20) == 0, f"stopped in {took:.1f}s"

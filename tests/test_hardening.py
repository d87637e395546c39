"""Issue 14: no message kills the server, no other user reads or injects KV, no client
corrupts another's blocks. One section per defect of the issue, each with real
``hpkv serve`` processes (and, for the peer checks, a forked process of another uid).
"""

from __future__ import annotations

import errno
import grp
import json
import os
import signal
import socket
import stat
import time
from pathlib import Path

import numpy as np
import pytest

from hpkv.client import HpkvError, connect
from hpkv.common.pool import PoolFile
from hpkv.io_workers import kvfile
from hpkv.protocol import wire as P
from hpkv.protocol.errors import Status
from hpkv.protocol.keys import block_keys, namespace_fingerprint
from hpkv.testing.device import make_device
from hpkv.testing.server import (
    ServerProcess,
    assert_serves_correctly,
    client_of,
    control_call_as,
    private_env,
    serve_fails,
    start_under_umask,
    wait_for,
)

FP = namespace_fingerprint({"model": "hardening", "layers": 4})
NOBODY = 65534


class Raw:
    """A bare control connection: JSON lines in, JSON lines out, nothing checked."""

    def __init__(self, srv: ServerProcess, timeout: float = 10.0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(os.path.join(srv.pool_dir, P.SOCKET_FILE))
        self.f = self.sock.makefile("rb")

    def call(self, obj) -> dict:
        self.sock.sendall((obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n")
        line = self.f.readline()
        assert line, "the server closed the connection"
        return json.loads(line)

    def close(self) -> None:
        self.f.close()
        self.sock.close()


serves_correctly = assert_serves_correctly


# ------------------------------------------------------------------ 1. one message kills the server
def test_failing_hot_calls_are_answered_counted_and_the_server_keeps_serving(server):
    with client_of(server) as c:
        ns = c.attach_namespace(FP, 1, 8192)
        wide = c.attach_namespace(namespace_fingerprint({"model": "tp17"}), 17, 4096)
        keys = block_keys(FP, [b"a", b"b"])
        c.reserve(ns.ns_id, keys)
        errors0 = c.stats()["errors"]
        with pytest.raises(HpkvError, match="bad request"):
            c._rpc(P.COMMIT, ns.ns_id, keys, a2=1 << 45)  # MemoryError on 022d572
        with pytest.raises(HpkvError, match="bad request"):
            c._rpc(P.COMMIT, ns.ns_id, keys, a2=1)  # rank outside the world
        many = [bytes(16)] * P.MAX_KEYS_PER_CALL  # answer 17 x 8 B a key: too big
        with pytest.raises(HpkvError, match="too many keys"):
            c._rpc(P.PIN, wide.ns_id, many)  # ValueError on 022d572
        with pytest.raises(HpkvError, match="too many keys"):
            c._rpc(P.RESERVE, wide.ns_id, many)
        assert P.max_keys_per_call(17) * 17 * 8 <= P.MAILBOX_HALF
        # the client library splits such a call for an honest TP-17 engine
        assert c.pin(wide.ns_id, many).shape == (P.MAX_KEYS_PER_CALL, 17)
        with pytest.raises(HpkvError, match="bad request"):
            c._rpc(99, ns.ns_id, keys)  # unknown kind
        with pytest.raises(HpkvError, match="namespace not attached"):
            c._rpc(P.PIN, 1 << 63, keys)
        assert c.stats()["errors"] == errors0 + 6, "every failed call is counted"
        assert c.commit(ns.ns_id, keys) == 2, "the client that failed is still served"
    serves_correctly(server)


# ------------------------------------------------------------------ 2. fingerprints
@pytest.mark.parametrize(
    "fp", ["../../../../tmp/x", FP.upper(), FP[:-1], FP + "0", "", 12, None, FP[:-2] + "/."]
)
def test_a_fingerprint_that_is_not_32_lowercase_hex_is_refused_every_time_and_leaves_nothing(tmp_path, fp):
    storage = tmp_path / "storage"
    env = private_env(storage=str(storage))
    with ServerProcess(env) as srv, client_of(srv) as c:
        for _ in range(2):  # 022d572 refused the traversal once, then accepted it
            with pytest.raises(HpkvError, match="fingerprint"):
                c.attach_namespace(fp, 1, 8192)
        st = c.stats()
        assert st["namespaces"] == []
        assert sorted(p.name for p in storage.iterdir()) == [kvfile.QUARANTINE_DIR]
        ns = c.attach_namespace(FP, 1, 8192)
        assert ns.ns_id == 0, "a refused fingerprint used no namespace id"
        serves_correctly(srv)


# ------------------------------------------------------------------ 3. the pool directory
def _cleanup(env) -> None:
    import shutil

    shutil.rmtree(env["HPKV_SHARE_MEM_FILE_PATH"], ignore_errors=True)
    with __import__("contextlib").suppress(OSError):
        os.unlink(env["HPKV_CONFIG_FILE_PATH"])


def test_a_pool_directory_of_another_user_is_refused_with_what_to_do():
    env = private_env()
    d = env["HPKV_SHARE_MEM_FILE_PATH"]
    os.mkdir(d)
    try:
        os.chmod(d, 0o777)
        os.chown(d, NOBODY, NOBODY)  # created by another local user before us
        msg = serve_fails(env)
        assert f"{d} is owned by" in msg and "Have its owner (or root) remove it" in msg
        assert not (Path(d) / "pool").exists() and not (Path(d) / "server.sock").exists()
        with pytest.raises(HpkvError, match="refusing the hpkv server"):
            _fake_server_in(d, env)
    finally:
        _cleanup(env)


def _fake_server_in(d: str, env) -> None:
    """Another user's look-alike socket in their directory: the client must not say hello."""
    from hpkv.config import load_config

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(os.path.join(d, P.SOCKET_FILE))
    sock.listen(1)
    try:
        connect(load_config(env), spawn=False)
    finally:
        sock.close()


def test_a_pool_directory_writable_by_others_is_refused():
    env = private_env()
    d = env["HPKV_SHARE_MEM_FILE_PATH"]
    os.mkdir(d)
    try:
        os.chmod(d, 0o777)
        msg = serve_fails(env)
        assert "writable by its group or by others (mode 0777)" in msg and f"chmod go-w {d}" in msg
        os.chmod(d, 0o700)
        with ServerProcess(env) as srv:
            serves_correctly(srv)
    finally:
        _cleanup(env)


@pytest.mark.parametrize("name", [P.LOG_FILE, P.LOCK_FILE])
def test_lock_and_log_files_are_never_opened_through_a_symlink(tmp_path, name):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    env = private_env()
    d = env["HPKV_SHARE_MEM_FILE_PATH"]
    os.mkdir(d, 0o700)
    os.symlink(victim, os.path.join(d, name))
    srv = ServerProcess(env)
    try:
        if name == P.LOCK_FILE:
            with pytest.raises(RuntimeError, match="cannot start"):
                srv.start()
        else:
            srv.start()
            serves_correctly(srv)  # no log file, but serving
        assert victim.read_text() == "precious\n", "the symlink's target was written"
    finally:
        srv.cleanup()


_CLIENT_AS = """
import json, os, stat, sys
import hpkv.common.security
from hpkv.config import load_config
from hpkv.client import connect
from hpkv.protocol.keys import block_keys, namespace_fingerprint
cfg = load_config(json.loads(sys.argv[1]))
uid, gid = int(sys.argv[2]), int(sys.argv[3])
os.setgroups([]); os.setgid(gid); os.setuid(uid)      # everything imported: drop to the other user
try:
    with connect(cfg, spawn=False, call_timeout=10.0) as c:
        fp = namespace_fingerprint({"model": "group-member"})
        ns = c.attach_namespace(fp, 1, 8192)
        keys = block_keys(fp, [b"g"])
        c.reserve(ns.ns_id, keys)
        out = {"committed": c.commit(ns.ns_id, keys), "lookup": c.lookup(ns.ns_id, keys)[0]}
except BaseException as exc:
    out = {"child_error": repr(exc)}
print(json.dumps(out))
"""


def _client_as(srv: ServerProcess, uid: int, gid: int) -> dict:
    """A fresh process that becomes uid/gid and uses the server as a real client (hello,
    namespace, rings). Not a fork of pytest: a forked child would share this process's ring
    state (its keeper thread does not survive the fork)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _CLIENT_AS, json.dumps(srv.env), str(uid), str(gid)],
        env=srv.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _hello_as(srv: ServerProcess, uid: int, gid: int, op: str = "hello") -> dict:
    """One control call (``op``, hello by default) as uid/gid; the server's answer."""
    return control_call_as(srv, uid, gid, {"op": op, "pid": os.getpid()})


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
@pytest.mark.parametrize("allow", [False, True], ids=["same-uid-only", "allowed-group"])
def test_socket_peers_of_another_uid_are_refused_unless_in_the_allowed_group(allow):
    group = grp.getgrnam("staff").gr_gid  # an existing group: HPKV_ALLOW_GROUP must name one
    env = private_env(**({"HPKV_ALLOW_GROUP": str(group)} if allow else {}))
    with ServerProcess(env) as srv:
        if allow:  # the server opened the directory and socket to the group, nothing more
            assert stat.S_IMODE(os.stat(srv.pool_dir).st_mode) == 0o710
            assert os.stat(os.path.join(srv.pool_dir, P.SOCKET_FILE)).st_gid == group
        else:  # let the other user reach the socket at all, so SO_PEERCRED is what refuses
            os.chmod(srv.pool_dir, 0o711)
            os.chmod(os.path.join(srv.pool_dir, P.SOCKET_FILE), 0o666)
        answer = _hello_as(srv, NOBODY, group)
        if allow:
            assert answer.get("ok") is True, answer
            assert _client_as(srv, NOBODY, group) == {"committed": 1, "lookup": 1}
        else:
            assert answer.get("ok") is False and "may not use this hpkv server" in answer["error"], answer
            assert "refused a connection from pid" in srv.log() and f"(uid {NOBODY}" in srv.log()
        if not allow:
            assert _hello_as(srv, NOBODY, group + 1).get("ok") is False
        serves_correctly(srv)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_a_group_member_may_use_the_server_but_not_stop_it():
    """Issue 26 item 8: what HPKV_ALLOW_GROUP grants is stated in docs/security.md; stopping the
    server (and its drain) stays with the user who runs it."""
    group = grp.getgrnam("users").gr_gid  # an existing group other than the test above's
    with ServerProcess(private_env(HPKV_ALLOW_GROUP=str(group))) as srv:
        answer = _hello_as(srv, NOBODY, group, op="shutdown")
        assert answer.get("ok") is False and answer["status"] == -errno.EACCES, answer
        assert f"only uid {os.geteuid()}" in answer["error"], answer
        assert "refused a stop from pid" in srv.log()
        serves_correctly(srv)
        assert srv.proc is not None and srv.proc.poll() is None, "a group member stopped the server"


# ------------------------------------------------------------------ 4. KV file permissions
def test_kv_files_are_0600_and_directories_0700_whatever_the_umask(tmp_path):
    storage = tmp_path / "made-by-hpkv" / "storage"
    env = private_env(storage=str(storage))
    srv = start_under_umask(env, 0)
    try:
        with client_of(srv) as c:
            ns = c.attach_namespace(FP, 2, 8192, rank=0)
            with client_of(srv) as r1:
                r1.attach_namespace(FP, 2, 8192, rank=1)
                keys = block_keys(FP, [b"%d" % i for i in range(6)])
                c.reserve(ns.ns_id, keys)
                c.commit(ns.ns_id, keys, rank=0)
                r1.commit(ns.ns_id, keys, rank=1)
                wait_for(lambda: c.stats()["storage"]["spills"] >= 12, timeout=60, what="12 spills")
        files = [p for p in storage.rglob("*") if p.is_file()]
        dirs = [storage, *[p for p in storage.rglob("*") if p.is_dir()]]
        assert len([p for p in files if p.suffix == ".kv"]) == 12
        assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {"0o600"}
        assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in dirs} == {"0o700"}
        assert stat.S_IMODE(os.stat(srv.pool_dir).st_mode) == 0o700
    finally:
        srv.cleanup()


# ------------------------------------------------------------------ 5. phantom pins
def test_a_pin_of_a_block_not_in_dram_pins_nothing_and_cannot_release_another_clients_pin(server):
    with client_of(server) as writer, client_of(server) as loader, client_of(server) as other:
        ns = writer.attach_namespace(FP, 1, 8192)
        other.attach_namespace(FP, 1, 8192)
        (k,) = block_keys(FP, [b"shared"])
        writer.reserve(ns.ns_id, [k])
        assert (other.pin(ns.ns_id, [k]) == -1).all(), "reserved, not loadable"
        writer.commit(ns.ns_id, [k])
        assert (loader.pin(ns.ns_id, [k]) >= 0).all()  # the real pin
        other.unpin(ns.ns_id, [k])  # released loader's pin on 022d572
        assert other.stats()["pool"]["pinned_bytes"] == 8192
        other.close()  # ... and so did a disconnect
        time.sleep(0.3)
        assert writer.stats()["pool"]["pinned_bytes"] == 8192
        loader.unpin(ns.ns_id, [k])
        assert writer.stats()["pool"]["pinned_bytes"] == 0


# ------------------------------------------------------------------ 6. reservations
def test_commit_or_abort_of_another_clients_reservation_is_refused(server):
    with client_of(server) as owner, client_of(server) as stranger, client_of(server) as rank0:
        ns = owner.attach_namespace(FP, 1, 8192)
        stranger.attach_namespace(FP, 1, 8192)
        rank0.attach_namespace(FP, 1, 8192, rank=0)  # a writer of the namespace
        keys = block_keys(FP, [b"r%d" % i for i in range(3)])
        owner.reserve(ns.ns_id, keys)
        with pytest.raises(HpkvError, match="belongs to another client"):
            stranger.commit(ns.ns_id, keys[:1])
        with pytest.raises(HpkvError, match="belongs to another client"):
            stranger.abort(ns.ns_id, keys[1:2])
        assert owner.lookup(ns.ns_id, keys)[0] == 0
        assert owner.stats()["namespaces"][0]["blocks_reserved"] == 3
        assert rank0.commit(ns.ns_id, keys[:1]) == 1  # the rank's worker commits
        assert owner.commit(ns.ns_id, keys[1:2]) == 1
        owner.abort(ns.ns_id, keys[2:])
        wait_for(lambda: owner.stats()["namespaces"][0]["blocks_reserved"] == 0, what="abort")
        assert owner.lookup(ns.ns_id, keys)[0] == 2


def test_a_dead_owners_queued_saves_never_land_in_its_slots_once_they_are_handed_out_again(tmp_path):
    # Issue 26 item 3 changed the contract: the slots are free at once (no wait for the queued
    # copies, no grace); the queued saves made for them are refused by the slot fence.
    layers, blocks, page = 8, 32, 256 * 1024  # 2 MiB blocks, 64 MiB a batch
    dev = make_device(tmp_path, layers, blocks, page)
    dev.fill_random(np.random.default_rng(3))
    jobs = P.JOB_SLOTS  # 4 GiB of copies queued at once
    with (
        ServerProcess(private_env(pool_size="128m")) as srv,
        client_of(srv) as worker,
        client_of(srv) as newcomer,
    ):
        sched = client_of(srv)
        ns = sched.attach_namespace(FP, 1, layers * page)
        worker.attach_namespace(FP, 1, layers * page, rank=0)
        newcomer.attach_namespace(FP, 1, layers * page)
        handle = worker.register_device(ns.ns_id, rank=0, **dev.spec)
        keys = block_keys(FP, [b"s%d" % i for i in range(blocks)])
        offsets = sched.reserve(ns.ns_id, keys)[:, 0]
        assert (offsets >= 0).all()
        blk = np.arange(blocks)
        (w,) = wait_for(lambda: [x for x in worker.stats()["workers"] if x["state"] == "running"])
        os.kill(w["pid"], signal.SIGSTOP)  # the saves stay queued (the forced order, made certain)
        try:
            tickets = [t for _ in range(jobs) for t in handle.submit(P.COPY_SAVE, blk, offsets)]
            sched.close()  # the scheduler goes away while its worker's saves are queued
            wait_for(lambda: len(worker.stats()["clients"]) == 2, what="the scheduler's drop")
            mine = P.slot_offset(
                newcomer.reserve(ns.ns_id, block_keys(FP, [b"n%d" % i for i in range(2 * blocks)]))[:, 0]
            )
            assert worker.stats()["workers"][0]["jobs"] == 0, "a save ran before the slots were reused"
        finally:
            os.kill(w["pid"], signal.SIGCONT)
        got = mine[mine >= 0]
        assert len(got) == 2 * blocks, "the dead owner's slots were not handed out again at once"
        pool = PoolFile.attach(os.path.join(srv.pool_dir, P.POOL_FILE))
        try:
            for off in got:
                pool.array[off : off + layers * page] = 0xA5
            res = handle.wait(tickets, timeout=120)
            assert set(res.values()) == {Status.STALE_SLOT}, res
            for off in got:
                assert (pool.array[off : off + layers * page] == 0xA5).all(), f"a late save landed at {off}"
        finally:
            pool.close()
        assert worker.commit(ns.ns_id, keys) == 0, "a released reservation is not committed"
        assert worker.lookup(ns.ns_id, keys)[0] == 0
        wait_for(
            lambda: worker.stats()["pool"]["used_bytes"] == len(got) * layers * page,
            what="only the newcomer's reservations hold slots",
        )


# ------------------------------------------------------------------ 7. stalled clients
def test_a_client_that_never_reads_is_dropped_and_never_blocks_the_others(server):
    hog = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    hog.connect(os.path.join(server.pool_dir, P.SOCKET_FILE))
    hog.settimeout(30)
    try:
        hog.sendall(b'{"op": "stats"}\n' * 8000)  # ~12 MB of replies it never reads
        t0 = time.monotonic()
        with client_of(server) as c:  # 022d572: blocked in sendall forever
            assert c.stats()["clients"]
        assert time.monotonic() - t0 < 10
        wait_for(lambda: "does not read its control replies" in server.log(), what="the drop log line")
    finally:
        hog.close()
    serves_correctly(server)


def test_an_endless_control_line_is_capped_and_the_client_dropped(server):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(os.path.join(server.pool_dir, P.SOCKET_FILE))
    s.settimeout(30)
    chunk = b"x" * 65536
    t0 = time.monotonic()
    try:
        for _ in range(64):  # 4 MiB, no newline
            s.sendall(chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass
    try:
        assert s.recv(10) == b"", "the connection is closed"
    except ConnectionResetError:
        pass
    s.close()
    assert time.monotonic() - t0 < 20
    assert "control line longer than" in server.log()
    serves_correctly(server)


# ------------------------------------------------------------------ 8. device registration
@pytest.mark.parametrize(
    "bad,match",
    [
        ({"regions": [{"path": "REGION", "size": 1 << 30}]}, "the file's real size"),
        ({"layer_bases": [[0, 4096 * 15]] * 4}, "reaches past the region"),
        ({"layer_bases": [[7, 0]] * 4}, "reaches past the region"),
        ({"layer_bases": [[0, -4096]] * 4}, "reaches past the region"),
        ({"num_blocks": 10**6}, "reaches past the region"),
        ({"page_bytes": 8192}, "page_bytes"),
        ({"layer_bases": [[0, 0]] * 8}, "do not fit the namespace's"),
        ({"regions": [{"path": "/dev/zero"}]}, "not a regular file"),
        ({"block_stride": "4096"}, "block_stride"),
    ],
    ids=[
        "size",
        "offset",
        "region-index",
        "negative",
        "num-blocks",
        "page>stride",
        "too-many-layers",
        "not-a-file",
        "type",
    ],
)
def test_a_device_layout_outside_its_regions_is_refused_before_any_worker_starts(
    server, tmp_path, bad, match
):
    dev = make_device(tmp_path, layers=4, blocks=16, page=4096)
    spec = {**dev.spec, **bad}
    spec["regions"] = [
        dict(r, path=dev.spec["regions"][0]["path"]) if r.get("path") == "REGION" else r
        for r in spec["regions"]
    ]
    with client_of(server) as c:
        ns = c.attach_namespace(FP, 1, 4 * 4096)
        with pytest.raises(HpkvError, match=match):
            c.register_device(ns.ns_id, rank=0, **spec)
        assert c.stats()["workers"] == []
    serves_correctly(server)


def test_a_worker_that_keeps_failing_is_restarted_with_back_off_and_reported(server, tmp_path):
    dev = make_device(tmp_path, layers=4, blocks=16, page=4096)
    with client_of(server) as c:
        ns = c.attach_namespace(FP, 1, 4 * 4096)
        c.register_device(ns.ns_id, rank=0, **dev.spec)
        (w,) = wait_for(
            lambda: [w for w in c.stats()["workers"] if w["state"] == "running"], what="worker running"
        )
        for r in dev.spec["regions"]:
            os.unlink(r["path"])  # every restart now fails at start-up (region missing)
        os.kill(w["pid"], signal.SIGKILL)
        seen = set()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 6:
            seen.add(c.stats()["workers"][0]["state"])
            time.sleep(0.05)
        (w,) = c.stats()["workers"]
        assert "backoff" in seen, seen
        assert 1 <= w["restarts"] <= 6, f"{w['restarts']} restarts in 6 s (022d572: one per 0.2 s)"
        out = json.loads(
            __import__("subprocess")
            .run(
                [__import__("sys").executable, "-m", "hpkv", "status", "--json"],
                env=server.env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            .stdout
        )
        assert out["workers"][0]["restarts"] == w["restarts"] or out["workers"][0]["restarts"] >= 1
        assert "next start in" in server.log()
    serves_correctly(server)


# ------------------------------------------------------------------ 9. client records
def test_a_second_hello_on_one_connection_is_refused_and_leaks_nothing(server):
    raw = Raw(server)
    try:
        first = raw.call({"op": "hello", "pid": os.getpid()})
        assert first["ok"]
        for _ in range(5):
            again = raw.call({"op": "hello", "pid": os.getpid()})
            assert not again["ok"] and f"client {first['client_id']} already" in again["error"]
        with client_of(server) as c:
            assert len(c.stats()["clients"]) == 2
            assert len([n for n in os.listdir(server.pool_dir) if n.endswith(".mbox")]) == 2
    finally:
        raw.close()
    with client_of(server) as c:
        wait_for(lambda: len(c.stats()["clients"]) == 1, what="the raw client dropped")


@pytest.mark.parametrize("pid", [0, -1, 1 << 40, 2**64, "1", True, 1.5, None])
def test_a_hello_with_a_pid_no_process_can_have_is_refused(server, pid):
    raw = Raw(server)
    try:
        msg = {"op": "hello"} if pid is None else {"op": "hello", "pid": pid}
        answer = raw.call(msg)
        if pid is None:  # no pid given: the socket's peer pid is used
            assert answer["ok"]
        else:
            assert not answer["ok"] and "is not a process id" in answer["error"]
        time.sleep(0.5)  # a supervisor round with whatever was registered
    finally:
        raw.close()
    serves_correctly(server)
    with client_of(server) as c:
        wait_for(lambda: len(c.stats()["clients"]) == 1, what="no leaked client")


# ------------------------------------------------------------------ 10. lifetime limits and leases
def test_namespaces_without_clients_are_released_so_ids_never_run_out(server):
    fps = [namespace_fingerprint({"model": "ns-churn", "i": i}) for i in range(80)]
    for i, fp in enumerate(fps):
        with client_of(server) as c:
            ns = c.attach_namespace(fp, 1, 4096, name=f"m{i}")
            (k,) = block_keys(fp, [b"x"])
            c.reserve(ns.ns_id, [k])
            c.commit(ns.ns_id, [k])
            assert c.lookup(ns.ns_id, [k])[0] == 1
    with client_of(server) as c:
        st = c.stats()
        assert len(st["namespaces"]) <= 64
        # the newest namespace is still there with its block, for an engine that comes back
        ns = c.attach_namespace(fps[-1], 1, 4096)
        assert c.lookup(ns.ns_id, block_keys(fps[-1], [b"x"]))[0] == 1
        assert "released: no client attached" in server.log()
        assert st["pool"]["used_bytes"] == sum(n["bytes_dram"] for n in st["namespaces"])
    serves_correctly(server)


def test_leases_release_a_hung_clients_pins_and_reservations():
    env = private_env(HPKV_LEASE_S="1")
    with ServerProcess(env) as srv, client_of(srv) as hung:
        ns = hung.attach_namespace(FP, 1, 8192)
        keys = block_keys(FP, [b"l%d" % i for i in range(4)])
        hung.reserve(ns.ns_id, keys)
        hung.commit(ns.ns_id, keys[:2])
        hung.pin(ns.ns_id, keys[:2])
        s = hung.stats()
        assert s["pool"]["pinned_bytes"] == 2 * 8192 and s["namespaces"][0]["blocks_reserved"] == 2
        # the client stays connected but does nothing (a hung engine)
        wait_for(
            lambda: (lambda s: s["pool"]["pinned_bytes"] == 0 and s["namespaces"][0]["blocks_reserved"] == 0)(
                hung.stats()
            ),
            timeout=15,
            what="leases expired",
        )
        assert hung.stats()["pool"]["used_bytes"] == 2 * 8192, "only the READY blocks hold slots"
        hung.unpin(ns.ns_id, keys[:2])  # late unpin: harmless
        assert hung.stats()["pool"]["pinned_bytes"] == 0
        assert "HPKV_LEASE_S=1s: released" in srv.log()


def test_bad_calls_are_logged_with_a_rate_limit(server):
    with client_of(server) as c:
        ns = c.attach_namespace(FP, 1, 8192)
        keys = block_keys(FP, [b"z"])
        for _ in range(300):
            with pytest.raises(HpkvError):
                c._rpc(P.COMMIT, ns.ns_id, keys, a2=1 << 45)
        raw = Raw(server)
        for _ in range(300):
            assert not raw.call(b"{not json")["ok"]
        raw.close()
        assert c.stats()["errors"] >= 600, "failed hot and control calls are counted"
    log = server.log()
    assert log.count("bad COMMIT call") <= 2
    assert log.count("bad control call") <= 2


def test_a_kv_file_deleted_from_outside_is_no_longer_reported_as_a_hit(tmp_path):
    env = private_env(storage=str(tmp_path / "st"))
    with ServerProcess(env) as srv, client_of(srv) as c:
        ns = c.attach_namespace(FP, 1, 8192)
        keys = block_keys(FP, [b"d%d" % i for i in range(5)])
        c.reserve(ns.ns_id, keys)
        c.commit(ns.ns_id, keys)
        wait_for(lambda: c.stats()["storage"]["spills"] >= 5, timeout=60, what="spills")
        assert c.clear(ns.ns_id) == 5
        assert c.lookup(ns.ns_id, keys) == (5, [2] * 5)
        time.sleep(2.1)  # past the verification's memo
        os.unlink(kvfile.file_path(str(tmp_path / "st"), FP, keys[2], 0))
        assert c.lookup(ns.ns_id, keys) == (2, [2, 2]), "022d572: still 5 until a promote failed"
        assert c.stats()["storage"]["files"] == 4


def test_the_quarantine_is_bounded_by_count_and_age(tmp_path):
    from hpkv.engine.storage.upkeep import QUARANTINE_MAX_FILES

    storage = tmp_path / "st"
    q = storage / kvfile.QUARANTINE_DIR
    q.mkdir(parents=True)
    os.chmod(storage, 0o700)
    now = time.time()
    for i in range(QUARANTINE_MAX_FILES + 20):
        p = q / f"{i:032x}-r0.kv.{i}"
        p.write_bytes(b"bad")
        os.utime(p, (now - 1000 + i, now - 1000 + i))
    ancient = q / "ancient.kv.1"
    ancient.write_bytes(b"bad")
    os.utime(ancient, (now - 30 * 86400, now - 30 * 86400))
    with ServerProcess(private_env(storage=str(storage))) as srv:
        serves_correctly(srv)
        left = sorted(p.name for p in q.iterdir())
        assert len(left) == QUARANTINE_MAX_FILES and "ancient.kv.1" not in left
        assert f"{0:032x}-r0.kv.0" not in left, "the oldest went first"

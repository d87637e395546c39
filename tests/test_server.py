"""The hpkv server as real processes: single instance, auto-spawn, protocol, transfer workers, clean-up."""

from __future__ import annotations

import contextlib
import errno
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import psutil
import pytest

from hpkv.client import HpkvUnavailable, connect, ensure_server
from hpkv.common.numa import spread_cpus
from hpkv.common.pool import PoolFile
from hpkv.config import load_config
from hpkv.protocol import wire as P
from hpkv.protocol.errors import Status
from hpkv.protocol.keys import block_keys, namespace_fingerprint
from hpkv.protocol.stats import StatsSegment, W, WorkerState
from hpkv.testing.device import make_device
from hpkv.testing.server import ServerProcess, env_without_hpkv, private_env
from hpkv.transfer_workers.worker import MAX_COPY_THREADS

FP = namespace_fingerprint({"model": "test", "layers": 4})


def client_of(srv: ServerProcess, **kw):
    return connect(srv.cfg, spawn=False, **kw)


def hpkv_cli(env, *args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "hpkv", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


# ------------------------------------------------------------------ single instance
def test_second_server_on_the_same_directory_names_the_running_pid(server):
    out = subprocess.run(
        [sys.executable, "-m", "hpkv", "serve"], env=server.env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0
    assert f"already served by pid {server.proc.pid}" in out.stderr


def test_lock_of_a_killed_server_is_taken_over_and_its_files_cleaned():
    env = private_env()
    first = ServerProcess(env).start()
    second = ServerProcess(env)
    try:
        with client_of(first) as c:
            c.attach_namespace(FP, 1, 65536)
        first.kill()  # SIGKILL: no clean-up
        left = set(os.listdir(first.pool_dir))
        assert {"pool", "stats", "server.sock", "server.lock"} <= left
        second.start()
        assert f"took over the pool directory {first.pool_dir} from pid {first.proc.pid}" in second.log()
        with client_of(second) as c:
            assert c.server_pid == second.proc.pid
            assert c.stats()["namespaces"] == []
    finally:
        first.cleanup()
        second.cleanup()


def test_sigterm_stops_workers_and_leaves_no_files(server, tmp_path):
    with client_of(server) as c:
        ns = c.attach_namespace(FP, 1, 4 * 4096)
        dev = make_device(tmp_path, layers=4, blocks=8, page=4096)
        c.register_device(ns.ns_id, rank=0, **dev.spec)
        worker_pids = [w["pid"] for w in c.stats()["workers"]]
    assert worker_pids and all(psutil.pid_exists(p) for p in worker_pids)
    assert server.terminate() == 0
    assert sorted(os.listdir(server.pool_dir)) == ["server.log"]
    deadline = time.monotonic() + 10
    while any(_running(p) for p in worker_pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_running(p) for p in worker_pids)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ------------------------------------------------------------------ auto-spawn
def _connect_and_report(env, q):
    cfg = load_config(env)
    c = connect(cfg, env=env, timeout=60)
    q.put(c.server_pid)
    time.sleep(1.0)  # stay attached while the others connect
    c.close()


def test_concurrent_auto_spawn_ends_with_exactly_one_server():
    env = private_env(HPKV_SERVER_IDLE_EXIT="2")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_connect_and_report, args=(env, q)) for _ in range(4)]
    try:
        for p in procs:
            p.start()
        pids = {q.get(timeout=90) for _ in procs}
        assert len(pids) == 1
        (pid,) = pids
        server = psutil.Process(pid)
        assert os.getpgid(pid) == pid, "the auto-spawned server runs in its own process group"
        assert os.getsid(pid) == os.getsid(0), (
            "it stays in the engine's session: its scheduling group where the kernel groups by "
            "session, so its idle-priority work stays idle next to the engine"
        )
        assert server.ppid() not in {p.pid for p in procs}, (
            "the auto-spawned server is no descendant of its spawner (it detaches)"
        )
        assert "serve" in server.cmdline() and "--auto" in server.cmdline()
        for p in procs:
            p.join(30)
        # idle for HPKV_SERVER_IDLE_EXIT seconds with no clients: it exits and cleans up
        server.wait(timeout=30)
        assert sorted(os.listdir(env["HPKV_SHARE_MEM_FILE_PATH"])) == ["server.log"]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        ServerProcess(env).cleanup()
        for proc in psutil.process_iter(["cmdline", "environ"]):
            try:
                if (
                    "--auto" in (proc.info["cmdline"] or [])
                    and (proc.info["environ"] or {}).get("HPKV_SHARE_MEM_FILE_PATH")
                    == env["HPKV_SHARE_MEM_FILE_PATH"]
                ):
                    proc.kill()
            except psutil.Error:
                pass


def _new_user_env(home, **extra: str) -> dict[str, str]:
    """No config file, no hpkv variables but an isolated pool directory (and ``extra``)."""
    env = env_without_hpkv()
    env.update(
        HOME=str(home), HPKV_SHARE_MEM_FILE_PATH=f"/dev/shm/hpkv-test-{uuid.uuid4().hex[:12]}", **extra
    )
    return env


def test_auto_spawn_without_a_config_file_works_and_stop_leaves_only_the_log(tmp_path):
    env = _new_user_env(tmp_path, HPKV_KV_MEM_POOL_SIZE="64m")
    try:
        c = connect(load_config(env), env=env, timeout=60)
        pid = c.server_pid
        assert c.pool_size == 64 << 20
        assert c.storage == str(tmp_path / ".cache/hpkv/storage"), "the default storage path"
        c.close()
        stop = subprocess.run(
            [sys.executable, "-m", "hpkv", "stop"], env=env, capture_output=True, text=True, timeout=120
        )
        assert stop.returncode == 0 and f"hpkv: server {pid} stopped; nothing was pending" in stop.stdout, (
            stop
        )
        assert os.listdir(env["HPKV_SHARE_MEM_FILE_PATH"]) == ["server.log"]
    finally:
        ServerProcess(env).cleanup()


def test_an_engine_can_start_the_server_early_and_attach_later_to_the_same_one(tmp_path):
    """The vLLM worker starts the server when it is constructed (the pool warms while vLLM
    compiles) and attaches at KV-cache registration: one server, no client until then."""
    env = _new_user_env(tmp_path, HPKV_KV_MEM_POOL_SIZE="64m")
    cfg = load_config(env)
    try:
        ensure_server(cfg, env=env)
        ensure_server(cfg, env=env)  # finds it
        status = json.loads(
            subprocess.run(
                [sys.executable, "-m", "hpkv", "status", "--json"], env=env, capture_output=True, timeout=60
            ).stdout
        )
        assert status["clients"] == [], "starting it attaches nothing"
        with connect(cfg, env=env, spawn=False) as c:
            assert c.server_pid == status["server"]["pid"]
    finally:
        ServerProcess(env).cleanup()


def test_an_engine_that_holds_the_server_keeps_it_past_its_idle_exit(tmp_path):
    """vLLM starts the server early and may compile for longer than HPKV_SERVER_IDLE_EXIT
    before it attaches: its hold keeps the server (and the pool's contents) until it ends."""
    env = _new_user_env(tmp_path, HPKV_KV_MEM_POOL_SIZE="64m", HPKV_SERVER_IDLE_EXIT="1")
    cfg = load_config(env)
    try:
        hold = ensure_server(cfg, env=env, hold="test start-up")
        pid = P.live_server_pid(cfg.pool_dir)
        status = hpkv_cli(env, "status")
        assert "HELD BY" in status.stdout and f"{os.getpid()}  test start-up" in status.stdout, status.stdout
        time.sleep(3.5)  # past the idle exit, and two supervisor rounds
        assert P.live_server_pid(cfg.pool_dir) == pid, "a held server stays"
        with connect(cfg, env=env, spawn=False) as c:  # the engine attaches late, same server
            assert c.server_pid == pid
        hold.close()
        psutil.Process(pid).wait(timeout=30)  # no client, no hold: idle exit
        log = ServerProcess(env).log()
        assert f"pid {os.getpid()} (test start-up) holds the server: no idle exit while it runs" in log
        assert "(test start-up) released its hold" in log
    finally:
        ServerProcess(env).cleanup()


@pytest.mark.parametrize("leaving", ["refuses", "resets"])
def test_connect_waits_out_a_stopping_server_and_starts_a_new_one(tmp_path, leaving):
    """A server that is exiting (an idle exit, `hpkv stop`) as a client reaches it refuses the
    hello or drops the connection: connect() waits until it is gone and starts a new one."""
    import fcntl
    import socket
    import threading

    from hpkv.protocol.errors import refusal

    env = _new_user_env(tmp_path, HPKV_KV_MEM_POOL_SIZE="64m")
    cfg = load_config(env)
    os.makedirs(cfg.pool_dir, mode=0o700)
    lock_fd = os.open(os.path.join(cfg.pool_dir, P.LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    os.write(lock_fd, str(os.getpid()).encode())
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(cfg.pool_dir, P.SOCKET_FILE))
    listener.listen(4)
    exited_at: list[float] = []

    def exiting_server() -> None:
        conn, _ = listener.accept()
        if leaving == "refuses":
            conn.recv(4096)
            conn.sendall(
                json.dumps(refusal(-errno.ESHUTDOWN, "the hpkv server is stopping")).encode() + b"\n"
            )
        conn.close()  # "resets": closed with the hello unread
        time.sleep(0.5)
        listener.close()
        os.unlink(os.path.join(cfg.pool_dir, P.SOCKET_FILE))
        exited_at.append(time.monotonic())
        os.close(lock_fd)

    t = threading.Thread(target=exiting_server, daemon=True)
    t.start()
    try:
        with connect(cfg, env=env, timeout=60) as c:
            assert exited_at and c.server_pid != os.getpid(), "a new server, started after the old one left"
            assert P.live_server_pid(cfg.pool_dir) == c.server_pid
    finally:
        t.join(10)
        ServerProcess(env).cleanup()


def test_a_spawned_server_that_cannot_start_says_why_in_the_exception_and_its_log(tmp_path):
    env = _new_user_env(tmp_path, HPKV_KV_MEM_POOL_SIZE="1t")  # more than /dev/shm has
    try:
        t0 = time.monotonic()
        with pytest.raises(
            HpkvUnavailable,
            match=r"could not start: .*HPKV_KV_MEM_POOL_SIZE=1t.*lower the "
            r"pool size or free space.*log: .*server\.log",
        ):
            connect(load_config(env), env=env, timeout=60)
        assert time.monotonic() - t0 < 30, "a failed start is reported at once, not after the timeout"
        with open(os.path.join(env["HPKV_SHARE_MEM_FILE_PATH"], "server.log")) as f:
            assert "cannot start: HPKV_KV_MEM_POOL_SIZE=1t (from environment)" in f.read()
        assert sorted(os.listdir(env["HPKV_SHARE_MEM_FILE_PATH"])) == ["server.log"]
    finally:
        ServerProcess(env).cleanup()


def test_the_spawner_refuses_a_pool_directory_others_can_write_and_starts_nothing(tmp_path):
    env = _new_user_env(tmp_path, HPKV_KV_MEM_POOL_SIZE="64m")
    pool_dir = env["HPKV_SHARE_MEM_FILE_PATH"]
    os.mkdir(pool_dir)
    os.chmod(pool_dir, 0o777)
    try:
        with pytest.raises(
            PermissionError, match=rf"writable by its group or by others .*chmod go-w {pool_dir}"
        ):
            connect(load_config(env), env=env, timeout=30)
        assert os.listdir(pool_dir) == [], "no spawn lock, no log, no server"
    finally:
        ServerProcess(env).cleanup()


def test_connect_without_spawn_reports_no_server():
    env = private_env()
    try:
        with pytest.raises(HpkvUnavailable, match="no hpkv server is running"):
            connect(load_config(env), spawn=False)
    finally:
        ServerProcess(env).cleanup()


# ------------------------------------------------------------------ protocol over the rings
def test_namespace_lookup_reserve_commit_pin_through_the_server(server):
    with client_of(server) as c:
        ns = c.attach_namespace(FP, 1, 65536, name="test-model")
        keys = block_keys(FP, [bytes([i]) * 32 for i in range(10)])
        assert c.lookup(ns.ns_id, keys) == (0, [])
        slots = c.reserve(ns.ns_id, keys[:6])
        assert slots.shape == (6, 1) and len(set(slots[:, 0])) == 6 and (slots >= 0).all()
        assert c.lookup(ns.ns_id, keys)[0] == 0, "reserved, not committed"
        assert c.commit(ns.ns_id, keys[:6]) == 6
        assert c.lookup(ns.ns_id, keys) == (6, [1] * 6)
        pinned = c.pin(ns.ns_id, keys[:3])
        assert (pinned == P.slot_offset(slots[:3])).all()  # pins answer offsets, reserves add generations
        st = c.stats()
        (nss,) = st["namespaces"]
        assert nss["name"] == "test-model" and nss["blocks_dram"] == 6 and nss["blocks_pinned"] == 3
        assert nss["hits_dram"] == 6 and nss["lookups"] == 3 and nss["misses"] == 3
        c.unpin(ns.ns_id, keys[:3])
        assert c.stats()["namespaces"][0]["blocks_pinned"] == 0
        assert c.clear(ns.ns_id) == 6
        assert c.lookup(ns.ns_id, keys)[0] == 0


def test_commit_unpin_and_abort_of_more_keys_than_one_call_takes_are_split():
    """An engine step may finish more blocks than one call carries: the client splits commit,
    unpin and abort like it splits reserve and pin, and every key is handled."""
    srv = ServerProcess(private_env(pool_size="160m")).start()
    n = P.MAX_KEYS_PER_CALL + 7
    try:
        with client_of(srv, call_timeout=60.0) as c:
            ns = c.attach_namespace(FP, 1, 4096)
            keys = [os.urandom(16) for _ in range(n)]
            assert (c.reserve(ns.ns_id, keys) >= 0).all()
            assert c.commit(ns.ns_id, keys) == n
            assert c.lookup(ns.ns_id, keys[-P.MAX_KEYS_PER_CALL :])[0] == P.MAX_KEYS_PER_CALL
            c.pin(ns.ns_id, keys)
            assert c.stats()["namespaces"][0]["blocks_pinned"] == n
            c.unpin(ns.ns_id, keys)
            assert c.stats()["namespaces"][0]["blocks_pinned"] == 0
            assert c.clear(ns.ns_id) == n
            assert (c.reserve(ns.ns_id, keys) >= 0).all()
            c.abort(ns.ns_id, keys)
            st = c.stats()["namespaces"][0]
            assert st["blocks_reserved"] == 0 and st["blocks_dram"] == 0
    finally:
        srv.cleanup()


def test_dead_clients_pins_and_reservations_are_released(server):
    c1 = client_of(server)
    ns = c1.attach_namespace(FP, 1, 65536)
    keys = block_keys(FP, [b"k%d" % i for i in range(4)])
    c1.reserve(ns.ns_id, keys)
    c1.commit(ns.ns_id, keys[:2])
    c1.pin(ns.ns_id, keys[:2])
    c1.close()  # the socket closes: the server releases what c1 held
    with client_of(server) as c2:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            s = c2.stats()
            if s["namespaces"][0]["blocks_pinned"] == 0 and s["namespaces"][0]["blocks_reserved"] == 0:
                break
            time.sleep(0.05)
        assert s["namespaces"][0]["blocks_pinned"] == 0
        assert s["namespaces"][0]["blocks_reserved"] == 0
        assert c2.lookup(ns.ns_id, keys)[0] == 2


def test_two_rank_namespace_block_visible_only_after_both_ranks_commit(server):
    with client_of(server) as sched, client_of(server) as rank1:
        ns = sched.attach_namespace(FP, 2, 65536)
        rank1.attach_namespace(FP, 2, 65536, rank=1)
        keys = block_keys(FP, [b"tp-block"])
        slots = sched.reserve(ns.ns_id, keys)
        assert slots.shape == (1, 2) and slots[0, 0] != slots[0, 1]
        rank1.commit(ns.ns_id, keys, rank=1)
        assert sched.lookup(ns.ns_id, keys)[0] == 0
        sched.commit(ns.ns_id, keys, rank=0)
        assert sched.lookup(ns.ns_id, keys)[0] == 1


def test_two_namespaces_share_one_pool_through_the_server(server):
    fp2 = namespace_fingerprint({"model": "other"})
    with client_of(server) as c:
        a = c.attach_namespace(FP, 1, 65536, name="a")
        b = c.attach_namespace(fp2, 1, 3 * 65536, name="b")
        ka, kb = block_keys(FP, [b"x", b"y"]), block_keys(fp2, [b"x", b"y"])
        c.reserve(a.ns_id, ka)
        c.commit(a.ns_id, ka)
        c.reserve(b.ns_id, kb)
        c.commit(b.ns_id, kb)
        assert c.lookup(a.ns_id, ka)[0] == 2 and c.lookup(b.ns_id, kb)[0] == 2
        st = c.stats()
        assert st["pool"]["used_bytes"] == 2 * 65536 + 2 * 3 * 65536
        assert {n["name"]: n["blocks_dram"] for n in st["namespaces"]} == {"a": 2, "b": 2}


def test_pool_full_evicts_lru_and_never_pinned(server):
    with client_of(server) as c:
        slot = 8 << 20  # 64 MiB pool = 8 slots
        ns = c.attach_namespace(FP, 1, slot)
        keys = block_keys(FP, [b"%d" % i for i in range(10)])
        c.reserve(ns.ns_id, keys[:8])
        c.commit(ns.ns_id, keys[:8])
        c.pin(ns.ns_id, keys[:1])  # block 0 is oldest but pinned
        c.reserve(ns.ns_id, keys[8:])
        c.commit(ns.ns_id, keys[8:])
        present = [c.lookup(ns.ns_id, [k])[0] for k in keys]
        assert present == [1, 0, 0, 1, 1, 1, 1, 1, 1, 1]
        assert c.stats()["namespaces"][0]["evictions"] == 2


# ------------------------------------------------------------------ transfer workers
@pytest.mark.parametrize(
    "layout,pad",
    [("per_layer", 0), ("block_outermost", 0), ("per_layer", 512)],
    ids=["one-region-per-layer", "block-outermost", "padded-pages"],
)
def test_copies_through_the_transfer_worker_are_byte_exact(server, tmp_path, layout, pad):
    rng = np.random.default_rng(1)
    layers, blocks, page = 4, 32, 16 * 1024
    dev = make_device(tmp_path, layers, blocks, page, layout, pad)
    dev.fill_random(rng)
    with client_of(server) as c:
        ns = c.attach_namespace(
            namespace_fingerprint({"model": "test", "layout": layout, "pad": pad}), 1, layers * page
        )
        handle = c.register_device(ns.ns_id, rank=0, **dev.spec)
        src = rng.permutation(blocks)[:12]
        keys = block_keys(FP, [b"b%d" % i for i in range(12)])
        offsets = c.reserve(ns.ns_id, keys)[:, 0]
        assert handle.save(src, offsets)
        pool = PoolFile.attach(os.path.join(server.pool_dir, P.POOL_FILE))
        for b, off in zip(src, P.slot_offset(offsets), strict=False):
            assert pool.array[off : off + layers * page].tobytes() == dev.block_bytes(b)
        expected = {int(b): dev.block_bytes(b) for b in src}
        dev.fill_random(rng)
        dst = rng.permutation(blocks)[:12]
        assert handle.load(dst, offsets)
        for s, d in zip(src, dst, strict=False):
            assert dev.block_bytes(d) == expected[int(s)]
        pool.close()
        (w,) = c.stats()["workers"]
        assert w["jobs"] == 2 and w["bytes_saved"] == w["bytes_loaded"] == 12 * layers * page


def test_bad_block_ids_fail_the_batch_without_copying(server, tmp_path):
    dev = make_device(tmp_path, blocks=8)
    with client_of(server) as c:
        ns = c.attach_namespace(FP, 1, 4 * 4096)
        handle = c.register_device(ns.ns_id, rank=0, **dev.spec)
        offsets = c.reserve(ns.ns_id, block_keys(FP, [b"a", b"b"]))[:, 0]
        res = handle.wait(handle.submit(P.COPY_SAVE, np.array([1, 99]), offsets))
        assert list(res.values()) == [Status.BAD_REQUEST]
        assert c.stats()["workers"][0]["jobs_failed"] == 1


def test_killed_transfer_worker_is_restarted_and_its_batch_reported_failed(server, tmp_path):
    layers, blocks, page = 8, 64, 64 * 1024  # 512 KiB per block
    dev = make_device(tmp_path, layers, blocks, page)
    dev.fill_random(np.random.default_rng(2))
    with client_of(server) as c:
        ns = c.attach_namespace(FP, 1, layers * page)
        handle = c.register_device(ns.ns_id, rank=0, **dev.spec)
        offsets = c.reserve(ns.ns_id, block_keys(FP, [b"%d" % i for i in range(64)]))[:, 0]
        stats = StatsSegment.attach(server.pool_dir)
        slot = c.stats()["workers"][0]["slot"]
        row = stats.workers[slot]
        old_pid = int(row[W.PID])
        blk = np.arange(blocks)
        victim = None
        tickets, results = [], {}
        for _ in range(50):  # 8 queued jobs of 32 MiB each, until we catch one running
            tickets += [t for _ in range(8) for t in handle.submit(P.COPY_SAVE, blk, offsets)]
            for _ in range(20000):
                seq = int(row[W.INFLIGHT_SEQ])
                if seq:
                    victim = seq
                    os.kill(old_pid, signal.SIGKILL)
                    break
            if victim:
                break
            results.update(handle.wait(tickets, timeout=30))
            tickets = []
        assert victim, "never saw a batch in flight"
        results.update(handle.wait(tickets, timeout=30))
        assert all(s in (0, Status.WORKER_DIED) for s in results.values()), results
        # The batch in flight when SIGKILL landed failed: the one we saw, or, if it finished
        # in the microseconds before the signal, the next one the worker had taken.
        assert (
            results[(0, victim)] == Status.WORKER_DIED or results.get((0, victim + 1)) == Status.WORKER_DIED
        )
        assert all(results[t] == Status.WORKER_DIED for t in tickets if t[1] > victim + 1), (
            "queued batches of a dead worker fail, never run later"
        )
        deadline = time.monotonic() + 30
        while not (row[W.STATE] == WorkerState.RUNNING and row[W.PID] != old_pid):
            assert time.monotonic() < deadline, "worker not restarted"
            time.sleep(0.05)
        assert handle.save(blk[:4], offsets[:4]), "the restarted worker serves new jobs"
        w = c.stats()["workers"][0]
        assert w["restarts"] == 1 and w["pid"] != old_pid and w["state"] == "running"
        assert c.stats()["worker_restarts"] == 1
        stats.close()


def test_copy_threads_get_disjoint_cpu_sets_and_workers_start_at_different_ones():
    assert spread_cpus([0, 1], 2) == [{0}, {1}]
    assert spread_cpus([0, 1], 2, first=1) == [{1}, {0}], "the next worker's copying thread: CPU 1"
    assert spread_cpus(list(range(8)), 3) == [{0, 3, 6}, {1, 4, 7}, {2, 5}]
    assert spread_cpus([5], 4, first=3) == [{5}]


def test_worker_is_pinned_to_its_nodes_cpus(server, tmp_path):
    dev = make_device(tmp_path)
    with client_of(server) as c:
        ns = c.attach_namespace(FP, 1, 4 * 4096)
        c.register_device(ns.ns_id, rank=0, numa_node=0, **dev.spec)
        (w,) = c.stats()["workers"]
        assert w["numa_node"] == 0
        with open("/sys/devices/system/node/node0/cpulist") as f:
            from hpkv.common.numa import parse_cpulist

            node_cpus = set(parse_cpulist(f.read()))
        assert set(w["cpus"]) <= node_cpus
        deadline = time.monotonic() + 10
        while c.stats()["workers"][0]["state"] != "running":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # Every thread runs on the node's CPUs; the copying one on its own share of them
        # (a split copy's helpers get the others: tests/test_copy_kernels.py).
        pid = c.stats()["workers"][0]["pid"]
        threads = {}
        for t in psutil.Process(pid).threads():
            with contextlib.suppress(ProcessLookupError):  # a thread that has just ended
                threads[t.id] = os.sched_getaffinity(t.id)
        assert all(cpus <= set(w["cpus"]) for cpus in threads.values()), threads
        copy_threads = min(len(w["cpus"]), MAX_COPY_THREADS)
        assert threads[pid] in spread_cpus(w["cpus"], copy_threads), "one CPU set of the node's"


# ------------------------------------------------------------------ status
def test_status_json_matches_what_the_test_did(server, tmp_path):
    dev = make_device(tmp_path)
    with client_of(server, name="status-test") as c:
        ns = c.attach_namespace(FP, 1, 4 * 4096, name="status-model")
        keys = block_keys(FP, [b"%d" % i for i in range(5)])
        c.reserve(ns.ns_id, keys)
        c.commit(ns.ns_id, keys)
        c.lookup(ns.ns_id, keys + block_keys(FP, [b"missing"]))
        c.pin(ns.ns_id, keys[:2])
        c.register_device(ns.ns_id, rank=0, **dev.spec)
        out = hpkv_cli(server.env, "status", "--json")
        assert out.returncode == 0, out.stderr
        s = json.loads(out.stdout)
        assert s["server"]["pid"] == server.proc.pid
        assert s["pool"]["capacity_bytes"] == 64 << 20
        assert s["pool"]["used_bytes"] == 5 * 16384 and s["pool"]["pinned_bytes"] == 2 * 16384
        (n,) = s["namespaces"]
        assert (n["name"], n["blocks_dram"], n["blocks_pinned"], n["hits_dram"], n["misses"]) == (
            "status-model",
            5,
            2,
            5,
            1,
        )
        (w,) = s["workers"]
        assert w["kind"] == "transfer" and psutil.pid_exists(w["pid"])
        assert [(cl["pid"], cl["name"]) for cl in s["clients"]] == [(os.getpid(), "status-test")]
        table = hpkv_cli(server.env, "status").stdout
        assert "status-model" in table and str(w["pid"]) in table


def test_status_without_server_exits_1(tmp_path):
    env = private_env()
    try:
        out = hpkv_cli(env, "status")
        assert out.returncode == 1
        assert f"no server is running for the pool directory {env['HPKV_SHARE_MEM_FILE_PATH']}" in out.stderr
    finally:
        ServerProcess(env).cleanup()


def test_status_and_top_name_a_server_of_another_hpkv_version(tmp_path):
    """A node upgraded while its server runs: the new `hpkv status` cannot read the old stats
    segment and says so, instead of "starting" forever (or "no server")."""
    import fcntl

    from hpkv.monitor.frame import render_text
    from hpkv.monitor.sample import Watcher
    from hpkv.protocol.stats import MAGIC, STATS_FILE, VERSION

    env = private_env()
    pool_dir = env["HPKV_SHARE_MEM_FILE_PATH"]
    os.makedirs(pool_dir)
    try:
        # This process plays the old server: it holds the lock and published a segment of
        # the previous layout (version 2: a smaller file).
        lock = os.open(os.path.join(pool_dir, P.LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
        os.write(lock, str(os.getpid()).encode())
        fcntl.flock(lock, fcntl.LOCK_EX)
        with open(os.path.join(pool_dir, STATS_FILE), "wb") as f:
            f.write(np.array([MAGIC, VERSION - 1], np.int64).tobytes() + bytes(64 << 10))
        out = hpkv_cli(env, "status")
        assert out.returncode == 1
        assert f"server {os.getpid()} runs" in out.stderr
        assert f"of version {VERSION - 1}, and this hpkv reads version {VERSION}" in out.stderr, out.stderr
        view = Watcher(load_config(env)).poll()
        assert view.status == "starting" and view.pid == os.getpid()
        frame = render_text(view, 200)
        assert f"version {VERSION - 1}" in frame and "has not published" not in frame, frame
        os.close(lock)
    finally:
        shutil.rmtree(pool_dir, ignore_errors=True)


def _connect_pinned(env, q):
    os.sched_setaffinity(0, {0})  # like vLLM's CPU worker, bound to its compute core
    c = connect(load_config(env), env=env, timeout=60)
    q.put(c.server_pid)
    c.close()


def test_auto_spawned_server_does_not_inherit_the_spawners_cpu_pinning():
    if os.cpu_count() < 2:
        pytest.skip("needs two CPUs")
    env = private_env(HPKV_SERVER_IDLE_EXIT="1")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_connect_pinned, args=(env, q))
    p.start()
    try:
        pid = q.get(timeout=90)
        assert psutil.Process(pid).cpu_affinity() == list(range(os.cpu_count()))
        psutil.Process(pid).wait(timeout=30)  # idle exit
    finally:
        p.join(30)
        ServerProcess(env).cleanup()

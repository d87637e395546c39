"""Issue 26, items 5, 6 and 11: one client cannot slow or lock out the others, and the
server's names, limits, stop and log stay sane whatever a client or an operator sends.
Real ``hpkv serve`` processes, one section per item."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hpkv.client import HpkvUnavailable, connect
from hpkv.protocol import wire as P
from hpkv.protocol.errors import ROW_POOL_FULL
from hpkv.protocol.keys import block_keys, namespace_fingerprint
from hpkv.protocol.wire import live_server_pid
from hpkv.testing.server import ServerProcess, client_of, private_env, wait_for

FP = namespace_fingerprint({"model": "fairness", "layers": 2})


def raw_socket(srv: ServerProcess, timeout: float = 10.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(os.path.join(srv.pool_dir, P.SOCKET_FILE))
    return s


def raw_call(s: socket.socket, obj: dict) -> dict:
    s.sendall(json.dumps(obj).encode() + b"\n")
    data = b""
    while not data.endswith(b"\n"):
        chunk = s.recv(65536)
        assert chunk, "the server closed the connection"
        data += chunk
    return json.loads(data)


@pytest.fixture
def chatty_server():
    """A server whose stderr is read as it writes (the ``server`` fixture's stderr is a pipe
    nobody reads until it exits: hundreds of log lines would fill it and block the server)."""
    with ServerProcess(private_env()) as srv:
        assert srv.proc is not None and srv.proc.stderr is not None
        threading.Thread(target=srv.proc.stderr.read, daemon=True).start()
        yield srv


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ 5. a flooding client
def test_a_client_flooding_its_ring_does_not_starve_another_clients_lookups(server):
    flooder = subprocess.Popen(
        [sys.executable, "-m", "hpkv.testing.flood", FP],
        env=server.env,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert flooder.stdout is not None and flooder.stdout.readline() == b"flooding\n"
        with client_of(server, call_timeout=5.0, name="victim") as victim:
            ns = victim.attach_namespace(FP, 1, 8192)
            keys = block_keys(FP, [b"victim", b"blocks"])
            times = []
            for _ in range(60):
                t0 = time.monotonic()
                victim.lookup(ns.ns_id, keys)  # HpkvUnavailable when it waits 5 s (starved)
                times.append(time.monotonic() - t0)
            assert flooder.poll() is None, "the flooder stopped: nothing was measured"
        p99 = float(np.percentile(times, 99))
        assert p99 < 0.5, f"the victim's lookups took up to {max(times):.3f}s (p99 {p99:.3f}s) under a flood"
    finally:
        os.killpg(flooder.pid, signal.SIGKILL)
        flooder.wait()


# ------------------------------------------------------------------ 6. control connections
def test_control_connections_beyond_the_cap_are_refused_as_unavailable_and_logged():
    with ServerProcess(private_env(HPKV_MAX_CONTROL_CONNECTIONS="8")) as srv:
        idle = [raw_socket(srv) for _ in range(8)]  # accepted in this order, before the next
        try:
            t0 = time.monotonic()
            with pytest.raises(HpkvUnavailable, match="HPKV_MAX_CONTROL_CONNECTIONS=8"):
                client_of(srv, timeout=10.0)
            assert time.monotonic() - t0 < 5.0
            wait_for(lambda: "HPKV_MAX_CONTROL_CONNECTIONS=8" in srv.log(), what="the refusal's log line")
            idle.pop().close()  # room again: the next client is served
            c = wait_for(lambda: _connect_or_none(srv), what="a connection once one closed")
            c.close()
        finally:
            for s in idle:
                s.close()


def _connect_or_none(srv: ServerProcess):
    try:
        return client_of(srv, timeout=5.0)
    except HpkvUnavailable:
        return None


def test_out_of_descriptors_the_control_thread_refuses_clients_and_does_not_spin():
    with ServerProcess(private_env()) as srv:
        pid = srv.proc.pid
        open_fds = len(os.listdir(f"/proc/{pid}/fd"))
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (open_fds + 10, open_fds + 10))
        idle = [raw_socket(srv) for _ in range(30)]  # ~10 accepted, then EMFILE
        try:
            wait_for(lambda: "cannot accept a control connection" in srv.log(), what="the EMFILE log line")
            cpu0, t0 = cpu_seconds(pid), time.monotonic()
            time.sleep(1.0)  # measuring the CPU the server burns while idle at the limit
            busy = (cpu_seconds(pid) - cpu0) / (time.monotonic() - t0)
            assert busy < 0.3, f"the server used {busy:.0%} of a core at the descriptor limit"
            t0 = time.monotonic()
            with pytest.raises(HpkvUnavailable, match="out of file descriptors"):
                client_of(srv, timeout=10.0)
            assert time.monotonic() - t0 < 5.0
        finally:
            for s in idle:
                s.close()
        assert srv.log().count("cannot accept a control connection") == 1  # rate-limited


# ------------------------------------------------------------------ 11. connect honours its timeout
def test_connect_gives_up_after_its_timeout_when_the_server_never_answers(tmp_path):
    env = private_env()
    from hpkv.config import load_config

    cfg = load_config(env)
    os.makedirs(cfg.pool_dir, mode=0o700, exist_ok=True)
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # accepts (backlog), never answers
    mute.bind(os.path.join(cfg.pool_dir, P.SOCKET_FILE))
    mute.listen(8)
    try:
        t0 = time.monotonic()
        with pytest.raises(HpkvUnavailable, match="within"):
            connect(cfg, spawn=False, timeout=1.5)
        took = time.monotonic() - t0
        assert 1.0 < took < 4.0, f"connect(timeout=1.5) took {took:.1f}s"
    finally:
        mute.close()
        ServerProcess(env).cleanup()


# ------------------------------------------------------------------ 11. names and the stats catalog
def test_hundreds_of_holds_with_long_names_never_fail_a_hello_or_stats(chatty_server):
    server = chatty_server
    holds = []
    try:
        for i in range(300):  # each name is 5000 snowmen: 30 kB of JSON escapes as sent
            s = raw_socket(server)
            holds.append(s)
            assert raw_call(s, {"op": "hold", "pid": os.getpid(), "name": f"{i}" + "\u2603" * 5000})["ok"]
        with client_of(server, name="after the holds") as c:
            st = c.stats()
        assert len(st["holds"]) + st["holds_omitted"] == 300
        assert all(len(h["name"]) <= 96 for h in st["holds"])
        assert any(cl["name"] == "after the holds" for cl in st["clients"])
    finally:
        for s in holds:
            s.close()


FORGED = "x\n2026-12-02 00:00:00,000 ERROR hpkv.server[1]: forged line\x1b[2J\x1b]0;title\x07"


def test_client_names_reach_the_log_and_hpkv_status_escaped(server):
    with client_of(server, name=FORGED) as c:
        c.attach_namespace(FP, 1, 8192, name=FORGED)
        hold = raw_socket(server)
        try:
            assert raw_call(hold, {"op": "hold", "pid": os.getpid(), "name": FORGED})["ok"]
            status = subprocess.run(
                [sys.executable, "-m", "hpkv", "status"], env=server.env, capture_output=True, timeout=60
            )
        finally:
            hold.close()
    out = status.stdout.decode()
    assert status.returncode == 0, status.stderr
    log = server.log()
    for text in (out, log):
        assert "\x1b" not in text and "\x07" not in text
        assert not any(line.startswith("2026-12-02 00:00:00,000 ERROR") for line in text.splitlines())
    assert "x\\n2026-12-02" in out and "x\\n2026-12-02" in log


# ------------------------------------------------------------------ 11. stop timeouts and config values
def hpkv_cli(env, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpkv", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "0", "1e400"])
def test_hpkv_stop_refuses_a_timeout_outside_its_range_without_a_traceback(server, value):
    r = hpkv_cli(server.env, "stop", "--timeout", value)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert f"'{value}' is not a number of seconds in (0, 172800]" in r.stderr
    assert server.proc is not None and server.proc.poll() is None, "the server was stopped anyway"


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("HPKV_STOP_DRAIN_TIMEOUT", "inf", "outside 0..86400"),
        ("HPKV_SERVER_IDLE_EXIT", "inf", "outside 0.."),
        ("HPKV_ALLOW_GROUP", "99999999999", "gid 99999999999 is outside 0..4294967294"),
        ("HPKV_ALLOW_GROUP", "4242", "no group has gid 4242"),
    ],
)
def test_config_check_refuses_values_the_server_would_crash_on(key, value, says):
    if key == "HPKV_ALLOW_GROUP" and value == "4242":
        import grp

        with pytest.raises(KeyError):  # the premise: no such group here
            grp.getgrgid(4242)
    env = private_env(**{key: value})
    try:
        for args in (("config", "--check"), ("serve",)):
            r = hpkv_cli(env, *args)
            assert r.returncode == 1, f"hpkv {' '.join(args)} with {key}={value}: {r.stdout}{r.stderr}"
            assert "Traceback" not in r.stderr
            assert f"{key}='{value}'" in r.stderr and says in r.stderr
    finally:
        shutil.rmtree(env["HPKV_SHARE_MEM_FILE_PATH"], ignore_errors=True)
        os.unlink(env["HPKV_CONFIG_FILE_PATH"])


# ------------------------------------------------------------------ 11. the stop drain converges
def test_while_stopping_new_reserves_are_refused_and_the_drain_report_adds_up(tmp_path):
    env = private_env(storage=str(tmp_path / "st"), HPKV_STOP_DRAIN_TIMEOUT="3")
    with ServerProcess(env) as srv, client_of(srv) as c:
        ns = c.attach_namespace(FP, 1, 8192)
        io_pids = [w["pid"] for w in c.stats()["workers"] if w["kind"] == "io"]
        assert io_pids
        for pid in io_pids:  # spills stay pending: the drain runs to its timeout
            os.kill(pid, signal.SIGSTOP)
        stopper = None
        try:
            before = block_keys(FP, [b"before-%d" % i for i in range(4)])
            late = block_keys(FP, [b"late-%d" % i for i in range(2)])
            assert (c.reserve(ns.ns_id, before + late) >= 0).all()
            assert c.commit(ns.ns_id, before) == 4
            stopper = raw_socket(srv, timeout=30.0)
            stopper.sendall(json.dumps({"op": "shutdown", "pid": os.getpid(), "wait": True}).encode() + b"\n")
            wait_for(lambda: "stopping: writing 4 pending block(s)" in srv.log(), what="the drain")
            refused = c.reserve(ns.ns_id, block_keys(FP, [b"during-%d" % i for i in range(3)]))
            assert (refused == ROW_POOL_FULL).all(), refused
            assert c.commit(ns.ns_id, late) == 2  # reserved before the stop: still taken
            outcome = json.loads(stopper.makefile("rb").readline())
        finally:
            for pid in io_pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            if stopper is not None:
                stopper.close()
    assert outcome["ok"] and outcome["pending"] == 6 and outcome["dropped"] == 6, outcome


# ------------------------------------------------------------------ 11. server.log is rotated
def test_server_log_is_rotated_at_its_size_with_the_spawned_servers_output_following(tmp_path):
    env = private_env(HPKV_LOG_MAX_BYTES="64k")
    holder = ServerProcess(env)  # starts nothing: stops the spawned server and removes it all
    try:
        c = connect(holder.cfg, env=env, timeout=60.0, name="rotation")  # auto-spawned: output to server.log
        c.close()
        pid = live_server_pid(holder.pool_dir)
        assert pid is not None
        log_path = os.path.join(holder.pool_dir, P.LOG_FILE)
        for i in range(1500):  # two log lines of ~200 bytes each: ~600 kB, nine rotations
            s = raw_socket(holder)
            assert raw_call(s, {"op": "hold", "pid": os.getpid(), "name": f"{i:05d} " + "r" * 90})["ok"]
            s.close()
        wait_for(lambda: "01499 " in Path(log_path).read_text(), what="the last hold's line in server.log")
        names = sorted(n for n in os.listdir(holder.pool_dir) if n.startswith(P.LOG_FILE))
        assert names == [P.LOG_FILE] + [f"{P.LOG_FILE}.{i}" for i in (1, 2, 3)], names
        for n in names:
            assert os.path.getsize(os.path.join(holder.pool_dir, n)) < 64 * 1024 + 1024, n
        # The spawned server's stdout and stderr are the new file, not a renamed one.
        for fd in (1, 2):
            assert os.readlink(f"/proc/{pid}/fd/{fd}") == log_path
    finally:
        holder.cleanup()


def test_a_full_connection_backlog_is_reported_as_unavailable_not_a_raw_blocking_io_error():
    env = private_env()
    from hpkv.config import load_config

    cfg = load_config(env)
    os.makedirs(cfg.pool_dir, mode=0o700, exist_ok=True)
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # never accepts: its backlog fills
    mute.bind(os.path.join(cfg.pool_dir, P.SOCKET_FILE))
    mute.listen(1)
    waiting = []
    try:
        while True:  # fill the backlog
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            waiting.append(s)
            try:
                s.connect(os.path.join(cfg.pool_dir, P.SOCKET_FILE))
            except BlockingIOError:
                break
            assert len(waiting) < 100, "the backlog never filled"
        with pytest.raises(HpkvUnavailable, match="backlog is full"):
            connect(cfg, spawn=False, timeout=2.0)
    finally:
        for s in waiting:
            s.close()
        mute.close()
        ServerProcess(env).cleanup()


def test_a_client_pushing_while_its_promote_is_parked_does_not_make_the_server_spin(tmp_path):
    """Its calls wait in its ring until the promote is answered (one call at a time per client),
    but the ring is not watched meanwhile: the request loop sleeps instead of spinning."""
    env = private_env(storage=str(tmp_path / "st"))
    with ServerProcess(env) as srv, client_of(srv) as c:
        ns = c.attach_namespace(FP, 1, 8192)
        keys = block_keys(FP, [b"parked-%d" % i for i in range(4)])
        assert (c.reserve(ns.ns_id, keys) >= 0).all() and c.commit(ns.ns_id, keys) == 4
        wait_for(lambda: c.stats()["storage"]["spills"] >= 4, what="the spills")
        c.clear(ns.ns_id)
        assert c.lookup(ns.ns_id, keys) == (4, [2, 2, 2, 2])  # on storage only: a promote parks
        io_pids = [w["pid"] for w in c.stats()["workers"] if w["kind"] == "io"]
        for pid in io_pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            c._mbox[: 4 * 16] = np.frombuffer(b"".join(keys), np.uint8)
            c._req.push(P.PROMOTE, 1000, ns.ns_id, 4, 20_000, timeout=5.0)
            for seq in range(1001, 1101):  # queued behind the parked promote
                c._req.push(P.LOOKUP, seq, ns.ns_id, 4, timeout=5.0)
            time.sleep(0.3)  # the server takes the promote and parks it
            cpu0, t0 = cpu_seconds(srv.proc.pid), time.monotonic()
            time.sleep(1.5)  # measuring the CPU the server burns while the promote is parked
            busy = (cpu_seconds(srv.proc.pid) - cpu0) / (time.monotonic() - t0)
            assert busy < 0.3, f"the server used {busy:.0%} of a core while a promote was parked"
        finally:
            for pid in io_pids:
                os.kill(pid, signal.SIGCONT)
        answered = set()
        deadline = time.monotonic() + 20
        while len(answered) < 101:
            d = c._resp.pop(timeout=max(deadline - time.monotonic(), 0.01))
            assert d.status == 0, d
            answered.add(d.seq)
        assert answered == set(range(1000, 1101))

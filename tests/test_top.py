"""hpkv-top in a real terminal (tmux), its --once frame, the frame layout and the ring peek."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np
import pytest

from hpkv.client import connect
from hpkv.monitor.frame import render, render_text
from hpkv.monitor.rings import peek
from hpkv.monitor.sample import View
from hpkv.protocol.keys import block_keys, namespace_fingerprint
from hpkv.ring import Ring
from hpkv.testing.device import make_device
from hpkv.testing.server import ServerProcess, private_env

FP = namespace_fingerprint({"model": "top-test"})
BLOCK_TOKENS = 16
PAGE, LAYERS = 4096, 4
SLOT = PAGE * LAYERS
N_BLOCKS = 6

needs_tmux = pytest.mark.skipif(
    shutil.which("tmux") is None, reason="tmux is not installed (scripts/setup.sh installs it as root)"
)


def top_command(*args: str) -> list[str]:
    """The installed console script when there is one, else the module it runs."""
    script = os.path.join(os.path.dirname(sys.executable), "hpkv-top")
    return (
        [script, *args] if os.access(script, os.X_OK) else [sys.executable, "-m", "hpkv.monitor.top", *args]
    )


# ------------------------------------------------------------------ a server with known traffic
class Traffic:
    """What the test did to the server, so the screen can be checked against it."""

    def __init__(self, srv: ServerProcess, tmp_path):
        self.client = connect(srv.cfg, spawn=False, name="top-test-engine")
        self.ns = self.client.attach_namespace(FP, 1, SLOT, name="top-model", block_tokens=BLOCK_TOKENS)
        self.device = make_device(tmp_path, layers=LAYERS, blocks=16, page=PAGE)
        self.handle = self.client.register_device(self.ns.ns_id, rank=0, **self.device.spec)
        self.keys = block_keys(FP, [b"top-%d" % i for i in range(N_BLOCKS)])
        offsets = self.client.reserve(self.ns.ns_id, self.keys)[:, 0]
        assert self.handle.save(np.arange(N_BLOCKS), offsets)
        assert self.client.commit(self.ns.ns_id, self.keys) == N_BLOCKS
        hit, _ = self.client.lookup(self.ns.ns_id, self.keys + block_keys(FP, [b"not-stored"]))
        assert hit == N_BLOCKS
        self.client.pin(self.ns.ns_id, self.keys[:2])
        (w,) = self.client.stats()["workers"]
        self.worker_pid = w["pid"]
        self.hits = N_BLOCKS

    def more_hits(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.client.lookup(self.ns.ns_id, self.keys)
            self.hits += N_BLOCKS
            time.sleep(0.01)

    def close(self) -> None:
        self.client.close()


@pytest.fixture
def traffic(server, tmp_path):
    t = Traffic(server, tmp_path)
    try:
        yield t
    finally:
        t.close()


# ------------------------------------------------------------------ tmux
class Tmux:
    """hpkv-top in a detached tmux session on a private tmux server (killed in close())."""

    def __init__(self, env: dict[str, str]):
        self.socket = f"hpkv-top-test-{uuid.uuid4().hex[:8]}"
        # without COLUMNS and LINES: curses takes them over the terminal's size (pytest-xdist's
        # workers export 80 x 24), and hpkv-top would never follow the window
        self.env = {k: v for k, v in env.items() if k not in ("COLUMNS", "LINES")}
        self.env.update(TERM="xterm-256color", LANG="C.UTF-8")
        # where tmux puts a -L socket; it leaves the file behind when its server is killed
        self.socket_path = os.path.join(
            self.env.get("TMUX_TMPDIR", "/tmp"), f"tmux-{os.getuid()}", self.socket
        )

    def start(self, width: int, height: int, *args: str) -> None:
        cmd = " ".join(map(_quote, top_command(*args)))
        # the shell stays after hpkv-top exits, so a crash leaves its traceback and status on screen
        shell = f'{cmd}; echo "hpkv-top exited with status $?"; sleep 600'
        self.tmux("new-session", "-d", "-s", "top", "-x", str(width), "-y", str(height), shell)

    def tmux(self, *args: str) -> str:
        out = subprocess.run(
            ["tmux", "-L", self.socket, *args], env=self.env, capture_output=True, text=True, timeout=30
        )
        assert out.returncode == 0, f"tmux {' '.join(args)}: {out.stderr}"
        return out.stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "top")

    def wait_for(self, what: str, ok: Callable[[str], bool], timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.screen()
            if ok(text):
                return text
            if time.monotonic() > deadline:
                pytest.fail(f"hpkv-top never showed {what} within {timeout:g}s; the screen:\n{text}")
            time.sleep(0.2)

    def size(self) -> tuple[int, int]:
        w, h = self.tmux("display-message", "-p", "-t", "top", "#{window_width} #{window_height}").split()
        return int(w), int(h)

    def resize(self, width: int, height: int) -> None:
        self.tmux("resize-window", "-t", "top", "-x", str(width), "-y", str(height))
        assert self.size() == (width, height)

    def close(self) -> None:
        subprocess.run(
            ["tmux", "-L", self.socket, "kill-server"], env=self.env, capture_output=True, timeout=30
        )
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


@pytest.fixture
def tmux_top():
    sessions: list[Tmux] = []

    def start(env: dict[str, str], width: int = 100, height: int = 30, *args: str) -> Tmux:
        t = Tmux(env)
        sessions.append(t)
        t.start(width, height, *args)
        return t

    try:
        yield start
    finally:
        for t in sessions:
            t.close()


# ------------------------------------------------------------------ reading a screen
def line_with(screen: str, pattern: str) -> str:
    for line in screen.splitlines():
        if re.search(pattern, line):
            return line
    raise AssertionError(f"no line matches {pattern!r} in:\n{screen}")


def cell(header: str, row: str, label: str) -> str:
    """The value under a column label: numbers are right-aligned (end under the label's end),
    text is left-aligned (starts under the label's start)."""
    start = header.index(label)
    end = start + len(label)
    tail = row[start:].split()
    if label in ("NAMESPACE", "KIND", "STATE", "DEVICE", "CPUS", "NAME", "RANKS"):
        return tail[0] if tail else ""
    words = row[:end].split()
    if words[-1] in ("B", "KiB", "MiB", "GiB", "TiB"):  # a size: "96.0 KiB"
        return " ".join(words[-2:])
    return words[-1]


def table(screen: str, first_label: str, key_label: str, key: str) -> tuple[str, str]:
    """(header, row) of the table whose header starts with ``first_label``, row where ``key_label`` is ``key``."""
    lines = screen.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(first_label) and key_label in line:
            for row in lines[i + 1 :]:
                if not row.strip() or row.strip().startswith("+ "):
                    break
                if cell(line, row, key_label) == key:
                    return line, row
    raise AssertionError(f"no {first_label} row with {key_label} = {key} in:\n{screen}")


def widest(screen: str) -> int:
    return max(len(line.rstrip()) for line in screen.splitlines())


# ------------------------------------------------------------------ the live monitor
@needs_tmux
def test_screen_shows_the_blocks_hits_and_workers_the_test_caused(server, traffic, tmux_top):
    top = tmux_top(server.env, 100, 30, "-d", "0.5")
    screen = top.wait_for(f"server {server.proc.pid}", lambda s: f"server {server.proc.pid}" in s)
    assert server.pool_dir in line_with(screen, "^hpkv-top")

    head, row = table(screen, "NAMESPACE", "NAMESPACE", "top-model")
    assert cell(head, row, "DRAM BLK") == str(N_BLOCKS)
    assert cell(head, row, "HITS DRAM") == str(N_BLOCKS)
    assert cell(head, row, "MISSES") == "1"
    assert cell(head, row, "PINNED") == "2"
    assert re.search(rf"\bblocks {N_BLOCKS}\b", line_with(screen, "^POOL"))
    # hits in blocks and in tokens (blocks x block_tokens)
    hits = line_with(screen, "^hits DRAM").split()
    assert hits[4:6] == [str(N_BLOCKS), str(N_BLOCKS * BLOCK_TOKENS)]
    # the transfer worker copied N_BLOCKS slots of 16 KiB from the device into the pool
    assert "96.0 KiB" in line_with(screen, "^device->pool")

    head, row = table(screen, "SLOT", "PID", str(traffic.worker_pid))
    assert cell(head, row, "KIND") == "transfer"
    assert cell(head, row, "STATE") == "running"
    head, row = table(screen, "ENGINE", "PID", str(os.getpid()))
    assert cell(head, row, "NAMESPACE") == "top-model"
    rings = line_with(screen, r"c1\.req \d+/\d+")
    assert re.search(r"c1\.d1\.w0\.req \d+/1024", screen), rings

    # lookups while it watches: a hit rate, then the new totals
    lookups = threading.Thread(target=traffic.more_hits, args=(2.0,))
    lookups.start()
    try:
        top.wait_for("a DRAM hit rate", lambda s: line_with(s, "^hits DRAM").split()[2] not in ("0", "0.0"))
    finally:
        lookups.join()
    screen = top.wait_for(
        f"{traffic.hits} DRAM hits",
        lambda s: line_with(s, "^hits DRAM").split()[4] == str(traffic.hits),
        timeout=10,
    )
    head, row = table(screen, "NAMESPACE", "NAMESPACE", "top-model")
    assert cell(head, row, "HITS DRAM") == str(traffic.hits)


@needs_tmux
def test_layout_follows_the_terminal_size(server, traffic, tmux_top):
    top = tmux_top(server.env, 100, 30, "-d", "0.5")
    pid = f"server {server.proc.pid}"
    screen = top.wait_for("the 100-column layout", lambda s: pid in s and "TIME SAVED" in s)
    assert "TIME SAVED" in line_with(screen, "^NAMESPACE") and "COMMITS" not in screen

    top.resize(80, 24)
    screen = top.wait_for("the 80-column layout", lambda s: "TIME SAVED" not in s)
    assert widest(screen) <= 80 and len(screen.rstrip("\n").splitlines()) <= 24
    assert pid in screen and "top-model" in screen and str(traffic.worker_pid) in screen
    head, row = table(screen, "NAMESPACE", "NAMESPACE", "top-model")
    assert cell(head, row, "HITS DRAM") == str(N_BLOCKS)

    top.resize(160, 45)
    screen = top.wait_for("the 160-column layout", lambda s: "COMMITS" in s and "LOADED" in s)
    head, row = table(screen, "NAMESPACE", "NAMESPACE", "top-model")
    assert cell(head, row, "COMMITS") == str(N_BLOCKS) and cell(head, row, "LOOKUPS") == "1"
    head, row = table(screen, "SLOT", "PID", str(traffic.worker_pid))
    assert cell(head, row, "SAVED") == "96.0 KiB"
    assert widest(screen) <= 160


@needs_tmux
def test_q_quits(server, tmux_top):
    top = tmux_top(server.env, 100, 30)
    top.wait_for("the server", lambda s: f"server {server.proc.pid}" in s)
    top.tmux("send-keys", "-t", "top", "q")
    top.wait_for("its exit", lambda s: "hpkv-top exited with status 0" in s, timeout=10)


@needs_tmux
def test_waits_for_a_server_and_follows_it_across_a_restart(tmux_top):
    env = private_env(pool_size="64m")
    first, second = ServerProcess(env), ServerProcess(env)
    try:
        top = tmux_top(env, 100, 30, "-d", "0.3")
        pool_dir = env["HPKV_SHARE_MEM_FILE_PATH"]
        no_server = f"no hpkv server is running for the pool directory {pool_dir}"
        top.wait_for("'no server'", lambda s: no_server in s)

        first.start()
        top.wait_for(f"server {first.proc.pid}", lambda s: f"server {first.proc.pid}" in s)
        assert first.terminate() == 0
        # Both lines in one wait: tmux may show a frame half drawn, its first line without the next.
        went_away = f"server pid {first.proc.pid} went away"
        top.wait_for(
            "'no server' and 'went away' after the stop", lambda s: no_server in s and went_away in s
        )

        second.start()
        top.wait_for(f"the new server {second.proc.pid}", lambda s: f"server {second.proc.pid}" in s)
        second.kill()  # SIGKILL: no clean-up; the lock goes with the process
        top.wait_for("'no server' after a kill", lambda s: no_server in s)
        assert "exited with status" not in top.screen()
    finally:
        first.cleanup()
        second.cleanup()


# ------------------------------------------------------------------ --once
def test_once_prints_one_plain_frame_with_the_servers_figures(server, traffic):
    out = subprocess.run(
        top_command("--once", "--width", "100", "-d", "0.2"),
        env=server.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "\x1b" not in text, "plain text: no terminal escapes"
    assert f"server {server.proc.pid}" in text.splitlines()[0]
    assert widest(text) <= 100
    head, row = table(text, "NAMESPACE", "NAMESPACE", "top-model")
    assert cell(head, row, "DRAM BLK") == str(N_BLOCKS) and cell(head, row, "HITS DRAM") == str(N_BLOCKS)
    assert str(traffic.worker_pid) in text and "top-test-engine" in text


def test_once_without_a_server_names_the_pool_directory_and_fails():
    env = private_env()
    try:
        out = subprocess.run(top_command("--once"), env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 1
        assert (
            f"no hpkv server is running for the pool directory {env['HPKV_SHARE_MEM_FILE_PATH']}"
            in out.stdout
        )
    finally:
        ServerProcess(env).cleanup()  # its config file


# ------------------------------------------------------------------ frame layout (no terminal)
def _busy_view(n_workers: int = 12, n_clients: int = 6, storage: dict | None = None) -> View:
    snap = {
        "server": {
            "pid": 4242,
            "start_time": time.time() - 3725,
            "heartbeat_age_s": 0.1,
            "pool_dir": "/dev/shm/hpkv",
            "storage": "/nvme/hpkv",
        },
        "pool": {"capacity_bytes": 8 << 30, "used_bytes": 3 << 30, "pinned_bytes": 1 << 20, "blocks": 1536},
        "requests": 123456,
        "errors": 0,
        "worker_restarts": 1,
        "namespaces": [
            {
                "id": i,
                "name": f"model-{i}",
                "fingerprint": f"{i:016x}",
                "world_size": 2,
                "shard_bytes": 1 << 20,
                "block_tokens": 16,
                "blocks_dram": 700 + i,
                "bytes_dram": 700 << 21,
                "blocks_pinned": 3,
                "blocks_storage": 5000,
                "hits_dram": 10**7,
                "hits_storage": 4000,
                "misses": 99,
                "lookups": 300,
                "evictions": 12,
                "reserve_failed": 0,
                "commits": 900,
                "blocks_reserved": 4,
            }
            for i in range(3)
        ],
        "workers": [
            {
                "slot": i,
                "kind": "transfer" if i < n_workers // 2 else "io",
                "name": f"w{i}",
                "device": f"cuda:{i % 8}",
                "numa_node": i % 2,
                "cpus": list(range(32 * (i % 2), 32 * (i % 2) + 32)),
                "restarts": 0,
                "rings": [f"w{i}.req", f"w{i}.resp"],
                "pid": 10000 + i,
                "state": "running",
                "jobs": 5000,
                "jobs_failed": 0,
                "bytes_saved": 1 << 34,
                "bytes_loaded": 1 << 33,
                "busy_ns": 10**9,
                "inflight_seq": i % 2,
                "heartbeat_ns": time.time_ns(),
            }
            for i in range(n_workers)
        ],
        "clients": [
            {"id": i, "pid": 20000 + i, "name": f"vllm-{i}", "namespaces": [i % 3], "ranks": [0, 1]}
            for i in range(n_clients)
        ],
        "rings": [{"name": f"c{i}.{d}", "capacity": 1024} for i in range(n_clients) for d in ("req", "resp")],
    }
    if storage is not None:
        snap["storage"] = storage
    from hpkv.monitor.rings import RingLevel

    rings = {r["name"]: RingLevel(i % 5, 1024) for i, r in enumerate(snap["rings"])}
    rings.update({f"w{i}.req": RingLevel(3, 1024) for i in range(n_workers)})
    return View(
        "/dev/shm/hpkv",
        "up",
        pid=4242,
        snap=snap,
        rings=rings,
        totals={"hits_dram": 3 * 10**7},
        rates={"hits_dram": 1234.5, "dev_save": 2.5e9},
        history={"hits_dram": [(60 - t, float(t)) for t in range(60)]},
        worker_busy={i: 0.5 for i in range(n_workers)},
    )


@pytest.mark.parametrize("width,height", [(80, 24), (100, 30), (200, 60)])
def test_frame_fits_the_screen_and_counts_what_it_leaves_out(width, height):
    lines = render(_busy_view(), width, height)
    assert len(lines) <= height
    assert all(len(text) <= width for text, _ in lines)
    text = "\n".join(t for t, _ in lines)
    assert "server 4242" in text and "model-0" in text
    if height < 40:
        assert re.search(r"\+ \d+ more (workers|engines|rings)", text), text


def test_frame_shows_the_storage_tier_and_why_o_direct_is_off():
    storage = {
        "path": "/nvme/hpkv",
        "files": 5000,
        "bytes": 5 << 30,
        "capacity_bytes": 100 << 30,
        "free_bytes": 700 << 30,
        "o_direct": False,
        "o_direct_reason": "tmpfs rejects O_DIRECT",
        "io_errors": 2,
        "quarantined": 1,
        "spill_paused": True,
        "bytes_written": 1,
        "bytes_read": 1,
        "spills": 10,
        "promotes": 3,
        "evicted_files": 7,
    }
    text = render_text(_busy_view(storage=storage), 120, 40)
    line = line_with(text, "^STORAGE")
    assert (
        "/nvme/hpkv" in line
        and "5000 files" in line
        and "5.0 GiB of 100.0 GiB" in line
        and "free 700.0 GiB" in line
    )
    detail = text.splitlines()[text.splitlines().index(line) + 1]
    assert (
        "O_DIRECT off (tmpfs rejects O_DIRECT)" in detail
        and "io errors 2" in detail
        and "quarantined 1" in detail
        and "SPILL PAUSED" in detail
    )


def test_frame_without_unicode_uses_ascii_sparklines():
    text = render_text(_busy_view(), 120, 40, unicode=False)
    assert text.isascii()
    spark = line_with(text, "^hits DRAM")
    assert not any(ch in spark for ch in "▁▂▃▄▅▆▇█") and "#" in spark


# ------------------------------------------------------------------ ring peek
def test_ring_peek_reads_the_depth_without_taking_an_end(tmp_path):
    d = f"/dev/shm/hpkv-peek-{uuid.uuid4().hex[:8]}"
    os.makedirs(d)
    try:
        prod = Ring.create(d, "peeked", capacity=8, role="producer")
        cons = Ring.attach(d, "peeked", role="consumer")
        assert peek(d, "peeked") == (0, 8)
        for i in range(5):
            prod.try_push(1, i + 1)
        assert peek(d, "peeked") == (5, 8) and cons.depth == 5
        cons.try_pop()
        ends = (prod.end("producer"), prod.end("consumer"))
        assert peek(d, "peeked") == (4, 8)
        assert (prod.end("producer"), prod.end("consumer")) == ends, "peeking claims no end"
        # the ends are still the owners': both sides keep working and see each other alive
        assert prod.peer_alive and cons.peer_alive
        assert cons.try_pop().seq == 2
        assert peek(d, "missing") is None
        prod.close()
        cons.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_status_and_top_show_a_degraded_storage_tier_with_its_reason_and_counters():
    from hpkv.monitor import frame
    from hpkv.monitor.status import format_status

    st = {
        "path": "/nfs/kv",
        "files": 3,
        "o_direct": True,
        "state": "degraded",
        "degraded_reason": "every storage stat thread is stuck (the file system does not answer)",
        "degraded_since": time.time() - 5,
        "stat_saturated": 12,
        "gone": 0,
    }
    lines = frame._storage({"storage": st}, 120)
    degraded = [text for text, style in lines if "DEGRADED" in text]
    assert len(degraded) == 1 and "stat thread is stuck" in degraded[0] and " since " in degraded[0]
    assert any("stats saturated 12" in text and "gone" not in text for text, _ in lines), lines
    snap = {
        "server": {"pid": 1, "pool_dir": "/dev/shm/x", "storage": "/nfs/kv"},
        "pool": {"used_bytes": 0, "capacity_bytes": 1, "pinned_bytes": 0, "blocks": 0},
        "requests": 0,
        "errors": 0,
        "worker_restarts": 0,
        "namespaces": [],
        "workers": [],
        "clients": [],
        "storage": st,
    }
    text = format_status(snap)
    assert re.search(
        r"^storage   /nfs/kv  DEGRADED since \d\d:\d\d:\d\d: every storage stat thread", text, re.M
    )
    assert "stats saturated 12" in text
    assert "DEGRADED" not in format_status({**snap, "storage": {**st, "state": "ok"}})

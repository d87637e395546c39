"""Issue 26, items 7 and 12: the pool's file system full, and what engines' KV caches need of it.

Each test mounts a small tmpfs of its own (root) as the pool's file system, so that
"full" is real: the kernel refuses pages, and a process touching an unbacked page of
a mapping takes SIGBUS.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import psutil
import pytest

from hpkv.client import HpkvError, connect
from hpkv.common.pool import PoolFile
from hpkv.common.proc import pid_stopped
from hpkv.engine.index import Index, Namespace
from hpkv.engine.storage.catalog import FileCatalog
from hpkv.protocol import wire as P
from hpkv.protocol.keys import block_keys, namespace_fingerprint
from hpkv.testing.server import ServerProcess, private_env, wait_for

MIB = 1 << 20
FP = namespace_fingerprint({"model": "pool-hardening", "layers": 2})
SLOT = MIB

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (root only)")


@contextlib.contextmanager
def tmpfs(path: str, size: int) -> Iterator[str]:
    os.makedirs(path, mode=0o700, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", path], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)


def fill(directory: str) -> str:
    """Take every free byte of ``directory``'s file system; returns the filler's path."""
    path = os.path.join(directory, "filler")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        off = 0
        for chunk in (MIB, 4096):
            while True:
                try:
                    os.posix_fallocate(fd, off, chunk)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break
                off += chunk
    finally:
        os.close(fd)
    return path


def allocated(path: str) -> int:
    return os.stat(path).st_blocks * 512


def touch_slots_in_a_child(pool_path: str, offsets: list[int]) -> int:
    """Write into each slot from another process that maps the pool (as a transfer worker or
    SGLang's in-process backend does); its exit status (-SIGBUS when a page has no memory)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            fd = os.open(pool_path, os.O_RDWR)
            mm = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED)
            for off in offsets:
                mm[off] = 1
                mm[off + SLOT - 1] = 1
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


@pytest.fixture
def sparse_pool_on_a_full_fs(tmp_path) -> Iterator[tuple[ServerProcess, Any]]:
    """A server whose 512 MiB pool is still mostly sparse when its file system fills up, and a
    client attached (with a 1 MiB-slot namespace) before that."""
    with tmpfs(str(tmp_path / "shm"), 512 * MIB + 32 * MIB) as mnt:  # the pool, stats, rings
        env = private_env("512m", HPKV_SHARE_MEM_FILE_PATH=os.path.join(mnt, "hpkv"))
        srv = ServerProcess(env).start()
        try:
            assert srv.proc is not None
            with connect(srv.cfg, spawn=False, call_timeout=30.0) as c:
                c.ns = c.attach_namespace(FP, 1, SLOT)
                os.kill(srv.proc.pid, signal.SIGSTOP)  # its warmer takes no more meanwhile
                try:
                    warm = allocated(os.path.join(srv.pool_dir, P.POOL_FILE))
                    assert warm <= 384 * MIB, (
                        f"the pool was warmed to {warm // MIB} MiB before the test could fill"
                    )
                    fill(mnt)
                finally:
                    os.kill(srv.proc.pid, signal.SIGCONT)
                yield srv, c
        finally:
            srv.cleanup()


def reserve_all(c, ns_id: int, n: int, tag: bytes) -> np.ndarray:
    keys = block_keys(FP, [tag + b"%d" % i for i in range(n)])
    return np.concatenate([c.reserve(ns_id, keys[i : i + 64])[:, 0] for i in range(0, n, 64)])


# ------------------------------------------------------------------ 7. a full pool file system
@needs_root
def test_a_full_pool_file_system_skips_saves_logs_it_and_no_process_takes_sigbus(sparse_pool_on_a_full_fs):
    srv, c = sparse_pool_on_a_full_fs
    pool_path = os.path.join(srv.pool_dir, P.POOL_FILE)
    offsets = reserve_all(c, c.ns.ns_id, 512, b"full")
    handed = [int(o) for o in offsets if o >= 0]
    status = touch_slots_in_a_child(pool_path, handed)
    assert status == 0, f"a process touching a handed-out slot died (status {status}; -7 is SIGBUS)"
    assert (offsets == -2).any(), "the file system is full: some reserves must be skipped"
    assert max(handed) + SLOT <= allocated(pool_path), "a slot was handed out over unreserved memory"
    assert c.stats()["server"]["pid"] == srv.proc.pid  # and the server serves on
    log = srv.log()
    assert f"the file system of {srv.pool_dir} is full" in log, log[-3000:]
    assert "bytes needed at offset" in log and "free" in log
    assert "Traceback" not in log, log[-3000:]


@needs_root
def test_hello_on_a_full_pool_file_system_is_refused_with_the_reason_not_an_internal_error(
    sparse_pool_on_a_full_fs,
):
    srv, _ = sparse_pool_on_a_full_fs
    with pytest.raises(HpkvError) as info:
        connect(srv.cfg, spawn=False, call_timeout=30.0)
    msg = str(info.value)
    assert "internal" not in msg, msg
    assert srv.pool_dir in msg and "No space left on device" in msg, msg
    assert "Traceback" not in srv.log()
    assert not [n for n in os.listdir(srv.pool_dir) if n.startswith("c2.")], "the refused client left files"


@needs_root
def test_warming_resumes_when_space_returns_and_saves_find_slots_again(sparse_pool_on_a_full_fs):
    srv, c = sparse_pool_on_a_full_fs
    pool_path = os.path.join(srv.pool_dir, P.POOL_FILE)
    assert (reserve_all(c, c.ns.ns_id, 512, b"a") == -2).any()
    os.unlink(os.path.join(os.path.dirname(srv.pool_dir), "filler"))
    deadline = time.monotonic() + 120  # minutes at idle priority on a loaded machine
    while allocated(pool_path) < 512 * MIB:
        assert time.monotonic() < deadline, (
            f"warming did not resume: {allocated(pool_path) // MIB} MiB of 512 after 120 s\n{srv.log()[-2000:]}"
        )
        time.sleep(0.2)
    again = reserve_all(c, c.ns.ns_id, 64, b"b")
    assert (again >= 0).all(), again
    assert touch_slots_in_a_child(pool_path, [int(o) for o in again]) == 0
    assert "memory can be reserved again" in srv.log()


def test_a_promote_into_memory_that_cannot_be_reserved_misses_and_frees_what_it_took(tmp_path):
    """Promote takes slots through the same allocator path as reserve: a refused reservation of
    memory is a miss (the block stays STORED), never a slot over unbacked memory."""

    class Full:
        backed = 2 * SLOT

        def reserve_to(self, end: int) -> bool:
            return end <= self.backed

    idx = Index(8 * SLOT, storage_enabled=True, memory=Full())
    ns = Namespace(0, "n", FP, 1, SLOT)
    idx.add_namespace(ns)
    keys = block_keys(FP, [b"p%d" % i for i in range(4)])
    files = FileCatalog(idx)
    for k in keys:
        files.add(ns, k)
    got = [idx.begin_promote(ns, k) for k in keys]
    assert [g is not None for g in got] == [True, True, False, False]
    assert idx.alloc.used == 2 * SLOT


def test_a_pool_file_reserves_memory_chunk_by_chunk_and_keeps_what_engines_need_free(tmp_path):
    with tmpfs(str(tmp_path / "shm"), 96 * MIB) as mnt:
        pool = PoolFile.create(os.path.join(mnt, "pool"), 64 * MIB)
        try:
            assert pool.backed == 0
            assert pool.reserve_to(SLOT) and pool.backed == 16 * MIB  # one warm chunk, not one slot
            assert allocated(pool.path) == 16 * MIB
            assert pool.reserve_to(10 * MIB)  # below the reserved prefix: no system call
            pool.keep_free = lambda: 64 * MIB  # an engine's KV cache: 80 MiB are free, 64 kept
            assert pool.reserve_to(32 * MIB)
            assert not pool.reserve_to(48 * MIB), "it would leave less free than an engine needs"
            assert pool.backed == 32 * MIB
        finally:
            pool.close()


def test_an_in_process_mapping_of_a_sparse_pool_allocates_none_of_it(tmp_path):
    """SGLang's in-process backend maps the pool in SGLang's process: populating that shared
    mapping of a tmpfs file would allocate every hole (the whole pool, seconds per GiB, past
    the server's free-space checks; with the file system full, the pages it could not get
    are a SIGBUS later)."""
    from hpkv.common import shm

    with tmpfs(str(tmp_path / "shm"), 96 * MIB) as mnt:
        pool = PoolFile.create(os.path.join(mnt, "pool"), 64 * MIB)
        try:
            assert pool.reserve_to(SLOT)
            view = shm.map_file(pool.path, populate=False)  # as HpkvHiCacheStorage maps it
            assert allocated(pool.path) == 16 * MIB, "mapping the pool allocated its holes"
            view[0] = 1  # a reserved slot: fine
            view.close()
        finally:
            pool.close()


# ------------------------------------------------------------------ 12. engines' KV-cache files
ENGINE = r"""
import os, sys
from hpkv.client import connect
from hpkv.common import shm
from hpkv.config import load_config
from hpkv.protocol.wire import device_file_name

fp, size, page = sys.argv[1], int(sys.argv[2]), 64 << 10
c = connect(load_config(dict(os.environ)), spawn=False, call_timeout=30.0, name="fake vLLM worker")
ns = c.attach_namespace(fp, 1, page, rank=0)
print("attached", flush=True)
path = os.path.join(c.dir, device_file_name(os.getpid(), 0))
sys.stdin.readline()
shm.create(path, size, exclusive=False)  # vLLM's KV cache, as the CPU connector places it
print("placed", flush=True)
sys.stdin.readline()
c.register_device(
    ns.ns_id, rank=0, regions=[{"path": path, "size": size}], layer_bases=[(0, 0)],
    block_stride=page, page_bytes=page, num_blocks=size // page,
)
print("registered", flush=True)
if sys.stdin.readline().strip() == "quit":  # a clean shutdown removes the file itself
    os.unlink(path)
    c.close()
    sys.exit(0)
sys.stdin.readline()
"""


class FakeEngine:
    """A process that places a KV cache of ``size`` bytes in the pool directory (as the vLLM
    worker does on the CPU backend) and registers it, step by step on the test's word."""

    def __init__(self, srv: ServerProcess, size: int):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ENGINE, FP, str(size)],
            env={**srv.env, "PYTHONPATH": os.pathsep.join(sys.path)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.path = os.path.join(srv.pool_dir, P.device_file_name(self.proc.pid, 0))
        self.expect("attached")

    def expect(self, word: str) -> None:
        line = self.proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert line == word, f"fake engine said {line!r}, not {word!r} (exit {self.proc.poll()})"

    def step(self, word: str, then: str | None) -> None:
        self.proc.stdin.write(word + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        if then:
            self.expect(then)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_killed_engines_kv_cache_file_is_removed_even_before_its_process_is_reaped():
    """vLLM's shutdown SIGKILLs its workers: the connection closes while the process is still
    there (a zombie until its parent reaps it), so "is it alive?" at detach says yes."""
    with ServerProcess(private_env("64m")) as srv:
        engine = FakeEngine(srv, 8 * MIB)
        try:
            engine.step("go", "placed")
            engine.step("go", "registered")
            os.kill(engine.proc.pid, signal.SIGKILL)  # not reaped: a zombie from now on
            wait_for(lambda: proc_state(engine.proc.pid) == "Z", 10, "the engine to exit")
            wait_for(lambda: "detached" in srv.log(), 10, "the server to see the engine go")
            wait_for(
                lambda: not os.path.exists(engine.path),
                10,
                f"the dead engine's KV-cache file {engine.path} to be removed\n{srv.log()[-2000:]}",
            )
            assert proc_state(engine.proc.pid) == "Z"
            assert f"removed the KV-cache file {engine.path}" in srv.log()
        finally:
            engine.kill()


@needs_root
def test_warming_leaves_a_detached_engines_kv_cache_space_for_its_return(tmp_path):
    """An engine stopped and started again (vLLM after Ctrl-C) finds the space its KV cache
    had, even where the pool and that KV cache do not both fit (an over-committed tmpfs)."""
    kv = 64 * MIB
    env = private_env("768m", HPKV_SHARE_MEM_FILE_PATH=str(tmp_path / "shm" / "hpkv"))
    with tmpfs(str(tmp_path / "shm"), 768 * MIB + 16 * MIB) as mnt, ServerProcess(env) as srv:
        assert srv.proc is not None
        engine = FakeEngine(srv, kv)
        try:
            os.kill(srv.proc.pid, signal.SIGSTOP)  # the pool is still mostly sparse: keep it so
            try:
                warm = allocated(os.path.join(srv.pool_dir, P.POOL_FILE))
                assert warm <= 512 * MIB, f"the pool was warmed to {warm // MIB} MiB before the test"
                engine.step("go", "placed")
            finally:
                os.kill(srv.proc.pid, signal.SIGCONT)
            engine.step("go", "registered")
            engine.step("quit", None)  # the engine stops; it removes its own file
            assert engine.proc.wait(30) == 0
            wait_for(lambda: "detached" in srv.log(), 10, "the server to see the engine go")

            def settled() -> bool:
                st = os.statvfs(mnt)
                return st.f_bavail * st.f_frsize < kv or "kept free for engines' KV caches" in srv.log()

            wait_for(settled, 60, "the warmer to take the space or to leave it")
            returning = os.path.join(srv.pool_dir, P.device_file_name(os.getpid(), 0))
            try:
                with open(returning, "wb") as f:
                    os.posix_fallocate(f.fileno(), 0, kv)  # the engine's KV cache, again
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(returning)
            assert "beside engines' KV-cache files" in srv.log(), "registration warns of the shortfall"
        finally:
            engine.kill()


@contextlib.contextmanager
def late_reaper() -> Iterator[None]:
    """Make this process the reaper of its orphaned descendants (PR_SET_CHILD_SUBREAPER) and
    reap them only at the end, as a container's init that reaps late does: a vLLM worker
    SIGKILLed by vLLM's shutdown then stays a zombie, its pid still taken."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    try:
        yield
    finally:
        libc.prctl(36, 0, 0, 0, 0)
        for child in psutil.Process().children():
            if child.status() == psutil.STATUS_ZOMBIE:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(child.pid, os.WNOHANG)


@needs_root
@pytest.mark.vllm
@pytest.mark.alone  # Ctrl-C's bounded wait and the warming wait, next to another engine's start
@pytest.mark.timeout(1500)
def test_a_vllm_restarted_after_ctrl_c_still_places_its_kv_cache_once_the_pool_is_warm(tiny_model, tmp_path):
    """CT-HPKV's sequence, scaled down: the pool directory on a tmpfs that holds the pool and
    one KV cache (not two); vLLM started, served, stopped with Ctrl-C; the server finishes
    warming; vLLM started again must place its KV cache in the pool directory and load from
    hpkv. vLLM's shutdown SIGKILLs its worker; whether the worker removed its KV-cache file
    first is a race (here it usually wins; in CT-HPKV's run it lost): the worker is stopped
    (SIGSTOP) before Ctrl-C so that it always loses, and stays a zombie until reaped."""
    from hpkv.testing.server import env_without_hpkv
    from hpkv.testing.vllm_server import SEED_KV_TRANSFER_CONFIG, VllmServer, hpkv_loads

    pool, kv_gib = 512 * MIB, 1
    mnt = str(tmp_path / "shm")
    env = env_without_hpkv()
    env.update(
        HOME=str(tmp_path / "home"),
        HPKV_SHARE_MEM_FILE_PATH=os.path.join(mnt, "hpkv"),
        HPKV_KV_MEM_POOL_SIZE="512M",
        VLLM_CPU_KVCACHE_SPACE=str(kv_gib),
    )
    pool_dir = env["HPKV_SHARE_MEM_FILE_PATH"]
    prompt = "A " * 1400  # CT-HPKV's prompt shape, above the 1204-token threshold

    def start(log: str) -> VllmServer:
        srv = VllmServer(
            tiny_model,
            extra_args=["--kv-transfer-config", SEED_KV_TRANSFER_CONFIG],
            env=env,
            max_model_len=4096,
            log_path=tmp_path / log,
        )
        servers.append(srv)
        return srv.start().wait_ready(timeout=600)

    def ask(srv: VllmServer) -> str:
        return srv.completion(prompt, max_tokens=8, temperature=0)["choices"][0]["text"]

    def kv_files() -> list[str]:
        return sorted(n for n in os.listdir(pool_dir) if n.startswith(P.DEVICE_FILE_PREFIX))

    servers: list[VllmServer] = []
    with tmpfs(mnt, pool + (kv_gib << 30) + 256 * MIB), late_reaper():
        try:
            srv = start("vllm.log")
            cold = ask(srv)
            first = kv_files()
            assert len(first) == 1, first
            worker = P.device_file_pid(first[0])
            assert worker is not None
            os.kill(worker, signal.SIGSTOP)  # busy: it runs no shutdown code before vLLM kills it
            if srv.interrupt(timeout=60) is None and pid_stopped(worker):
                # vLLM's shutdown sometimes kills EngineCore before it lists the worker, which
                # then stays stopped, orphaned: end it as the shutdown meant to (SIGKILL)
                os.kill(worker, signal.SIGKILL)
            assert srv.interrupt() is not None, "vLLM did not exit after Ctrl-C"
            deadline = time.monotonic() + 300  # the server, still running, finishes warming
            while allocated(os.path.join(pool_dir, P.POOL_FILE)) < pool:
                assert time.monotonic() < deadline, "the pool did not finish warming"
                time.sleep(0.5)
            srv = start("vllm-restarted.log")
            log = srv.log_tail(100_000)
            assert "cannot place" not in log, (first, kv_files(), log[-3000:])
            assert not set(first) & set(kv_files()), (
                f"the stopped vLLM's KV-cache file {first} is still there"
            )
            before = hpkv_loads(env)
            assert ask(srv) == cold
            assert hpkv_loads(env)["dram"] > before["dram"], "the restarted vLLM loads from hpkv's pool"
            assert "could not be loaded" not in srv.log_tail(100_000)
        finally:
            for s in servers:
                s.stop()
            with contextlib.suppress(OSError):  # kept for a failure's post-mortem
                shutil.copy(os.path.join(pool_dir, P.LOG_FILE), tmp_path / "server.log")
            subprocess.run([sys.executable, "-m", "hpkv", "stop"], env=env, capture_output=True, timeout=180)
            ServerProcess(env).stop_spawned()


@needs_root
def test_a_kv_cache_that_does_not_fit_names_the_cause_in_the_log_and_in_every_failed_load(tmp_path, caplog):
    from hpkv.connectors.vllm.worker import WorkerSide

    with tmpfs(str(tmp_path / "shm"), 16 * MIB) as mnt:
        side = WorkerSide(None, 0, mnt, "cpu", open_store=lambda spec: None)  # type: ignore[arg-type]
        with caplog.at_level("ERROR", logger="vllm.hpkv"):
            assert side._alloc_shared_kv(64 * MIB) is None
        assert not side.enabled
        text = caplog.text
        assert "cannot place the 67108864-byte KV cache" in text and "No space left on device" in text
        assert "bytes free of 16777216" in text, text
        why = side.unavailable_reason()
        assert "no hpkv server" not in why
        assert "KV cache did not fit" in why and mnt in why and "No space left on device" in why, why
        assert not os.listdir(mnt), "the partial KV-cache file is removed"

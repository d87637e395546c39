"""Issue 26, items 1 and 9: the storage tree is trusted only as far as its descriptors reach,
and O_DIRECT refused at read time costs one buffered retry, not every promote.

Real ``hpkv serve`` processes throughout; another local user (nobody) where the attack needs
one; ``strace`` injects the read-time EINVAL into a live IO worker.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest
from test_storage import Writer, io_worker_pids, running  # the storage tests' real-process helpers

from hpkv.io_workers import kvfile
from hpkv.io_workers.tree import DIR_CACHE_TTL_S
from hpkv.protocol.keys import namespace_fingerprint
from hpkv.testing.server import (
    ServerProcess,
    assert_serves_correctly,
    private_env,
    serve_fails,
    start_under_umask,
)

FP = namespace_fingerprint({"model": "hardening-storage", "layers": 4})
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")


def _as_nobody(cwd: Path, fn) -> None:
    """Run ``fn`` in ``cwd`` in a forked child that became nobody; raise if it failed. (pytest's
    tmp_path is under a 0700 directory of root's: nobody reaches ``cwd`` only from inside.)"""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(cwd)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fn()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child acting as nobody failed"


# ------------------------------------------------------------------ 1. ancestors of the root
@as_root
def test_a_private_storage_root_in_a_directory_another_user_can_write_is_refused_at_start(tmp_path):
    parent = tmp_path / "shared"
    parent.mkdir()
    os.chown(parent, NOBODY, NOBODY)  # nobody's directory: they may rename anything in it
    root = parent / "storage"
    root.mkdir(mode=0o700)  # ours and private: on 924ae3a that was all that was checked
    env = private_env(storage=str(root))
    msg = serve_fails(env)
    assert f"is inside {parent}, which is owned by nobody" in msg, msg
    assert "rename" in msg and f"chmod go-w {parent}" in msg

    # Why it matters: nobody can swap the tree under a running server.
    def swap() -> None:
        os.rename("storage", "moved-away")
        os.mkdir("storage", 0o700)

    _as_nobody(parent, swap)
    assert os.stat(root).st_uid == NOBODY


@pytest.mark.parametrize("mode", [0o777, 0o1777], ids=["world-writable", "sticky"])
def test_a_storage_root_under_a_world_writable_directory_needs_the_sticky_bit(tmp_path, mode):
    parent = tmp_path / "open"
    parent.mkdir()
    os.chmod(parent, mode)
    env = private_env(storage=str(parent / "storage"))
    if mode & stat.S_ISVTX:  # like /tmp: others cannot rename what is ours
        with ServerProcess(env) as srv:
            assert_serves_correctly(srv)
    else:
        msg = serve_fails(env)
        assert f"{parent}, which is writable by its group or by others without the sticky bit" in msg, msg


def test_missing_parents_of_the_storage_path_are_created_0700_whatever_the_umask(tmp_path):
    storage = tmp_path / "a" / "b" / "storage"
    env = private_env(storage=str(storage))
    srv = start_under_umask(env, 0)
    try:
        assert_serves_correctly(srv)
        modes = {
            p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "a", tmp_path / "a" / "b", storage)
        }
        assert modes == {"a": 0o700, "b": 0o700, "storage": 0o700}, "924ae3a: a and b were 0777"
    finally:
        srv.cleanup()


# ------------------------------------------------------------------ 1. paths below the root
def _spill(w: Writer, names, before: int) -> list[bytes]:
    keys = w.keys(names)
    w.put(keys)
    w.wait_storage(
        lambda s: s["spills"] + s["io_errors"] >= before + len(keys), 60, f"{len(keys)} spills or failures"
    )
    return keys


def test_a_namespace_directory_replaced_by_a_symlink_is_never_written_through(tmp_path):
    storage = tmp_path / "storage"
    elsewhere = tmp_path / "elsewhere"  # where the symlink points: outside the storage tree
    elsewhere.mkdir(mode=0o700)
    env = private_env(storage=str(storage), HPKV_NUM_IO_WORKERS="1")
    with running(env) as srv:
        w = Writer(srv, shard=8192, fp=FP)
        _spill(w, range(4), 0)
        assert len(list((storage / FP).rglob("*.kv"))) == 4
        # The namespace directory is renamed away and a symlink to elsewhere put in its place.
        os.rename(storage / FP, storage / "moved")
        os.symlink(elsewhere, storage / FP)
        s = w.storage()
        _spill(w, [f"soon{i}" for i in range(8)], s["spills"] + s["io_errors"])
        time.sleep(DIR_CACHE_TTL_S + 0.5)  # past the descriptor cache: the walk meets the symlink
        s = w.storage()
        _spill(w, [f"late{i}" for i in range(8)], s["spills"] + s["io_errors"])
        assert list(elsewhere.rglob("*")) == [], "924ae3a: KV files were written through the symlink"
        assert w.storage()["io_errors"] >= 8, "the spills through the symlink failed"
        assert "Too many levels of symbolic links" in srv.log() or "Not a directory" in srv.log()
        assert_serves_correctly(srv)
        w.close()


def test_a_symlink_at_the_io_workers_temporary_name_is_not_followed(tmp_path):
    victim = tmp_path / "victim"  # a file outside storage that the server's user may write
    victim.write_text("precious\n")
    storage = tmp_path / "storage"
    env = private_env(storage=str(storage), HPKV_NUM_IO_WORKERS="1")
    with running(env) as srv:
        w = Writer(srv, shard=8192, fp=FP)
        (pid,) = io_worker_pids(w)
        (key,) = w.keys(["k"])
        name = kvfile.file_name(key, 0)
        leaf = storage / kvfile.rel_dir(FP, key)
        leaf.mkdir(mode=0o700, parents=True)
        for d in (storage / FP, leaf.parent, leaf):
            os.chmod(d, 0o700)
        os.symlink(victim, leaf / kvfile.tmp_name(name, pid=pid))
        w.put([key])
        w.wait_spilled(1)
        assert victim.read_bytes() == b"precious\n", "924ae3a truncated and rewrote the symlink's target"
        final = leaf / name
        assert stat.S_ISREG(os.lstat(final).st_mode) and os.path.getsize(final) == kvfile.file_size(8192)
        assert "found at this IO worker's temporary name (a symlink" in srv.log()
        assert w.c.clear(w.ns.ns_id) == 1
        w.check_rows([key], w.c.promote(w.ns.ns_id, [key]))
        w.close()


def test_an_io_worker_refuses_a_storage_root_that_is_not_the_one_the_server_verified(tmp_path):
    storage = tmp_path / "storage"
    env = private_env(storage=str(storage), HPKV_NUM_IO_WORKERS="1")
    with running(env) as srv:
        w = Writer(srv, shard=8192, fp=FP)
        (pid,) = io_worker_pids(w)
        os.rename(storage, tmp_path / "moved")  # the root replaced while the server runs
        os.mkdir(storage, 0o700)
        os.kill(pid, 9)  # its replacement opens the root by name
        deadline = time.monotonic() + 30
        while "is no longer the directory the server verified" not in srv.log():
            assert time.monotonic() < deadline, srv.log()[-3000:]
            time.sleep(0.05)
        assert list(storage.iterdir()) == []
        w.close()


# ------------------------------------------------------------------ 9. O_DIRECT refused at read time
@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (scripts/setup.sh installs it)")
def test_o_direct_refused_at_read_time_falls_back_to_buffered_reads_once(tmp_path):
    env = private_env(pool_size="64m", storage=str(tmp_path / "storage"), HPKV_NUM_IO_WORKERS="1")
    with running(env) as srv:
        w = Writer(srv, shard=100_000, fp=FP)
        keys = w.keys(range(6))
        w.put(keys)
        w.wait_spilled(6)
        assert w.storage()["o_direct"], "the probe passed: reads start with O_DIRECT"
        assert w.c.clear(w.ns.ns_id) == 6
        (pid,) = io_worker_pids(w)
        # The first preadv(2) of each of the worker's threads fails with EINVAL, as on a file
        # system that opens O_DIRECT files and then refuses their reads.
        tracer = subprocess.Popen(
            ["strace", "-f", "-qq", "-o", os.devnull, "-e", "trace=preadv,preadv2",
             "-e", "inject=preadv,preadv2:error=EINVAL:when=1", "-p", str(pid)],
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 20
            while not _traced_by(pid, tracer.pid):
                assert tracer.poll() is None, tracer.stderr.read() if tracer.stderr else ""
                assert time.monotonic() < deadline, "strace did not attach"
                time.sleep(0.02)
            rows = w.c.promote(w.ns.ns_id, keys)
        finally:
            tracer.terminate()
            tracer.wait(10)
        w.check_rows(keys, rows)  # 924ae3a: the block that met EINVAL failed (and every later one would)
        log = srv.log()
        assert log.count("O_DIRECT reads were refused with EINVAL") == 1, log[-3000:]
        assert "this worker reads buffered from now on" in log
        w.c.unpin(w.ns.ns_id, keys)
        assert w.c.clear(w.ns.ns_id) == 6
        w.check_rows(keys, w.c.promote(w.ns.ns_id, keys))  # and later promotes, buffered
        assert w.storage()["promotes"] == 12
        w.close()


def _traced_by(pid: int, tracer: int) -> bool:
    """Is every thread of ``pid`` traced by ``tracer``?"""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        return all(
            f"TracerPid:\t{tracer}\n" in Path(f"/proc/{pid}/task/{t}/status").read_text() for t in tasks
        )
    except OSError:
        return False


@pytest.mark.parametrize("beneath", [True, False], ids=["openat2", "walk"])
def test_a_read_open_goes_through_no_symlink_with_or_without_openat2(tmp_path, monkeypatch, beneath):
    """StorageTree.open_file: one openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS) where the kernel
    has it, the directory walk where not; either way a symlinked directory or file is refused."""
    from hpkv.io_workers.tree import StorageTree

    monkeypatch.setattr(StorageTree, "beneath", beneath)
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "ns" / "aa" / "bb").mkdir(parents=True, mode=0o700)
    outside.mkdir()
    (outside / "k.kv").write_bytes(b"forged")
    (root / "ns" / "aa" / "bb" / "k.kv").write_bytes(b"ours")
    os.symlink(outside, root / "ns" / "aa" / "cc")
    os.symlink(outside / "k.kv", root / "ns" / "aa" / "bb" / "l.kv")
    os.chmod(root, 0o700)
    tree = StorageTree.open(str(root))
    try:
        fd = tree.open_file("ns/aa/bb", "k.kv", os.O_RDONLY)
        assert os.read(fd, 16) == b"ours"
        os.close(fd)
        escapes = [
            ("ns/aa/cc", "k.kv"),
            ("ns/aa/bb", "l.kv"),
            ("..", "outside/k.kv"),
            ("ns", "../../outside/k.kv"),
        ]
        for rel, name in escapes:
            with pytest.raises(OSError) as err:
                os.close(tree.open_file(rel, name, os.O_RDONLY))
            assert err.value.errno in (errno.ELOOP, errno.ENOTDIR, errno.EXDEV, errno.ENOENT), (
                rel,
                name,
                err,
            )
        with pytest.raises(FileNotFoundError):
            tree.open_file("ns/aa/bb", "missing.kv", os.O_RDONLY)
    finally:
        tree.close()

"""A real ``hpkv serve`` process in a private pool directory, for tests and benchmarks."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from hpkv.config import Config, load_config
from hpkv.protocol.wire import LOG_FILE, SOCKET_FILE, live_server_pid, read_lock_pid, slot_offset


def env_without_hpkv() -> dict[str, str]:
    """This process's environment less every hpkv setting (HPKV_*, VLLM_HPKV_*, VLLM_ENABLE_HPKV)."""
    return {
        k: v for k, v in os.environ.items() if not k.startswith(("HPKV_", "VLLM_HPKV", "VLLM_ENABLE_HPKV"))
    }


_config_files: list[tuple[int, str]] = []  # (the creating pid, the path): a fork removes none


@atexit.register
def _remove_config_files() -> None:
    for pid, path in _config_files:
        if pid == os.getpid():
            with contextlib.suppress(OSError):
                os.unlink(path)


def private_env(pool_size: str = "64m", storage: str | None = None, **extra: str) -> dict[str, str]:
    """An environment with its own pool directory under /dev/shm and an empty config file
    (removed when this process exits, if nothing removed it before)."""
    pool_dir = f"/dev/shm/hpkv-test-{uuid.uuid4().hex[:12]}"
    cfg_file = os.path.join(tempfile.gettempdir(), f"hpkv-test-{uuid.uuid4().hex[:8]}.ini")
    _config_files.append((os.getpid(), cfg_file))
    with open(cfg_file, "w") as f:
        f.write("# empty: tests configure hpkv through the environment\n")
    env = env_without_hpkv()
    env.update(
        HPKV_CONFIG_FILE_PATH=cfg_file,
        HPKV_SHARE_MEM_FILE_PATH=pool_dir,
        HPKV_KV_MEM_POOL_SIZE=pool_size,
        HPKV_KV_STORAGE_PATH=storage or "",
        HPKV_LOG_LEVEL="DEBUG",
    )
    env.update(extra)
    return env


@contextlib.contextmanager
def engine_env(name: str, pool_size: str, **extra: str) -> Iterator[dict[str, str]]:
    """:func:`private_env` with a storage directory of its own under /var/tmp, for a module
    whose engine spawns hpkv; at the end the spawned server is stopped (``hpkv stop``) and its
    pool directory, storage and config file removed."""
    storage = tempfile.mkdtemp(prefix=f"hpkv-{name}-storage-", dir="/var/tmp")
    env = private_env(pool_size=pool_size, storage=storage, **extra)
    try:
        yield env
    finally:
        subprocess.run([sys.executable, "-m", "hpkv", "stop"], env=env, capture_output=True, timeout=60)
        shutil.rmtree(env["HPKV_SHARE_MEM_FILE_PATH"], ignore_errors=True)
        shutil.rmtree(storage, ignore_errors=True)
        os.unlink(env["HPKV_CONFIG_FILE_PATH"])


def _own_group() -> dict[str, Any]:
    return {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}


class ServerProcess:
    """Starts ``hpkv serve`` with ``env``; ``stop()`` always ends it (SIGTERM, then SIGKILL).

    The server gets a process group of its own (``stop()`` kills the group) and, unless
    ``same_session``, a session of its own. An auto-spawned server stays in its engine's
    session, which the kernel's autogroup scheduling treats as one group: ``same_session``
    places it like that."""

    def __init__(
        self,
        env: Mapping[str, str],
        args: tuple[str, ...] = (),
        same_session: bool = False,
        prefix: Sequence[str] = (),
    ):
        self.same_session = same_session
        self.prefix = list(prefix)  # e.g. ``ip netns exec NAME``: it must exec the server (same pid)
        self.env = dict(env)
        self.cfg: Config = load_config(self.env)
        self.args = args
        self.proc: subprocess.Popen | None = None

    @property
    def pool_dir(self) -> str:
        return self.cfg.pool_dir

    def start(self, timeout: float = 30.0) -> ServerProcess:
        self.proc = subprocess.Popen(
            [*self.prefix, sys.executable, "-m", "hpkv", "serve", *self.args],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            **(_own_group() if self.same_session else {"start_new_session": True}),
        )
        deadline = time.monotonic() + timeout
        while not self.ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"hpkv serve exited with {self.proc.returncode}:\n{self.stderr()}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"hpkv serve did not start within {timeout}s:\n{self.log()}")
            time.sleep(0.02)
        return self

    def ready(self) -> bool:
        """This process (not a killed predecessor) holds the lock and accepts connections."""
        if self.proc is None or read_lock_pid(self.pool_dir) != self.proc.pid:
            return False
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(os.path.join(self.pool_dir, SOCKET_FILE))
            return True
        except OSError:
            return False
        finally:
            s.close()

    def stderr(self) -> str:
        if self.proc is None or self.proc.stderr is None:
            return ""
        try:
            return self.proc.stderr.read().decode(errors="replace") if self.proc.poll() is not None else ""
        except (OSError, ValueError):
            return ""

    def log(self) -> str:
        try:
            with open(os.path.join(self.pool_dir, LOG_FILE)) as f:
                return f.read()
        except OSError:
            return ""

    def terminate(self, timeout: float = 15.0) -> int | None:
        """SIGTERM and wait; returns the exit status (None if it had to be killed)."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        """End the server and its workers, whatever state they are in, and remove the directory."""
        self.terminate()
        self.kill()
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # leftover workers of a killed server
            except ProcessLookupError:
                pass
            if self.proc.stderr:
                self.proc.stderr.close()

    def stop_spawned(self, timeout: float = 15.0) -> None:
        """End a server the pool directory's lock names that this object did not start (an
        auto-spawned one, detached into a process group of its own), and its workers."""
        import psutil

        pid = live_server_pid(self.pool_dir)
        if pid is None or (self.proc is not None and pid == self.proc.pid):
            return
        try:
            server = psutil.Process(pid)
            procs = [server, *server.children(recursive=True)]
            server.terminate()  # drains, stops its workers, removes its files
        except psutil.NoSuchProcess:
            return
        _, alive = psutil.wait_procs(procs, timeout=timeout)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()

    def cleanup(self) -> None:
        self.stop()
        self.stop_spawned()
        shutil.rmtree(self.pool_dir, ignore_errors=True)
        if "HPKV_CONFIG_FILE_PATH" in self.env:  # private_env's empty config file
            try:
                os.unlink(self.env["HPKV_CONFIG_FILE_PATH"])
            except OSError:
                pass

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()


@contextlib.contextmanager
def running(env: Mapping[str, str]) -> Iterator[ServerProcess]:
    """A server for ``env`` while the block runs; cleaned up (stopped, pool removed) after it."""
    srv = ServerProcess(env).start()
    try:
        yield srv
    finally:
        srv.cleanup()


def assert_serves_correctly(srv: ServerProcess, timeout: float = 10.0) -> None:
    """A well-behaved client gets right answers from ``srv``: reserve, commit, lookup, pin,
    unpin on fresh keys of a fresh namespace (for tests that first throw garbage at it)."""
    from hpkv.client import connect
    from hpkv.protocol.keys import block_keys, namespace_fingerprint

    assert srv.proc is not None and srv.proc.poll() is None, "the server died"
    fp = namespace_fingerprint({"model": "well-behaved", "t": time.monotonic_ns()})
    with connect(srv.cfg, spawn=False, call_timeout=timeout) as c:
        ns = c.attach_namespace(fp, 1, 8192)
        keys = block_keys(fp, [b"ok-%d" % i for i in range(4)])
        slots = c.reserve(ns.ns_id, keys)
        assert (slots >= 0).all() and len(set(slots[:, 0])) == 4, slots
        assert c.commit(ns.ns_id, keys) == 4
        assert c.lookup(ns.ns_id, keys) == (4, [1] * 4)
        assert (c.pin(ns.ns_id, keys) == slot_offset(slots)).all()
        c.unpin(ns.ns_id, keys)
    assert srv.proc.poll() is None, "the server died"


def start_under_umask(env: Mapping[str, str], mask: int) -> ServerProcess:
    """A started server that inherited umask ``mask`` (what a careless operator's shell has)."""
    old = os.umask(mask)
    try:
        return ServerProcess(env).start()
    finally:
        os.umask(old)


def client_of(srv: ServerProcess, **kw: Any) -> Any:
    """A client of ``srv`` (never spawning a server), 10 s call timeout unless given."""
    from hpkv.client import connect

    kw.setdefault("call_timeout", 10.0)
    return connect(srv.cfg, spawn=False, **kw)


def status_json(env: Mapping[str, str]) -> dict[str, Any]:
    """``hpkv status --json`` of the server ``env`` points at (the command must succeed)."""
    out = subprocess.run(
        [sys.executable, "-m", "hpkv", "status", "--json"],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def control_call_as(srv: ServerProcess, uid: int, gid: int, msg: dict[str, Any]) -> dict[str, Any]:
    """Fork, become uid/gid (root only), connect to the server's socket and send one control
    line; the server's answer (``{"closed": true}`` when it closed without one). A forked child
    uses only the socket module, then ``_exit``s."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(10)
            s.connect(os.path.join(srv.pool_dir, SOCKET_FILE))
            try:
                s.sendall(json.dumps(msg).encode() + b"\n")
            except OSError:
                pass  # a refused peer may be answered and closed before it speaks
            data = b""
            while not data.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
            os.write(w, data or b'{"closed": true}\n')
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            os.write(w, json.dumps({"child_error": repr(exc)}).encode())
        finally:
            os._exit(0)
    os.close(w)
    out = b""
    while chunk := os.read(r, 65536):
        out += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(out)


def wait_for(cond: Any, timeout: float = 10.0, what: str = "condition", step: float = 0.05) -> Any:
    """Poll ``cond()`` until it returns something true (a numpy array: a non-empty one) and
    return it; an AssertionError naming ``what`` after ``timeout`` seconds."""
    import numpy as np

    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v.size > 0 if isinstance(v, np.ndarray) else v:
            return v
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(step)


def serve_fails(env: Mapping[str, str]) -> str:
    """Start ``hpkv serve`` with ``env``, expecting it to refuse: the reason it gives. A pool
    directory that existed before is left as it was (the test looks at it), one it made removed."""
    srv = ServerProcess(env)
    made = not os.path.exists(srv.pool_dir)
    try:
        srv.start()
    except RuntimeError as exc:
        return str(exc)
    finally:
        if made:
            srv.cleanup()
        else:
            srv.stop()
    raise AssertionError("the server started; it was expected to refuse")

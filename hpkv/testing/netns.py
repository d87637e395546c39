"""Private network namespaces for tests and benchmarks that run network servers.

Mooncake's master and clients bind wildcard addresses (0.0.0.0, ``*``) whatever they are told,
so they run only inside namespaces made here: each has its loopback up and, optionally, a veth
pair to a second namespace with private 10.x addresses, and nothing else. Every process started
through :meth:`Netns.popen` is killed by its pid at the end, then any process still inside the
namespace (a child of one of those), and the namespaces are deleted (their veths go with them),
whatever the block did.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

# The pair's addresses (a /24 of their own inside the two namespaces; never routed anywhere).
VETH_NET = "10.77.0"
CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def unavailable() -> str | None:
    """Why namespaces cannot be made here (not root, no ``ip``), or None when they can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns add)"
    if not shutil.which("ip"):
        return "needs the ip command (Debian package iproute2)"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Netns:
    """One namespace: :meth:`run` and :meth:`popen` start commands inside it (``ip netns exec``).
    ``addr`` is the address other namespaces reach it at (127.0.0.1 without a veth)."""

    def __init__(self, name: str, addr: str = "127.0.0.1"):
        self.name = name
        self.addr = addr
        self.procs: list[subprocess.Popen] = []

    def argv(self, cmd: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *cmd]

    def run(self, cmd: Sequence[str], timeout: float = 60, **kw: Any) -> subprocess.CompletedProcess:
        """Run ``cmd`` inside the namespace to its end (bounded by ``timeout``)."""
        return subprocess.run(self.argv(cmd), timeout=timeout, **kw)

    def popen(self, cmd: Sequence[str], env: Mapping[str, str] | None = None, **kw: Any) -> subprocess.Popen:
        """Start ``cmd`` inside the namespace, in a process group of its own; it is killed at the end."""
        p = subprocess.Popen(
            self.argv(cmd), env=dict(env) if env is not None else None, start_new_session=True, **kw
        )
        self.procs.append(p)
        return p

    def call(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """``fn(*args, **kw)`` on a thread that entered the namespace (``setns``: the network
        namespace is per thread), so the sockets it opens are the namespace's: this process
        reaches a server bound to the namespace's loopback while its other threads stay on
        the host's network. Returns what ``fn`` returned, raises what it raised."""
        out: dict[str, Any] = {}

        def run() -> None:
            try:
                fd = os.open(f"/run/netns/{self.name}", os.O_RDONLY)
                try:
                    if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                        err = ctypes.get_errno()
                        raise OSError(err, f"setns into network namespace {self.name}: {os.strerror(err)}")
                finally:
                    os.close(fd)
                out["value"] = fn(*args, **kw)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                out["error"] = exc

        t = threading.Thread(target=run, name=f"netns-{self.name}", daemon=True)
        t.start()
        t.join()  # fn bounds its own time (its requests' timeouts)
        if "error" in out:
            raise out["error"]
        return out["value"]

    def pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True, timeout=30)
        return [int(x) for x in out.stdout.split()]

    def stop(self, p: subprocess.Popen, sig: int = signal.SIGTERM, wait_s: float = 10) -> None:
        """End one started process (``sig``, then SIGKILL after ``wait_s``), by its pid."""
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, sig)
            try:
                p.wait(wait_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
                p.wait(10)

    def _teardown(self) -> None:
        for p in reversed(self.procs):
            self.stop(p)
        # Whatever those left behind inside the namespace (their children) ends with it.
        for _ in range(3):
            left = self.pids()
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)


@contextlib.contextmanager
def namespaces(count: int = 1, veth: bool = False) -> Iterator[list[Netns]]:
    """``count`` fresh namespaces (loopback up) for the block; with ``veth`` (needs two) a veth
    pair joins the first two, at ``10.77.0.1`` and ``10.77.0.2``. Raises RuntimeError with the
    reason where namespaces cannot be made (see :func:`unavailable`)."""
    why = unavailable()
    if why:
        raise RuntimeError(why)
    if veth and count < 2:
        raise ValueError("a veth pair needs two namespaces")
    tag = f"hpkv{os.getpid() % 100000}{uuid.uuid4().hex[:4]}"
    made: list[Netns] = []
    try:
        for i in range(count):
            ns = Netns(f"{tag}n{i}")
            _ip("netns", "add", ns.name)
            made.append(ns)
            _ip("-n", ns.name, "link", "set", "lo", "up")
        if veth:
            a, b = made[0], made[1]
            # Created straight inside the namespaces: the host's namespace never holds either end.
            _ip("link", "add", "hv0", "netns", a.name, "type", "veth", "peer", "name", "hv1", "netns", b.name)
            for ns, dev, host in ((a, "hv0", 1), (b, "hv1", 2)):
                ns.addr = f"{VETH_NET}.{host}"
                _ip("-n", ns.name, "addr", "add", f"{ns.addr}/24", "dev", dev)
                _ip("-n", ns.name, "link", "set", dev, "up")
        yield made
    finally:
        for ns in reversed(made):
            ns._teardown()

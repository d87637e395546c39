"""A Mooncake Store master inside a private network namespace, for tests and benchmarks.

:func:`master` starts ``mooncake_master`` (from the wheel) inside a :class:`~hpkv.testing.netns.Netns`
and waits until its RPC port listens; the namespace's teardown stops it. ``python -m
hpkv.testing.mooncake`` (run inside a namespace with :meth:`Netns.run`) is a client that puts,
gets and checks a few objects and prints what it saw as JSON, to probe a set-up end to end.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import mmap
import os
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpkv.io_workers import mooncake_api
from hpkv.testing.netns import Netns

RPC_PORT = 50051
METADATA_PORT = 8080
METRICS_PORT = 9003


@dataclass
class Master:
    ns: Netns
    proc: Any
    log: Path

    @property
    def rpc(self) -> str:
        return f"{self.ns.addr}:{RPC_PORT}"

    @property
    def metadata(self) -> str:
        return f"http://{self.ns.addr}:{METADATA_PORT}/metadata"


def _listening(ns: Netns, port: int) -> bool:
    out = ns.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, timeout=10)
    return bool(out.stdout.strip())


def _start(ns: Netns, log: Path, timeout: float, mode: str = "wb") -> Any:
    addr = ns.addr
    cmd = [
        mooncake_api.master_binary(),
        f"--rpc_address={addr}",
        f"--rpc_port={RPC_PORT}",
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_host={addr}",
        f"--http_metadata_server_port={METADATA_PORT}",
        f"--metrics_host={addr}",
        f"--metrics_port={METRICS_PORT}",
    ]
    with open(log, mode) as f:
        proc = ns.popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while not (_listening(ns, RPC_PORT) and _listening(ns, METADATA_PORT)):
            if proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited {proc.returncode}: {log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"mooncake_master not listening after {timeout:.0f} s: {log}")
            time.sleep(0.1)
    except BaseException:
        ns.stop(proc)
        raise
    return proc


@contextlib.contextmanager
def master(ns: Netns, log_dir: Path, timeout: float = 30) -> Iterator[Master]:
    """A master bound to ``ns.addr`` (its metadata HTTP server binds 0.0.0.0 regardless: hence
    the namespace). Stopped at the end of the block (also after :func:`restart`); the
    namespace's teardown is the backstop."""
    log = log_dir / "mooncake_master.log"
    m = Master(ns, _start(ns, log, timeout), log)
    try:
        yield m
    finally:
        ns.stop(m.proc)


def node_keys(m: Master, local_addr: str, segment: str) -> dict[str, str]:
    """An hpkv node's configuration keys for the remote tier on ``m``: its Mooncake client at
    ``local_addr``, contributing ``segment`` bytes ("0": a pure client)."""
    return {
        "HPKV_REMOTE_BACKEND": "mooncake",
        "HPKV_REMOTE_MASTER": m.rpc,
        "HPKV_REMOTE_METADATA": m.metadata,
        "HPKV_REMOTE_LOCAL_HOSTNAME": local_addr,
        "HPKV_REMOTE_SEGMENT_SIZE": segment,
    }


def restart(m: Master, timeout: float = 30) -> None:
    """Start the master again at the same addresses (after the test stopped or killed it); it
    starts empty (no HA: the old one's object list is gone). Its log goes on in the same file."""
    if m.proc.poll() is None:
        m.ns.stop(m.proc)
    m.proc = _start(m.ns, m.log, timeout, mode="ab")


def client_env(local_addr: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """An environment for a Mooncake client at ``local_addr`` (its transfer engine's address)."""
    out = dict(os.environ if env is None else env)
    out["MC_TCP_BIND_ADDRESS"] = local_addr
    return out


def connect(local: str, metadata: str, master_rpc: str, segment: int, local_buffer: int = 16 << 20) -> Any:
    """A set-up store client (TCP); raises RuntimeError naming the code when setup fails."""
    store = mooncake_api.store_class()()
    rc = store.setup(local, metadata, segment, local_buffer, "tcp", "", master_rpc)
    if rc != 0:
        raise RuntimeError(
            f"Mooncake setup({local}, {metadata}, {master_rpc}) failed: {mooncake_api.describe(rc)}"
        )
    return store


def _probe(args: argparse.Namespace) -> dict[str, Any]:
    """Put ``count`` objects of ``size`` bytes from a registered buffer, then exists and get them back."""
    store = connect(args.local, args.metadata, args.master, args.segment)
    n, size = args.count, args.size
    buf = mmap.mmap(-1, 2 * n * size)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert store.register_buffer(base, 2 * n * size) == 0
    keys = [f"{args.prefix}/{i}" for i in range(n)]
    crcs = []
    for i in range(n):
        data = os.urandom(size)
        buf[i * size : (i + 1) * size] = data
        crcs.append(zlib.crc32(data))
    out: dict[str, Any] = {}
    if args.put:
        out["put"] = store.batch_put_from(keys, [base + i * size for i in range(n)], [size] * n)
    out["exists"] = store.batch_is_exist([*keys, f"{args.prefix}/missing"])
    got = store.batch_get_into(keys, [base + (n + i) * size for i in range(n)], [size] * n)
    out["get"] = got
    out["crc"] = [zlib.crc32(buf[(n + i) * size : (n + i + 1) * size]) for i in range(n)]
    out["crc_put"] = crcs
    if args.hold:  # keep the segment (and so the objects) alive until stdin closes
        print(json.dumps(out), flush=True)
        sys.stdin.read()
    store.unregister_buffer(base)
    store.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpkv.testing.mooncake")
    p.add_argument("--local", required=True)
    p.add_argument("--metadata", required=True)
    p.add_argument("--master", required=True)
    p.add_argument("--segment", type=int, default=64 << 20)
    p.add_argument("--count", type=int, default=3)
    p.add_argument("--size", type=int, default=1 << 20)
    p.add_argument("--prefix", default="probe")
    p.add_argument("--put", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--hold", action="store_true", help="print, then keep the objects until stdin closes")
    args = p.parse_args(argv)
    out = _probe(args)
    if not args.hold:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

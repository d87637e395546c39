"""``hpkv status`` and ``hpkv stop``: read the stats segment, no RPC needed."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import time

from hpkv.config import Config, format_size
from hpkv.engine.protocol import LOCK_FILE, SOCKET_FILE
from hpkv.engine.server import read_lock_pid
from hpkv.engine.stats import StatsSegment


def server_pid(cfg: Config) -> int | None:
    """The pid of the live server of this pool directory, if any."""
    import fcntl
    path = os.path.join(cfg.pool_dir, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None  # nobody holds the lock: no server
    except BlockingIOError:
        return read_lock_pid(cfg.pool_dir)
    finally:
        os.close(fd)


def read_snapshot(cfg: Config) -> dict | None:
    if server_pid(cfg) is None:
        return None
    try:
        seg = StatsSegment.attach(cfg.pool_dir)
    except FileNotFoundError:
        return None
    try:
        return seg.snapshot()
    finally:
        seg.close()


def format_status(s: dict) -> str:
    p = s["pool"]
    lines = [f"hpkv server pid {s['server']['pid']}  pool dir {s['server'].get('pool_dir')}",
             f"pool      {format_size(p['used_bytes'])} used / {format_size(p['capacity_bytes'])}"
             f"  pinned {format_size(p['pinned_bytes'])}  blocks {p['blocks']}",
             f"storage   {s['server'].get('storage') or 'disabled'}",
             f"requests  {s['requests']}  errors {s['errors']}  worker restarts {s['worker_restarts']}",
             "", "NAMESPACE            RANKS  DRAM BLOCKS  PINNED  HITS DRAM  HITS STORAGE  MISSES  EVICTIONS"]
    for ns in s["namespaces"]:
        lines.append(f"{ns['name'][:20]:20} {ns['world_size']:5}  {ns['blocks_dram']:11}  {ns['blocks_pinned']:6}"
                     f"  {ns['hits_dram']:9}  {ns['hits_storage']:12}  {ns['misses']:6}  {ns['evictions']:9}")
    lines += ["", "WORKER  KIND      PID      DEVICE  NODE  CPUS    STATE     JOBS  FAILED  RESTARTS"]
    for w in s["workers"]:
        cpus = ",".join(map(str, w["cpus"]))
        lines.append(f"{w['slot']:6}  {w['kind']:8}  {w['pid']:7}  {w['device']:6}  {w['numa_node']!s:4}  {cpus[:6]:6}"
                     f"  {w['state']:8}  {w['jobs']:4}  {w['jobs_failed']:6}  {w['restarts']:8}")
    lines += ["", "CLIENT  PID      NAME"]
    for c in s["clients"]:
        lines.append(f"{c['id']:6}  {c['pid']:7}  {c['name']}")
    return "\n".join(lines)


def print_status(cfg: Config, as_json: bool = False) -> int:
    pid = server_pid(cfg)
    snap = read_snapshot(cfg) if pid is not None else None
    if snap is None:
        if pid is not None:   # holds the lock but has no stats segment yet (or no more)
            print(f"hpkv: server {pid} holds the pool directory {cfg.pool_dir} but is starting or "
                  "stopping (no stats yet); try again in a moment", file=sys.stderr)
            return 1
        print(f"hpkv: no server is running for the pool directory {cfg.pool_dir}", file=sys.stderr)
        return 1
    print(json.dumps(snap, indent=2) if as_json else format_status(snap))
    return 0


def _ask_to_stop(cfg: Config, timeout: float) -> dict | None:
    """Ask the server over its socket to stop and wait for the outcome of its spill drain;
    None if it cannot be asked (then a signal does it, without the report)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(os.path.join(cfg.pool_dir, SOCKET_FILE))
        s.sendall(json.dumps({"op": "shutdown", "pid": os.getpid(), "wait": True}).encode() + b"\n")
        line = s.makefile("rb").readline()
        return json.loads(line) if line else None
    except (OSError, ValueError):
        return None
    finally:
        s.close()


def stop_server(cfg: Config, timeout: float | None = None) -> int:
    """``hpkv stop``: the server writes pending spills (HPKV_STOP_DRAIN_TIMEOUT), then exits
    and removes its files; this says what happened and waits until it is gone."""
    pid = server_pid(cfg)
    if pid is None:
        print(f"hpkv: no server is running for the pool directory {cfg.pool_dir}", file=sys.stderr)
        return 1
    if timeout is None:
        timeout = float(cfg["HPKV_STOP_DRAIN_TIMEOUT"]) + 30.0
    deadline = time.monotonic() + timeout
    outcome = _ask_to_stop(cfg, timeout)
    if outcome is None or not outcome.get("ok"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    while time.monotonic() < deadline:
        if server_pid(cfg) is None:
            print(f"hpkv: server {pid} stopped{_describe_drain(outcome)}")
            return 0
        time.sleep(0.05)
    print(f"hpkv: server {pid} did not stop within {timeout:g}s", file=sys.stderr)
    return 1


def _describe_drain(outcome: dict | None) -> str:
    if not outcome or "pending" not in outcome:
        return ""
    if outcome["dropped"]:
        return (f"; {outcome['dropped']} of {outcome['pending']} pending block(s) were NOT written to "
                f"storage (HPKV_STOP_DRAIN_TIMEOUT expired after {outcome['seconds']:g}s)")
    if outcome["pending"]:
        return (f"; {outcome['pending']} pending block(s) written to storage first "
                f"({outcome['seconds']:g}s)")
    return "; nothing was pending"

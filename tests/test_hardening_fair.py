"""Issue 26, items 5, 6 and 11: one client cannot slow or lock out the others, and the
server's names, limits, stop and log stay sane whatever a client or an operator sends.
Real ``hpkv serve`` processes, one section per item."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np

from hpkv.client.connection import connect
from hpkv.protocol import wire as P
from hpkv.protocol.keys import block_keys, namespace_fingerprint
from hpkv.testing.server import ServerProcess

FP = namespace_fingerprint({"model": "fairness", "layers": 2})


def client_of(srv: ServerProcess, **kw):
    kw.setdefault("call_timeout", 10.0)
    return connect(srv.cfg, spawn=False, **kw)


def wait_for(cond, timeout: float = 10.0, what: str = "condition", step: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(step)


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


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ 5. a flooding client
FLOODER = textwrap.dedent(
    """
    import os, sys, time
    from hpkv.client.connection import connect
    from hpkv.config import load_config
    from hpkv.protocol import wire as P
    from hpkv.protocol.keys import block_keys

    c = connect(load_config(), spawn=False, name="flooder")
    ns = c.attach_namespace(sys.argv[1], 1, 8192)
    n = P.MAX_KEYS_PER_CALL
    keys = block_keys(sys.argv[1], [str(i).encode() for i in range(n)])
    c._mbox[: n * 16] = memoryview(b"".join(keys))
    print("flooding", flush=True)
    seq = 0
    while True:  # big lookups as fast as the ring takes them; answers read only to keep it going
        seq += 1
        c._req.push(P.LOOKUP, seq, ns.ns_id, n, timeout=5.0)
        while c._resp.try_pop() is not None:
            pass
    """
)


def test_a_client_flooding_its_ring_does_not_starve_another_clients_lookups(server):
    flooder = subprocess.Popen(
        [sys.executable, "-c", FLOODER, FP],
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

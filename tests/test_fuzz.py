"""Property-based fuzzing of both channels of a real ``hpkv serve`` (issue 14).

* the control socket: random JSON lines (known ops with random fields, random JSON
  values, bytes that are not JSON); every line gets exactly one answer;
* the hot path: descriptors with random kind, a0..a2, flags pushed straight onto a
  client's request ring over random mailbox bytes (sometimes real keys); every
  descriptor gets its completion, with status 0 or an error.

Afterwards the server process is alive and a well-behaved client gets correct
answers. The number of cases is bounded (about half a minute on 2 busy cores).
"""

from __future__ import annotations

import json
import os
import socket
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpkv.client.connection import connect
from hpkv.protocol import wire as P
from hpkv.protocol.keys import KEY_BYTES, block_keys, namespace_fingerprint
from hpkv.testing.server import ServerProcess, assert_serves_correctly, private_env

HOT_CASES = int(os.environ.get("HPKV_FUZZ_HOT_CASES", "3000"))
CONTROL_CASES = int(os.environ.get("HPKV_FUZZ_CONTROL_CASES", "1500"))
FPS = [namespace_fingerprint({"fuzz": i}) for i in range(3)]
U64 = st.integers(0, (1 << 64) - 1)
FUZZ_SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    """One server with storage, a namespace with READY and STORED blocks, and a fuzzing client."""
    storage = tmp_path_factory.mktemp("fuzz-storage")
    srv = ServerProcess(private_env(pool_size="64m", storage=str(storage), HPKV_LOG_LEVEL="INFO")).start()
    try:
        c = connect(srv.cfg, spawn=False, call_timeout=10.0)
        ns = c.attach_namespace(FPS[0], 1, 8192)
        c.attach_namespace(FPS[1], 4, 4096, rank=1)
        keys = block_keys(FPS[0], [b"k%d" % i for i in range(16)])
        c.reserve(ns.ns_id, keys)
        c.commit(ns.ns_id, keys)
        yield srv, c, keys
        c.close()
        assert srv.proc.poll() is None, "the server died during the fuzz"
        log = srv.log()
        assert "failed inside the server" not in log and "control call failed" not in log, (
            "an unexpected exception in the server (see the traceback in its log):\n" + log[-6000:]
        )
        assert_serves_correctly(srv)
    finally:
        srv.cleanup()


# ------------------------------------------------------------------ hot path
kinds = st.one_of(
    st.sampled_from([P.LOOKUP, P.RESERVE, P.COMMIT, P.PIN, P.UNPIN, P.PROMOTE]), st.integers(0, 0xFFFF)
)
small_or_any = st.one_of(st.integers(0, 3), st.integers(0, 64), U64)
counts = st.one_of(
    st.integers(0, 32),
    st.sampled_from([P.MAX_KEYS_PER_CALL, P.MAX_KEYS_PER_CALL + 1, P.MAX_KEYS_PER_CALL // 17 + 1]),
    U64,
)


@settings(max_examples=HOT_CASES, **FUZZ_SETTINGS)
@given(
    kind=kinds,
    a0=small_or_any,
    a1=counts,
    a2=st.one_of(st.integers(0, 8), st.just(1 << 45), st.integers(0, 20_000), U64),
    flags=st.integers(0, 0xFFFF),
    mbox=st.binary(max_size=2048),
    real_keys=st.lists(st.integers(0, 15), max_size=16),
)
def test_random_descriptors_and_mailboxes_are_always_answered(
    fuzzed, kind, a0, a1, a2, flags, mbox, real_keys
):
    srv, c, keys = fuzzed
    data = b"".join(keys[i] for i in real_keys) + mbox
    c._mbox[: len(data)] = np.frombuffer(data, np.uint8)
    if data and len(data) < 64 * KEY_BYTES:
        c._mbox[len(data) : 64 * KEY_BYTES] = 0
    c._seq += 1
    seq = c._seq
    c._req.push(kind, seq, a0, a1, a2, flags=flags, timeout=5.0)
    deadline = time.monotonic() + 30.0  # a promote may read files; never parks longer
    while True:
        d = c._resp.pop(timeout=max(0.0, deadline - time.monotonic()))
        if d.seq == seq:
            break
    assert d.kind == P.COMPLETION and d.status <= 0, (d.kind, d.status)
    assert srv.proc.poll() is None


# ------------------------------------------------------------------ control socket
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 70), 1 << 70)
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
    | st.sampled_from(FPS),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
fields = st.sampled_from(
    [
        "fingerprint",
        "world_size",
        "shard_bytes",
        "name",
        "rank",
        "block_tokens",
        "ns_id",
        "regions",
        "layer_bases",
        "block_stride",
        "page_bytes",
        "num_blocks",
        "device",
        "numa_node",
        "pid",
    ]
)
ops = st.sampled_from(["hello", "namespace", "register_device", "clear", "stats", "nope", ""])
messages = st.one_of(
    st.builds(lambda op, extra: {"op": op, **extra}, ops, st.dictionaries(fields, json_values, max_size=6)),
    json_values,
    st.binary(max_size=200).filter(lambda b: b"\n" not in b),
)


class Line:
    def __init__(self, srv: ServerProcess):
        self.srv = srv
        self.sock: socket.socket | None = None

    def call(self, payload: bytes) -> dict:
        if self.sock is None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(15)
            self.sock.connect(os.path.join(self.srv.pool_dir, P.SOCKET_FILE))
            self.f = self.sock.makefile("rb")
        self.sock.sendall(payload + b"\n")
        line = self.f.readline()
        assert line, "the server closed a connection that sent a bounded line"
        return json.loads(line)


@pytest.fixture(scope="module")
def line(fuzzed):
    ln = Line(fuzzed[0])
    yield ln
    if ln.sock is not None:
        ln.f.close()
        ln.sock.close()


@settings(max_examples=CONTROL_CASES, **FUZZ_SETTINGS)
@given(msg=messages)
def test_random_control_lines_are_always_answered(fuzzed, line, msg):
    payload = msg if isinstance(msg, bytes) else json.dumps(msg).encode()
    answer = line.call(payload)
    assert isinstance(answer, dict) and isinstance(answer.get("ok"), bool), answer
    if not answer["ok"]:
        assert isinstance(answer.get("error"), str)
    assert fuzzed[0].proc.poll() is None

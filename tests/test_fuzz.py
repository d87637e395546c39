"""Property-based fuzzing of both channels of a real ``hpkv serve`` (issue 14).

* the control socket: random JSON lines (known ops with random fields, random JSON
  values, bytes that are not JSON); every line gets exactly one answer;
* the hot path: descriptors with random kind, a0..a2, flags pushed straight onto a
  client's request ring over random mailbox bytes (sometimes real keys); every
  descriptor gets its completion, with status 0 or an error;
* the copy path (issue 26): copy jobs with random kind, count and event pushed straight
  onto a transfer worker's ring over random job tables (device blocks in and out of range;
  pool slot values that are the client's own reservations with their generation or
  another, another namespace's pinned slots, unaligned, past the pool, negative); every job
  gets its completion, and another engine's committed blocks keep every byte.

Afterwards the server process is alive and a well-behaved client gets correct
answers. The number of cases is bounded (about half a minute on 2 busy cores).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpkv.client import connect
from hpkv.protocol import wire as P
from hpkv.protocol.keys import KEY_BYTES, block_keys, namespace_fingerprint
from hpkv.testing.device import make_device
from hpkv.testing.server import ServerProcess, assert_serves_correctly, private_env

HOT_CASES = int(os.environ.get("HPKV_FUZZ_HOT_CASES", "3000"))
COPY_CASES = int(os.environ.get("HPKV_FUZZ_COPY_CASES", "1500"))
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


# ------------------------------------------------------------------ copy path
HONEST_PAGE, FUZZ_PAGE, LAYERS, DEV_BLOCKS = 8192, 4096, 2, 16


@pytest.fixture(scope="module")
def copy_fuzzed(fuzzed, tmp_path_factory):
    """An honest engine with committed blocks of known bytes (namespace FPS[1]-like shape of its
    own), and a fuzzing engine with its own device, namespace and live reservations."""
    srv = fuzzed[0]
    work = tmp_path_factory.mktemp("copy-fuzz")
    (work / "honest").mkdir()
    (work / "fuzzer").mkdir()
    honest = connect(srv.cfg, spawn=False, call_timeout=10.0, name="honest")
    hfp = namespace_fingerprint({"fuzz": "honest"})
    hns = honest.attach_namespace(hfp, 1, LAYERS * HONEST_PAGE)
    hdev = make_device(work / "honest", LAYERS, DEV_BLOCKS, HONEST_PAGE)
    hdev.fill_random(np.random.default_rng(11))
    hh = honest.register_device(hns.ns_id, rank=0, **hdev.spec)
    hkeys = block_keys(hfp, [b"h%d" % i for i in range(8)])
    slots = honest.reserve(hns.ns_id, hkeys)[:, 0]
    assert (slots >= 0).all() and hh.save(np.arange(8), slots) and honest.commit(hns.ns_id, hkeys) == 8
    want = [hdev.block_bytes(i) for i in range(8)]
    pinned = honest.pin(hns.ns_id, hkeys)[:, 0].tolist()  # the values a loader is handed
    honest.unpin(hns.ns_id, hkeys)

    fuzzer = connect(srv.cfg, spawn=False, call_timeout=10.0, name="copy-fuzzer")
    ffp = namespace_fingerprint({"fuzz": "copier"})
    fns = fuzzer.attach_namespace(ffp, 1, LAYERS * FUZZ_PAGE)
    fdev = make_device(work / "fuzzer", LAYERS, DEV_BLOCKS, FUZZ_PAGE)
    fh = fuzzer.register_device(fns.ns_id, rank=0, **fdev.spec)
    own = fuzzer.reserve(fns.ns_id, block_keys(ffp, [b"f%d" % i for i in range(8)]))[:, 0].tolist()
    assert all(v >= 0 for v in own)
    yield fh, own, pinned
    fh.close()
    fuzzer.close()
    # Whatever the fuzzer sent, the honest engine's blocks are the bytes it committed.
    rows = honest.pin(hns.ns_id, hkeys)[:, 0]
    hdev.fill_random(np.random.default_rng(99))
    assert (rows >= 0).all() and hh.load(np.arange(8), rows)
    assert [hdev.block_bytes(i) for i in range(8)] == want, "a fuzzed copy job changed another engine's block"
    honest.unpin(hns.ns_id, hkeys)
    hh.close()
    honest.close()


slot_values = st.one_of(
    st.integers(0, 7).map(lambda i: ("own", i)),  # its reservation, with its generation
    st.tuples(st.just("own-gen"), st.integers(0, 7), st.integers(0, (1 << 23) - 1)),
    st.integers(0, 7).map(lambda i: ("pinned", i)),  # another namespace's slot, as pinned
    st.integers(-(1 << 63), (1 << 63) - 1).map(lambda v: ("raw", v)),
    st.integers(0, 64 << 20).map(lambda v: ("raw", v)),  # in the pool, any alignment
)


block_ids = st.one_of(
    st.integers(0, DEV_BLOCKS - 1), st.integers(-2, DEV_BLOCKS + 1), U64.map(lambda v: v - (1 << 63))
)


@st.composite
def copy_jobs(draw):
    """(n, blocks, slot values): mostly a well-formed batch (n = its length), sometimes not."""
    pairs = draw(st.lists(st.tuples(block_ids, slot_values), max_size=8))
    n = draw(
        st.one_of(st.just(len(pairs)), st.integers(0, 9), st.sampled_from([P.MAX_PAIRS_PER_JOB + 1]), U64)
    )
    return n, [b for b, _ in pairs], [v for _, v in pairs]


@settings(max_examples=COPY_CASES, **FUZZ_SETTINGS)
@given(
    kind=st.one_of(st.sampled_from([P.COPY_SAVE, P.COPY_SAVE, P.COPY_LOAD]), st.integers(0, 0xFFFF)),
    event=st.one_of(st.just(0), st.integers(0, 3), U64),
    job=copy_jobs(),
)
def test_random_copy_jobs_are_always_answered_and_write_only_where_a_reservation_allows(
    fuzzed, copy_fuzzed, kind, event, job
):
    n, blocks, values = job
    fh, own, pinned = copy_fuzzed
    table = []
    for v in values:
        if v[0] == "own":
            table.append(own[v[1]])
        elif v[0] == "own-gen":
            table.append(P.slot_offset(own[v[1]]) | v[2] << P.SLOT_GEN_SHIFT)
        elif v[0] == "pinned":
            table.append(pinned[v[1]])
        else:
            table.append(v[1])
    link = fh.links[0]
    link.seq += 1
    seq = link.seq
    arena = link.jobs[seq % P.JOB_SLOTS]
    arena[:18] = 0
    m = min(n, 9)  # the worker reads the slot values after n block ids
    arena[: len(blocks)] = np.array(blocks, np.int64)
    arena[m : m + len(table)] = np.array(table, np.int64)
    link.req.push(kind & 0xFFFF, seq, n, event, timeout=5.0)
    link.inflight.add(seq)
    (status,) = fh.wait([(0, seq)], timeout=30.0).values()
    assert -(1 << 16) < status <= 0 and status != -errno.ETIMEDOUT, status
    assert fuzzed[0].proc.poll() is None


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
        "dram",
        "storage",
    ]
)
ops = st.sampled_from(["hello", "namespace", "register_device", "clear", "time_saved", "stats", "nope", ""])
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

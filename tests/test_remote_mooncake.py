"""Mooncake Store (the optional remote tier's store) inside private network namespaces.

Mooncake binds wildcard addresses whatever it is told, so everything here runs inside
namespaces the test makes (:mod:`hpkv.testing.netns`) and is stopped by pid at the end. The
tests skip, saying why, where there is no root, no ``ip`` or no Mooncake (``pip install
'hpkv[mooncake]'`` plus ``apt-get install libibverbs1``)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hpkv.client import connect
from hpkv.common.pool import PoolFile
from hpkv.engine.remote import PRESENT_TTL_S
from hpkv.io_workers import kvfile, mooncake_api
from hpkv.io_workers.kvfile import BlockId
from hpkv.monitor.status import format_status
from hpkv.protocol import wire as P
from hpkv.protocol.keys import block_keys, namespace_fingerprint
from hpkv.testing import mooncake as mc
from hpkv.testing import netns
from hpkv.testing.server import ServerProcess, private_env


def _require() -> None:
    why = netns.unavailable() or mooncake_api.unavailable()
    if why:
        pytest.skip(why)


def _client(ns: netns.Netns, m: mc.Master, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "hpkv.testing.mooncake",
        "--local",
        ns.addr,
        "--metadata",
        m.metadata,
        "--master",
        m.rpc,
        *args,
    ]


_ECHO = """import socket, sys
s = socket.create_server((sys.argv[1], 7777)); print("listening", flush=True)
c, _ = s.accept(); c.sendall(b"hello\\n"); c.close()"""
_CONNECT = """import socket, sys
print(socket.create_connection((sys.argv[1], 7777), timeout=10).makefile().readline(), end="")"""


def test_namespace_has_only_loopback_and_is_deleted_at_the_end() -> None:
    if netns.unavailable():
        pytest.skip(netns.unavailable())
    with netns.namespaces(2, veth=True) as (a, b):
        links = a.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
        assert [line.split(":")[1].strip().split("@")[0] for line in links.splitlines()] == ["lo", "hv0"]
        # b listens on its veth address; a reaches it over the pair.
        server = b.popen([sys.executable, "-c", _ECHO, b.addr], stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None and server.stdout.readline() == "listening\n"
        client = a.run([sys.executable, "-c", _CONNECT, b.addr], capture_output=True, text=True, timeout=30)
        assert client.stdout == "hello\n", client.stderr
        sleeper = a.popen(["sleep", "600"])
        names = (a.name, b.name)
    assert sleeper.poll() is not None
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not any(n in listed for n in names)


def test_the_store_api_probe_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # an import of it now fails
    with pytest.raises(mooncake_api.MooncakeUnavailable, match=r"hpkv\[mooncake\].*libibverbs1"):
        mooncake_api.store_class()


def test_put_get_exists_through_a_master_in_a_namespace(tmp_path: Path) -> None:
    _require()
    with netns.namespaces(1) as (a,), mc.master(a, tmp_path) as m:
        r = a.run(_client(a, m), capture_output=True, text=True, env=mc.client_env(a.addr), timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout)
        assert out["put"] == [0, 0, 0]
        assert out["exists"] == [1, 1, 1, 0]
        assert out["get"] == [1 << 20] * 3
        assert out["crc"] == out["crc_put"]


@contextlib.contextmanager
def holding(ns: netns.Netns, m: mc.Master, prefix: str) -> Iterator[dict]:
    """A client in ``ns`` that put 3 objects named after ``prefix`` into its own segment and
    holds them (its answer: what it put) until the block ends; it must then exit cleanly."""
    holder = ns.popen(
        _client(ns, m, "--hold", "--prefix", prefix),
        env=mc.client_env(ns.addr),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert holder.stdout is not None and holder.stdin is not None
    try:
        yield json.loads(holder.stdout.readline())  # its segment is up
    finally:
        holder.stdin.close()  # it exits when its stdin closes (the namespace's end kills it otherwise)
    assert holder.wait(30) == 0


def test_objects_held_in_one_namespace_are_read_from_another_over_a_veth(tmp_path: Path) -> None:
    _require()
    with (
        netns.namespaces(2, veth=True) as (a, b),
        mc.master(a, tmp_path) as m,
        holding(a, m, "shared") as held,
    ):
        assert held["put"] == [0, 0, 0]
        r = b.run(
            _client(b, m, "--no-put", "--segment", "0", "--prefix", "shared"),
            capture_output=True,
            text=True,
            env=mc.client_env(b.addr),
            timeout=120,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout)
        assert out["exists"] == [1, 1, 1, 0]
        assert out["get"] == [1 << 20] * 3
        assert out["crc"] == held["crc_put"]


def test_the_raw_floor_beside_a_spinning_process_stops_its_spinner(tmp_path: Path) -> None:
    # bench ttft --remote's second floor: raw gets from node B while a process spins on
    # sched_yield there, as a waiting vLLM engine does; the spinner ends with the floor
    from hpkv.bench.remote import raw_get_gbps

    _require()
    with netns.namespaces(2, veth=True) as (a, b), mc.master(a, tmp_path) as m, holding(a, m, "held"):
        spinners_before = len(b.procs)
        rates = raw_get_gbps(b, m, (1 << 20) + 4096, 4, repeat=2, spinners=1)
        assert len(rates["rounds"]) == 2 and rates["best"] == max(rates["rounds"]) > 0
        started = b.procs[spinners_before:]
        assert len(started) == 1 and started[0].poll() is not None  # the spinner, stopped
        assert b.pids() == []  # nothing left in node B's namespace


def test_bench_remote_reports_floors_for_every_object_size_and_leaves_no_namespace() -> None:
    _require()
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    cmd = [sys.executable, "-m", "hpkv", "bench", "remote", "--json", "--mib", "16", "--repeat", "1"]
    cmd += ["--samples", "5", "--blocks", "4", "--block-mib", "2", "--sweep", "--spinners", "1"]
    bench = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = bench.communicate(timeout=300)
    finally:  # SIGTERM: the bench unwinds, stopping what it started and deleting its namespaces
        if bench.poll() is None:
            bench.terminate()
            bench.communicate(timeout=60)
    r = subprocess.CompletedProcess(cmd, bench.returncode, stdout, stderr)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert [s["object_mib"] for s in out["sizes"]] == [1, 2, 4, 8]  # (2: also the hpkv phase's)
    for s in out["sizes"]:
        assert s["objects"] == 16 // s["object_mib"]
        assert s["put_gbps"] > 0 and s["get_gbps"] > 0
        assert 0 < s["get_p50_ms"] <= s["get_p99_ms"]
        assert set(s["cpu_s_per_gb"]) == {"put_client", "put_holder", "get_client", "get_holder"}
    assert 0 < out["exists_64_present_us"]["p50"] <= out["exists_64_present_us"]["p99"]
    h = out["hpkv"]  # node B's promote of what node A published, paired with raw gets of as many bytes
    assert h["blocks"] == 4 and len(h["promote_s"]) == len(h["raw_get_s"]) == 1 and h["promote_gbps"] > 0
    assert h["raw_get_gbps"] > 0
    assert h["vs_raw"] == pytest.approx(h["promote_s"][0] / h["raw_get_s"][0], rel=0.05)
    assert h["spinners"] == 1  # (stopped with the phase: the namespaces' check below would see them)
    # the same blocks loaded as vLLM's connector loads them (parts through two connections, then
    # one), and in one part, each paired with raw gets
    for name, part_mib, conns in (("parts", 16, 2), ("parts_one_connection", 16, 1), ("one_part", 0, 2)):
        ld = h["load"][name]
        assert (ld["part_mib"], ld["connections"]) == (part_mib, conns)
        assert len(ld["load_s"]) == len(ld["raw_get_s"]) == 1
        assert ld["vs_raw"] == pytest.approx(ld["load_s"][0] / ld["raw_get_s"][0], rel=0.05)
    # --sweep: raw gets of the phase's objects by threads x objects a call, plain and in the remote
    # worker's header + slot form, each with its ratio to one call of all; hpkv's CRC32C rate
    sw = h["sweep"]
    assert sw["objects"] == 4 and sw["object_bytes"] == (2 << 20) + 4096
    # 4 objects: 8/16/32/all a call are all one call of 4, which one thread makes (no second to share it)
    got = [(c["threads"], c["batch"], c["multi_buffers"]) for c in sw["cases"]]
    assert got == [(1, 4, False), (1, 4, True)]
    assert all(c["gbps"] > 0 and c["vs_one_call"] > 0 for c in sw["cases"])
    assert sw["crc32c_gbps"] > 0
    # (the bench's namespaces are named after its pid; other sessions' come and go meanwhile)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert not [n for n in listed if n.startswith(f"hpkv{bench.pid % 100000}") and n not in before]


# ------------------------------------------------------------------ the remote tier in hpkv servers
SHARD = 100_000
FP = namespace_fingerprint({"model": "remote-test"})


class Node:
    """An hpkv server inside a namespace with the remote tier on, and a client of it that
    writes random blocks into its pool (the client runs here: a unix socket and /dev/shm)."""

    def __init__(
        self,
        ns: netns.Netns,
        m: mc.Master,
        segment: str,
        storage: str = "",
        pool_size: str = "64m",
        **extra: str,
    ):
        env = private_env(
            pool_size=pool_size,
            storage=storage,
            **mc.node_keys(m, ns.addr, segment),
            **extra,
        )
        self.net = ns  # the network namespace it runs in
        self.srv = ServerProcess(env, prefix=ns.argv([])).start()
        self.c = connect(self.srv.cfg, spawn=False, call_timeout=30.0)
        self.ns = self.c.attach_namespace(FP, 1, SHARD, name="remote-test")
        self.pool = PoolFile.attach(os.path.join(self.srv.pool_dir, P.POOL_FILE))
        self.rng = np.random.default_rng(len(ns.addr))

    def put(self, keys: list[bytes]) -> dict[bytes, bytes]:
        slots = P.slot_offset(self.c.reserve(self.ns.ns_id, keys))
        assert (slots >= 0).all(), slots
        data = {}
        for k, row in zip(keys, slots, strict=True):
            d = self.rng.integers(0, 256, SHARD, dtype=np.uint8)
            self.pool.array[row[0] : row[0] + SHARD] = d
            data[k] = d.tobytes()
        self.c.commit(self.ns.ns_id, keys, rank=0)
        return data

    def remote(self) -> dict:
        return self.c.stats()["storage"]["remote"]

    def wait_remote(self, cond, what: str, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while not cond(r := self.remote()):
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {r}\n{self.srv.log()[-4000:]}"
            time.sleep(0.05)
        return r

    def wait_spilled(self, n: int, timeout: float = 30.0) -> None:
        """Until the node's file tier wrote ``n`` blocks (write-through is asynchronous)."""
        deadline = time.monotonic() + timeout
        while self.c.stats()["storage"]["spills"] < n:
            assert time.monotonic() < deadline, self.srv.log()[-3000:]
            time.sleep(0.05)

    def close(self) -> None:
        self.c.close()
        self.pool.close()
        self.srv.cleanup()


@contextlib.contextmanager
def two_nodes(tmp_path: Path, files: bool = False, **a_keys: str) -> Iterator[tuple[Node, Node, mc.Master]]:
    """Two hpkv "nodes" in two network namespaces joined by a veth, one Mooncake master in the
    first: node A contributes a segment (holds the objects), node B none (a pure client).
    ``files``: each node has a storage directory of its own too (DRAM -> files -> remote).
    ``a_keys``: node A's :class:`Node` keywords (its pool size, configuration keys)."""
    with netns.namespaces(2, veth=True) as (a, b), mc.master(a, tmp_path) as m:
        if files:
            (tmp_path / "a").mkdir(mode=0o700)
            (tmp_path / "b").mkdir(mode=0o700)
        na = Node(a, m, segment="128m", storage=str(tmp_path / "a") if files else "", **a_keys)
        try:
            nb = Node(
                b,
                m,
                segment="0",
                storage=str(tmp_path / "b") if files else "",
                HPKV_REMOTE_LOOKUP_WAIT_MS="5000",
                HPKV_STORAGE_LOOKUP_WAIT_MS="5000",
            )
            try:
                yield na, nb, m
            finally:
                nb.close()
        finally:
            na.close()


def test_a_block_committed_on_node_a_is_a_byte_exact_hit_on_node_b(tmp_path: Path) -> None:
    _require()
    with two_nodes(tmp_path) as (na, nb, m):
        keys = block_keys(FP, [str(i).encode() for i in range(4)])
        data = na.put(keys)
        na.wait_remote(lambda r: r["published"] == 4, "4 blocks published by node A")
        # B knows nothing of them: its lookup asks the store (off its request loop)
        deadline = time.monotonic() + 20
        while (got := nb.c.lookup(nb.ns.ns_id, keys)) != (4, [P.Tier.REMOTE] * 4):
            assert time.monotonic() < deadline, f"B's lookup: {got}; {nb.remote()}\n{nb.srv.log()[-3000:]}"
            time.sleep(0.2)
        rows = nb.c.promote(nb.ns.ns_id, keys)
        for k, row in zip(keys, rows, strict=True):
            assert row[0] >= 0, f"block {k.hex()} not loaded: {nb.remote()}\n{nb.srv.log()[-3000:]}"
            assert nb.pool.array[row[0] : row[0] + SHARD].tobytes() == data[k]
        r = nb.wait_remote(lambda r: r["loaded"] == 4, "B's counters (published every 0.2 s)")
        assert r["corrupt"] == 0 and r["found"] == 4 and r["errors"] == 0
        assert nb.c.lookup(nb.ns.ns_id, keys) == (4, [1] * 4)  # in B's DRAM now


def wait_lookup(n: Node, keys: list[bytes], want: tuple[int, list[int]], timeout: float = 20.0) -> None:
    """Ask until the lookup answers ``want`` (a first lookup of keys a node does not know yet
    may end at its bound before the store answered)."""
    deadline = time.monotonic() + timeout
    while (got := n.c.lookup(n.ns.ns_id, keys)) != want:
        assert time.monotonic() < deadline, f"lookup: {got}, not {want}; {n.remote()}\n{n.srv.log()[-3000:]}"
        time.sleep(0.2)


def test_with_files_and_the_store_a_node_hits_another_nodes_blocks_and_its_own_files_first(
    tmp_path: Path,
) -> None:
    _require()
    D, S, R = P.Tier.DRAM, P.Tier.STORAGE, P.Tier.REMOTE
    with two_nodes(tmp_path, files=True) as (na, nb, m):
        # node A commits a prompt: written to A's files and published to the store
        theirs = block_keys(FP, [f"a{i}".encode() for i in range(2)])
        data = na.put(theirs)
        na.wait_remote(lambda r: r["published"] == 2, "2 blocks published by node A")
        na.wait_spilled(2)
        assert list((tmp_path / "a").rglob("*.kv")), "A wrote its files too"
        # node B: two blocks of its own that leave its DRAM (in its files and the store now),
        # then two it keeps in DRAM
        files = block_keys(FP, [f"b{i}".encode() for i in range(2)])
        data |= nb.put(files)
        nb.wait_remote(lambda r: r["published"] == 2, "B's 2 blocks published")
        nb.wait_spilled(2)
        assert nb.c.evict("remote-test", tier="dram")["dram"]["blocks"] == 2
        dram = block_keys(FP, [f"d{i}".encode() for i in range(2)])
        data |= nb.put(dram)
        # one hit across B's three tiers: its DRAM, its files (not the store's copies), A's blocks
        keys = dram + files + theirs
        wait_lookup(nb, keys, (6, [D, D, S, S, R, R]))
        rows = nb.c.promote(nb.ns.ns_id, keys)
        for k, row in zip(keys, rows, strict=True):
            assert row[0] >= 0, f"block {k.hex()} not loaded: {nb.remote()}\n{nb.srv.log()[-3000:]}"
            assert nb.pool.array[row[0] : row[0] + SHARD].tobytes() == data[k], "byte-exact"
        r = nb.wait_remote(lambda r: r["loaded"] == 2, "B loaded A's 2 blocks from the store")
        assert r["corrupt"] == 0 and r["errors"] == 0
        st = nb.c.stats()
        assert st["storage"]["promotes"] >= 2, "B's own blocks were read from its files"
        (row,) = [ns for ns in st["namespaces"] if ns["name"] == "remote-test"]
        assert row["loads_remote"] == 2 and row["loads_storage"] == 2 and row["hits_remote"] >= 2
        assert row["tiers"]["remote"]["loads"] == 2
        text = format_status(st)  # `hpkv status`: the store's line, and its row in the tier table
        assert f"remote    {m.rpc}  UP" in text and "gets 2" in text, text
        assert "HITS REMOTE" in text, text
        rows_named = [line.split()[0] for line in text.splitlines() if line.strip() and m.rpc not in line]
        assert "remote" in rows_named, text
        nb.c.unpin(nb.ns.ns_id, keys)
        # on A the blocks are in its files and in the store: its own files win
        assert na.c.evict("remote-test", tier="dram")["dram"]["blocks"] == 2
        wait_lookup(na, theirs, (2, [S, S]))
        rows = na.c.promote(na.ns.ns_id, theirs)
        assert [na.pool.array[r[0] : r[0] + SHARD].tobytes() for r in rows] == [data[k] for k in theirs]
        assert na.remote()["loaded"] == 0, "nothing read from the store where the files have it"


@pytest.mark.parametrize("order", ["files,remote", "remote,files"])
def test_a_block_in_the_files_and_the_store_is_read_from_the_first_tier_of_the_order(
    tmp_path: Path, order: str
) -> None:
    """HPKV_TIER_ORDER: a block held by both tiers below the pool is a hit of the first one in
    the order, and its promote reads that tier (the per-tier counters say which)."""
    _require()
    first = P.Tier.STORAGE if order == "files,remote" else P.Tier.REMOTE
    (tmp_path / "files").mkdir(mode=0o700)
    with netns.namespaces(1) as (a,), mc.master(a, tmp_path) as m:
        n = Node(a, m, segment="128m", storage=str(tmp_path / "files"), HPKV_TIER_ORDER=order)
        try:
            keys = block_keys(FP, [f"o{i}".encode() for i in range(2)])
            data = n.put(keys)
            n.wait_remote(lambda r: r["published"] == 2, "2 blocks published")
            n.wait_spilled(2)
            assert n.c.evict("remote-test", tier="dram")["dram"]["blocks"] == 2
            wait_lookup(n, keys, (2, [first] * 2))  # in both tiers: a hit of the first
            rows = n.c.promote(n.ns.ns_id, keys)
            for k, row in zip(keys, rows, strict=True):
                assert row[0] >= 0, f"block {k.hex()} not loaded: {n.remote()}\n{n.srv.log()[-3000:]}"
                assert n.pool.array[row[0] : row[0] + SHARD].tobytes() == data[k], "byte-exact"
            st = n.c.stats()
            (row,) = [ns for ns in st["namespaces"] if ns["name"] == "remote-test"]
            if first == P.Tier.REMOTE:
                assert row["loads_remote"] == 2 and row["loads_storage"] == 0 and row["hits_remote"] >= 2, row
                assert st["storage"]["promotes"] == 0 and n.remote()["loaded"] == 2
            else:
                assert row["loads_storage"] == 2 and row["loads_remote"] == 0 and row["hits_storage"] >= 2, (
                    row
                )
                assert st["storage"]["promotes"] >= 2 and n.remote()["loaded"] == 0
            assert st["storage"]["path"] == str(tmp_path / "files"), "the files' path, whatever the order"
            slots = [w["slot"] for w in st["workers"]]
            assert len(slots) == len(set(slots)), (
                f"every worker its own stats row, whatever the order: {slots}"
            )
        finally:
            n.close()


def test_a_tier_order_naming_a_tier_that_is_off_leaves_it_out_and_says_so_once(tmp_path: Path) -> None:
    (tmp_path / "files").mkdir(mode=0o700)
    env = private_env(storage=str(tmp_path / "files"), HPKV_TIER_ORDER="remote,files")
    srv = ServerProcess(env).start()
    try:
        c = connect(srv.cfg, spawn=False, call_timeout=30.0)
        ns = c.attach_namespace(FP, 1, SHARD, name="remote-test")
        assert c.lookup(ns.ns_id, block_keys(FP, [b"x"])) == (0, [])
        c.close()
        assert srv.log().count("HPKV_TIER_ORDER=remote,files: remote is off on this node, left out") == 1
    finally:
        srv.cleanup()


def test_with_the_evict_write_policy_a_block_is_published_when_the_pool_evicts_it(tmp_path: Path) -> None:
    """HPKV_REMOTE_WRITE_POLICY=evict: a committed block is not in the store; once node A's pool
    evicts it, it is (published before its slots were reused), a byte-exact hit on node B, and
    it is never published twice."""
    _require()
    with two_nodes(tmp_path, pool_size="4m", HPKV_REMOTE_WRITE_POLICY="evict") as (na, nb, m):
        first = block_keys(FP, [f"e{i}".encode() for i in range(4)])
        data = na.put(first)
        # B asks the store (waiting up to 5 s for its answer): not there
        assert nb.c.lookup(nb.ns.ns_id, first) == (0, [])
        assert nb.remote()["missed"] >= 1, "the store answered B's question"
        assert na.remote()["published"] == 0 and na.c.lookup(na.ns.ns_id, first) == (4, [P.Tier.DRAM] * 4)
        # A commits more than its pool holds: the oldest blocks (``first``) are the first victims
        filler = block_keys(FP, [f"f{i}".encode() for i in range(120)])
        for i in range(0, len(filler), 4):
            na.put(filler[i : i + 4])
        r = na.wait_remote(lambda r: r["published"] >= 4, "the evicted blocks published")
        (row,) = [ns for ns in na.c.stats()["namespaces"] if ns["name"] == "remote-test"]
        assert row["evictions"] > 0
        # A published victim goes at the next allocation that needs a slot. On a busy machine
        # the puts may end after the last filler block: A commits more until they are gone.
        more = block_keys(FP, [f"g{i}".encode() for i in range(400)])
        deadline = time.monotonic() + 60
        while (got := na.c.lookup(na.ns.ns_id, first)) != (4, [P.Tier.REMOTE] * 4):
            assert more and time.monotonic() < deadline, f"lookup on A: {got}; {na.remote()}"
            na.put(more[:4])
            del more[:4]
            time.sleep(0.05)
        wait_lookup(nb, first, (4, [P.Tier.REMOTE] * 4))
        rows = nb.c.promote(nb.ns.ns_id, first)
        for k, row in zip(first, rows, strict=True):
            assert row[0] >= 0, f"block {k.hex()} not loaded: {nb.remote()}\n{nb.srv.log()[-3000:]}"
            assert nb.pool.array[row[0] : row[0] + SHARD].tobytes() == data[k], "byte-exact"
        r = na.remote()
        assert r["existed"] == 0, "no block was put twice (one the store held is evicted unpublished)"
        assert r["errors"] == 0 and r["published"] + r["dropped"] >= 4, r


_UPSERT = """import ctypes, mmap, sys
from hpkv.testing import mooncake as mc
local, metadata, master, name, size = sys.argv[1:6]
store = mc.connect(local, metadata, master, segment=0)
buf = mmap.mmap(-1, int(size))
buf[:] = b"garbage!" * (int(size) // 8) + b"!" * (int(size) % 8)
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
assert store.register_buffer(addr, int(size)) == 0
print(store.upsert_from(name, addr, int(size)))
store.close()
"""


_EXISTS = """import sys
from hpkv.testing import mooncake as mc
local, metadata, master, name = sys.argv[1:5]
store = mc.connect(local, metadata, master, segment=0)
print(store.batch_is_exist([name]))
store.close()
"""


def test_an_object_overwritten_with_garbage_is_detected_removed_and_recomputed(tmp_path: Path) -> None:
    _require()
    with two_nodes(tmp_path) as (na, nb, m):
        keys = block_keys(FP, [f"bad{i}".encode() for i in range(2)])
        data = na.put(keys)
        na.wait_remote(lambda r: r["published"] == 2, "2 blocks published by node A")
        name = mooncake_api.object_key(BlockId(bytes.fromhex(FP), keys[0], 0, 1))
        size = str(kvfile.file_size(SHARD))
        b = nb.net
        r = b.run([sys.executable, "-c", _UPSERT, b.addr, m.metadata, m.rpc, name, size],
                  env=mc.client_env(b.addr), capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 0 and r.stdout.strip() == "0", r.stderr[-2000:]
        deadline = time.monotonic() + 20
        while nb.c.lookup(nb.ns.ns_id, keys) != (2, [P.Tier.REMOTE] * 2):
            assert time.monotonic() < deadline, nb.remote()
            time.sleep(0.2)
        rows = nb.c.promote(nb.ns.ns_id, keys)
        assert rows[0][0] == -1, "the garbage object is a miss (recomputed), never served"
        assert nb.pool.array[rows[1][0] : rows[1][0] + SHARD].tobytes() == data[keys[1]]
        nb.wait_remote(lambda r: r["corrupt"] == 1 and r["loaded"] == 1, "one corrupt, one loaded")
        assert nb.c.lookup(nb.ns.ns_id, keys[:1]) == (0, [])
        r = b.run([sys.executable, "-c", _EXISTS, b.addr, m.metadata, m.rpc, name],
                  env=mc.client_env(b.addr), capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.stdout.strip() == "[0]", "the corrupt object was removed from the store"
        assert "corrupt" in nb.srv.log()


_REMOVE = """import sys
from hpkv.testing import mooncake as mc
local, metadata, master, name = sys.argv[1:5]
store = mc.connect(local, metadata, master, segment=0)
print(store.remove(name, True))
store.close()
"""


def test_a_remote_hit_the_store_no_longer_holds_is_asked_about_again_and_ends_the_prefix(
    tmp_path: Path,
) -> None:
    """An object another node removed (or the store evicted): a hit confirmed less than
    PRESENT_TTL_S ago is not asked about again; an older one is, in the lookup, which then
    ends at it, rather than its promote failing."""
    _require()
    with two_nodes(tmp_path) as (na, nb, m):
        keys = block_keys(FP, [f"gone{i}".encode() for i in range(3)])
        data = na.put(keys)
        na.wait_remote(lambda r: r["published"] == 3, "3 blocks published by node A")
        deadline = time.monotonic() + 20
        while nb.c.lookup(nb.ns.ns_id, keys) != (3, [P.Tier.REMOTE] * 3):
            assert time.monotonic() < deadline, nb.remote()
            time.sleep(0.2)
        asked = nb.remote()["asked"]
        assert nb.c.lookup(nb.ns.ns_id, keys) == (3, [P.Tier.REMOTE] * 3)
        assert nb.remote()["asked"] == asked, "a hit the store confirmed lately is not asked about again"
        name = mooncake_api.object_key(BlockId(bytes.fromhex(FP), keys[1], 0, 1))
        b = nb.net
        r = b.run([sys.executable, "-c", _REMOVE, b.addr, m.metadata, m.rpc, name],
                  env=mc.client_env(b.addr), capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 0 and r.stdout.strip() == "0", r.stderr[-2000:]
        time.sleep(PRESENT_TTL_S + 0.5)
        assert nb.c.lookup(nb.ns.ns_id, keys) == (1, [P.Tier.REMOTE])
        r = nb.remote()
        assert r["asked"] == asked + 3 and r["gone"] == 1, r
        rows = nb.c.promote(nb.ns.ns_id, keys[:1])
        assert nb.pool.array[rows[0][0] : rows[0][0] + SHARD].tobytes() == data[keys[0]]


def test_a_killed_remote_worker_is_restarted_and_publishes_again(tmp_path: Path) -> None:
    _require()
    with netns.namespaces(1) as (a,), mc.master(a, tmp_path) as m:
        n = Node(a, m, segment="128m")
        try:
            first = block_keys(FP, [b"before"])
            n.put(first)
            n.wait_remote(lambda r: r["published"] == 1, "the first block published")
            pids = [w["pid"] for w in n.c.stats()["workers"] if w["kind"] == "remote"]
            assert len(pids) == 1
            os.kill(pids[0], signal.SIGKILL)
            deadline = time.monotonic() + 30
            while [w["pid"] for w in n.c.stats()["workers"] if w["kind"] == "remote"] in ([], pids):
                assert time.monotonic() < deadline, n.srv.log()[-3000:]
                time.sleep(0.1)
            # The new worker mounts a new segment (the old one's objects went with it) and
            # publishes again. For ~10 s the master still lists the dead segment and may place a
            # put there: such a put fails (tried again, then dropped), never the tier.
            r0 = n.remote()
            ended = r0["published"] + r0["errors"]  # puts that ended so far (`first`'s among them)
            later: list[bytes] = []
            deadline = time.monotonic() + 30
            while n.remote()["published"] < 2:
                assert time.monotonic() < deadline, (
                    f"nothing published again: {n.remote()}\n{n.srv.log()[-3000:]}"
                )
                later += n.put(block_keys(FP, [f"after{len(later)}".encode()])).keys()
                tried = ended + len(later)
                n.wait_remote(lambda r: r["published"] + r["errors"] >= tried, "the put's end")  # noqa: B023
            assert not n.remote()["down"]
            assert n.c.lookup(n.ns.ns_id, first + later) == (1 + len(later), [1] * (1 + len(later)))
            # The block published before the restart (its object went with the old segment) is
            # still in the pool: published again once the master has dropped the old segment
            # (it may have been before the last put above ended).
            r = n.wait_remote(
                lambda r: r["republished"] == 1 and r["published"] + r["errors"] >= ended + len(later) + 1,
                "republish",
            )
            assert r["published"] + r["errors"] == ended + len(later) + 1, (r0, r)
            assert r["existed"] == 0 and not r["down"]
            name = mooncake_api.object_key(BlockId(bytes.fromhex(FP), first[0], 0, 1))
            r = a.run([sys.executable, "-c", _EXISTS, a.addr, m.metadata, m.rpc, name],
                      env=mc.client_env(a.addr), capture_output=True, text=True, timeout=60)  # fmt: skip
            assert r.stdout.strip() == "[1]", r.stderr[-2000:]
        finally:
            n.close()


def test_the_remote_tier_refuses_a_config_it_cannot_run_naming_the_key(tmp_path: Path) -> None:
    from hpkv.config import ConfigError, load_config
    from hpkv.engine.remote import check_config

    ini = tmp_path / "hpkv.ini"
    ini.write_text("")
    base = {
        "HPKV_CONFIG_FILE_PATH": str(ini),
        "HPKV_REMOTE_BACKEND": "mooncake",
        "HPKV_KV_STORAGE_PATH": "",
    }
    with pytest.raises(ConfigError, match="needs HPKV_REMOTE_MASTER"):
        check_config(load_config(base))
    full = {**base, "HPKV_REMOTE_MASTER": "10.0.0.1:50051", "HPKV_REMOTE_METADATA": "http://10.0.0.1:8080/metadata",
            "HPKV_REMOTE_LOCAL_HOSTNAME": "10.0.0.2"}  # fmt: skip
    check_config(load_config({**full, "HPKV_KV_STORAGE_PATH": "/var/tmp/x"}))  # stacked under the files
    check_config(load_config({**base, "HPKV_REMOTE_BACKEND": ""}))  # off: nothing asked


def test_with_the_master_killed_dram_hits_and_lookups_stay_fast_and_the_tier_goes_down(
    tmp_path: Path,
) -> None:
    _require()
    with netns.namespaces(1) as (a,), mc.master(a, tmp_path) as m:
        n = Node(a, m, segment="128m", HPKV_REMOTE_LOOKUP_WAIT_MS="20")
        try:
            keys = block_keys(FP, [b"m0", b"m1"])
            n.put(keys)
            n.wait_remote(lambda r: r["published"] == 2, "2 blocks published")
            a.stop(m.proc, signal.SIGKILL)
            # every Mooncake call now blocks ~4.3 s in the worker: the server never waits on it
            unknown = block_keys(FP, [f"u{i}".encode() for i in range(3)])
            for extra in ([], unknown[:1], unknown[1:2]):
                t0 = time.monotonic()
                assert n.c.lookup(n.ns.ns_id, keys + extra) == (2, [1, 1])
                assert time.monotonic() - t0 < 1.0, "a lookup waited on the dead master"
            later = block_keys(FP, [b"m2"])
            n.put(later)  # its publish fails after Mooncake's RPC timeout: the tier goes down
            r = n.wait_remote(lambda r: r["down"], "the tier marked down", timeout=30)
            assert r["errors"] >= 1 and r["down_events"] == 1
            t0 = time.monotonic()
            assert n.c.lookup(n.ns.ns_id, keys + later + unknown[2:]) == (3, [1, 1, 1])
            assert time.monotonic() - t0 < 0.5
            rows = n.c.promote(n.ns.ns_id, keys + later)
            assert (rows >= 0).all()
            assert n.srv.proc is not None and n.srv.proc.poll() is None
        finally:
            n.close()


def test_blocks_held_by_a_killed_node_are_misses_within_the_bound_never_wrong_bytes(tmp_path: Path) -> None:
    _require()
    with two_nodes(tmp_path) as (na, nb, m):
        keys = block_keys(FP, [f"held{i}".encode() for i in range(3)])
        na.put(keys)
        na.wait_remote(lambda r: r["published"] == 3, "3 blocks published by node A")
        deadline = time.monotonic() + 20
        while nb.c.lookup(nb.ns.ns_id, keys) != (3, [P.Tier.REMOTE] * 3):
            assert time.monotonic() < deadline, nb.remote()
            time.sleep(0.2)
        # A's remote worker holds the segment the objects live in: killed, they are gone
        # (the master still lists them for ~10 s)
        (pid,) = [w["pid"] for w in na.c.stats()["workers"] if w["kind"] == "remote"]
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        t0 = time.monotonic()
        rows = nb.c.promote(nb.ns.ns_id, keys)
        assert time.monotonic() - t0 < 5.0
        assert (rows == -1).all(), "no bytes of a lost object are served"
        r = nb.wait_remote(lambda r: r["gone"] == 3, "3 blocks found gone")
        assert r["loaded"] == 0 and not r["down"], "a lost object is a miss, not a store failure"
        # and stay misses while the master still lists them (GONE_TTL_S)
        assert nb.c.lookup(nb.ns.ns_id, keys) == (0, [])
        assert nb.remote()["blocks"] == 0


def test_after_one_failed_promote_the_other_blocks_of_a_killed_node_are_misses_not_hits(
    tmp_path: Path,
) -> None:
    """The master lists a dead node's objects ~10.8 s more (exists says yes, every get fails).
    Once one get from it failed, its other objects are misses for lookups at once (they were
    confirmed a moment ago, so without it each would be promised and its promote would fail),
    never an error and never the tier down."""
    _require()
    with two_nodes(tmp_path) as (na, nb, m):
        keys = block_keys(FP, [f"lost{i}".encode() for i in range(3)])
        na.put(keys)
        na.wait_remote(lambda r: r["published"] == 3, "3 blocks published by node A")
        _wait_lookup(nb, keys, (3, [P.Tier.REMOTE] * 3))
        (pid,) = [w["pid"] for w in na.c.stats()["workers"] if w["kind"] == "remote"]
        os.kill(pid, signal.SIGKILL)  # the segment the objects live in goes with it
        time.sleep(0.5)
        assert (nb.c.promote(nb.ns.ns_id, keys[:1]) == -1).all()
        t0 = time.monotonic()
        assert nb.c.lookup(nb.ns.ns_id, keys[1:]) == (0, []), nb.remote()
        assert time.monotonic() - t0 < 5.0
        r = nb.remote()  # (the others were forgotten, then asked about: missing)
        assert r["gone"] == 1 and r["loaded"] == 0 and r["errors"] == 0 and not r["down"], r
        assert "is gone (a get from it failed)" in nb.srv.log()


def test_config_check_says_what_the_remote_tier_lacks(tmp_path: Path) -> None:
    ini = tmp_path / "hpkv.ini"
    ini.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPKV_")}
    env.update(HPKV_CONFIG_FILE_PATH=str(ini), HPKV_REMOTE_BACKEND="mooncake", HPKV_KV_STORAGE_PATH="")
    r = subprocess.run(
        [sys.executable, "-m", "hpkv", "config", "--check"], env=env, capture_output=True, text=True
    )
    assert r.returncode == 1
    assert "HPKV_REMOTE_BACKEND=mooncake needs HPKV_REMOTE_MASTER" in r.stderr


def _wait_lookup(n: Node, keys: list[bytes], want: tuple[int, list[int]], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (got := n.c.lookup(n.ns.ns_id, keys)) != want:
        assert time.monotonic() < deadline, f"lookup {got} != {want}: {n.remote()}\n{n.srv.log()[-3000:]}"
        time.sleep(0.2)


def test_a_restarted_master_brings_the_tier_back_up_by_itself_and_blocks_are_shared_again(
    tmp_path: Path,
) -> None:
    _require()
    with two_nodes(tmp_path) as (na, nb, m):
        before = block_keys(FP, [b"r0"])
        data = na.put(before)
        na.wait_remote(lambda r: r["published"] == 1, "the first block published")
        _wait_lookup(nb, before, (1, [P.Tier.REMOTE]))
        m.ns.stop(m.proc, signal.SIGKILL)
        # A's next publish and B's next question fail: each tier goes down (the master did not answer)
        during = block_keys(FP, [f"r1-{i}".encode() for i in range(8)])
        data.update(na.put(during))
        r = na.wait_remote(lambda r: r["down"], "A's tier down", timeout=30)
        assert r["state"] == "down" and r["down_events"] == 1 and "master" in r["down_reason"]
        # The 8 publishes queued before A knew end at once (not ~4.3 s each in Mooncake), so
        # their blocks do not stay unevictable for long.
        r = na.wait_remote(lambda r: r["errors"] >= 8, "the queued publishes failed", timeout=20)
        assert r["published"] == 1
        unknown = block_keys(FP, [b"nobody"])
        nb.c.lookup(nb.ns.ns_id, unknown)
        r = nb.wait_remote(lambda r: r["down"], "B's tier down", timeout=30)
        # B knew r0 was in the store: no lookup promises it while the store is down
        assert r["blocks"] == 0 and nb.c.lookup(nb.ns.ns_id, before) == (0, [])
        # local tiers keep serving meanwhile, without waiting on the store
        for _ in range(3):
            t0 = time.monotonic()
            assert na.c.lookup(na.ns.ns_id, before + during + unknown) == (9, [1] * 9)
            assert time.monotonic() - t0 < 1.0, "a lookup waited on the dead master"
        rows = na.c.promote(na.ns.ns_id, before + during)
        assert (rows >= 0).all()
        na.c.unpin(na.ns.ns_id, before + during)
        na.put(block_keys(FP, [b"r1-down"]))  # committed while down: not published, counted
        na.wait_remote(lambda r: r["dropped"] == 1, "a block dropped while down")
        mc.restart(m)  # same address, an empty store
        for n in (na, nb):
            r = n.wait_remote(lambda r: not r["down"], "the tier up again after the master restart", 60)
            assert r["probes"] >= 1 and r["down_events"] == 1
        # A published again what it still holds (the new master knew nothing of it) ...
        na.wait_remote(lambda r: r["republished"] >= 1 and r["published"] >= 2, "r0 published again")
        # ... and a block committed after the restart is a cross-node hit again, byte-exact
        after = block_keys(FP, [b"r2"])
        data.update(na.put(after))
        na.wait_remote(lambda r: r["published"] >= 3, "the block committed after the restart published")
        _wait_lookup(nb, before + after, (2, [P.Tier.REMOTE] * 2))
        rows = nb.c.promote(nb.ns.ns_id, before + after)
        for k, row in zip(before + after, rows, strict=True):
            assert row[0] >= 0, f"{k.hex()} not loaded: {nb.remote()}\n{nb.srv.log()[-3000:]}"
            assert nb.pool.array[row[0] : row[0] + SHARD].tobytes() == data[k]
        # each state change was logged once
        for n in (na, nb):
            log = n.srv.log()
            assert log.count("remote store down") == 1 and log.count("remote store up again") == 1, log[
                -3000:
            ]


_SCRAPE = """import sys, urllib.request
print(urllib.request.urlopen(f"http://{sys.argv[1]}/metrics", timeout=10).read().decode())"""


def _views(n: Node) -> tuple[dict, str, str, dict[str, float]]:
    """The remote tier as `hpkv status --json`, `hpkv status`, `hpkv-top --once` and the
    Prometheus endpoint (scraped inside the node's namespace) show it."""
    from prometheus_client.parser import text_string_to_metric_families

    def cli(*args: str) -> str:
        r = subprocess.run(
            [sys.executable, "-m", *args], env=n.srv.env, capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout

    status = json.loads(cli("hpkv", "status", "--json"))["storage"]["remote"]
    human = cli("hpkv", "status")
    top = cli("hpkv.monitor.top", "--once", "--width", "160")
    r = n.net.run([sys.executable, "-c", _SCRAPE, f"127.0.0.1:{n.srv.env['HPKV_METRICS_PORT']}"],
                  capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    prom = {
        s.name: s.value
        for fam in text_string_to_metric_families(r.stdout)
        for s in fam.samples
        if s.name.startswith("hpkv_remote_")
    }
    return status, human, top, prom


def test_the_remote_state_and_counters_in_status_top_and_prometheus(tmp_path: Path) -> None:
    _require()
    with netns.namespaces(1) as (a,), mc.master(a, tmp_path) as m:
        n = Node(a, m, segment="128m", HPKV_METRICS_PORT="9109", HPKV_METRICS_HOST="127.0.0.1")
        try:
            keys = block_keys(FP, [b"o0", b"o1"])
            n.put(keys)
            n.wait_remote(lambda r: r["published"] == 2, "2 blocks published")
            unknown = block_keys(FP, [b"o-missing"])
            n.c.lookup(n.ns.ns_id, unknown)
            n.wait_remote(lambda r: r["missed"] == 1, "the unknown key asked about")
            status, human, top, prom = _views(n)
            assert status["state"] == "up" and status["blocks"] == 2 and status["asked"] == 1
            assert status["published"] == 2 and status["bytes_put"] == 2 * kvfile.file_size(SHARD)
            assert status["down_events"] == 0 and status["errors"] == 0
            assert (status["tier_order"], status["write_policy"]) == ("files,remote", "commit")
            assert re.search(
                rf"^remote    {m.rpc}  UP  \(order dram,files,remote; publish on commit\)$", human, re.M
            ), human
            assert "puts 2" in human and "misses 1" in human and "down events 0" in human
            assert re.search(rf"^REMOTE   {m.rpc}  UP", top, re.M) and "puts 2" in top, top
            assert prom["hpkv_remote_enabled"] == 1 and prom["hpkv_remote_up"] == 1
            assert prom["hpkv_remote_blocks"] == 2 and prom["hpkv_remote_published_total"] == 2
            assert prom["hpkv_remote_missed_total"] == 1
            assert prom["hpkv_remote_bytes_put_total"] == status["bytes_put"]

            a.stop(m.proc, signal.SIGKILL)
            n.put(block_keys(FP, [b"o2"]))  # its publish finds the master gone
            n.wait_remote(lambda r: r["down"], "the tier down")
            n.put(block_keys(FP, [b"o3"]))  # not published while down: dropped
            n.wait_remote(lambda r: r["dropped"] == 1, "a dropped block")
            status, human, top, prom = _views(n)
            assert status["state"] == "down" and "master did not answer" in status["down_reason"]
            assert status["down_events"] == 1 and status["errors"] >= 1
            assert re.search(
                rf"^remote    {m.rpc}  DOWN since \d\d:\d\d:\d\d: the master did not", human, re.M
            )
            assert re.search(rf"^REMOTE   {m.rpc}  DOWN since", top, re.M), top
            assert prom["hpkv_remote_up"] == 0 and prom["hpkv_remote_down_events_total"] == 1
            assert prom["hpkv_remote_dropped_total"] == 1

            mc.restart(m)
            r = n.wait_remote(lambda r: not r["down"], "the tier up again")
            assert r["probes"] >= 1 and r["blocks"] == 0, "what the old master held is forgotten"
            status, human, top, prom = _views(n)
            assert status["state"] == "up" and status["down_reason"] is None
            assert prom["hpkv_remote_up"] == 1 and prom["hpkv_remote_probes_total"] == status["probes"]
        finally:
            n.close()


def test_the_breaker_counts_store_failures_in_a_row_and_one_probe_at_a_time_brings_it_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The circuit breaker's rules, fed the completions a remote worker answers with (store
    errors other than a master timeout cannot be caused on demand with a real store)."""
    import errno
    import threading

    from hpkv.config import load_config
    from hpkv.engine.index import Index
    from hpkv.engine.remote import RemoteTier, _Check, _Job, _Probe
    from hpkv.protocol.errors import Status
    from hpkv.protocol.stats import G, RemoteState, StatsSegment

    ini = tmp_path / "hpkv.ini"
    ini.write_text("")
    env = {"HPKV_CONFIG_FILE_PATH": str(ini), "HPKV_REMOTE_BACKEND": "mooncake", "HPKV_KV_STORAGE_PATH": ""}
    cfg = load_config({**env, "HPKV_REMOTE_DOWN_AFTER": "3", "HPKV_REMOTE_PROBE_S": "0.1"})
    stats = StatsSegment.create(str(tmp_path))
    t = RemoteTier(cfg, str(tmp_path), stats, Index(1 << 20), threading.RLock(), None, "")  # type: ignore[arg-type]

    def answer(status: int, sent: float | None = None) -> None:
        job = _Job(P.LOOKUP, _Check(None, [b"k" * 16], [None], 1), 0)  # type: ignore[arg-type]
        job.sent = time.monotonic() if sent is None else sent
        t._checks += 1
        t._complete(job, status, 0, 0)

    def state() -> RemoteState:
        return RemoteState(int(stats.glob[G.REMOTE_STATE]))

    caplog.set_level("INFO", logger="hpkv.remote")
    for _ in range(2):
        answer(-errno.EIO)
    answer(-errno.ENOENT)  # a missing object: the store answered, the count starts again
    for status in (-errno.EIO, -errno.EIO, -errno.EHOSTUNREACH, -errno.ENOSPC, Status.WORKER_DIED):
        answer(status)  # a lost peer, a full store, a dead worker: errors, but not the store's
    assert state() == RemoteState.UP and t.counts["errors"] == 7
    answer(-errno.EIO)  # the third store failure in a row
    assert state() == RemoteState.DOWN and t.counts["down_events"] == 1
    answer(-errno.EIO)
    assert t.counts["down_events"] == 1 and caplog.text.count("remote store down") == 1
    # while down: one probe at a time, every HPKV_REMOTE_PROBE_S
    t._req = object()  # type: ignore[assignment]  # (a worker to send it to; nothing is sent here)
    time.sleep(0.11)
    for _ in range(3):
        t._breaker(time.monotonic())
    probes = [j for j in t._checks_q if isinstance(j.what, _Probe)]
    assert len(probes) == 1 and t.counts["probes"] == 1
    t._checks_q.clear()
    probes[0].sent = time.monotonic()
    t._complete(probes[0], -errno.ETIMEDOUT, 0, 0)  # no answer: still down, probed again later
    assert state() == RemoteState.DOWN
    t._breaker(time.monotonic())
    assert not t._checks_q, "the next probe waits HPKV_REMOTE_PROBE_S"
    time.sleep(0.11)
    t._breaker(time.monotonic())
    (probe,) = t._checks_q
    t._checks_q.clear()
    before_up = time.monotonic()
    t._complete(probe, 0, 0, 0)  # answered (the key is absent): up again
    assert state() == RemoteState.UP and caplog.text.count("remote store up again") == 1
    for _ in range(3):
        answer(-errno.EIO, sent=before_up - 1)  # failures of jobs sent before it came up: old news
    assert state() == RemoteState.UP
    answer(-errno.ETIMEDOUT)  # one call the master did not answer: down at once
    assert state() == RemoteState.DOWN and t.counts["down_events"] == 2
    stats.close()

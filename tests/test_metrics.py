"""The Prometheus endpoint of the server: names, types and values against traffic the test caused."""

from __future__ import annotations

import re
import socket
import time
import urllib.request

import numpy as np
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hpkv.client import connect
from hpkv.monitor.metrics import families, namespace_labels
from hpkv.protocol.keys import block_keys, namespace_fingerprint
from hpkv.testing.device import make_device
from hpkv.testing.server import ServerProcess, private_env
from hpkv.testing.vllm_server import free_port, lost_port

FP = namespace_fingerprint({"model": "metrics-test"})
PAGE, LAYERS, BLOCK_TOKENS = 4096, 4, 16
SLOT = PAGE * LAYERS


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        return r.read().decode()


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} of an exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    got = samples(text)
    key = (name, frozenset(labels.items()))
    assert key in got, f"no sample {name}{labels} in:\n{text}"
    return got[key]


def start_with_metrics() -> tuple[ServerProcess, int]:
    """A server with its metrics endpoint on a free port; started again on another port when the
    one free_port picked was taken before the server bound it (it logs that and runs on without)."""
    for _ in range(3):
        port = free_port()
        srv = ServerProcess(private_env(pool_size="64m", HPKV_METRICS_PORT=str(port))).start()
        if not lost_port(srv.log()):
            return srv, port
        srv.cleanup()
    raise AssertionError(f"three free ports were taken before the server bound them:\n{srv.log()}")


@pytest.fixture
def metrics_server():
    srv, port = start_with_metrics()
    try:
        yield srv, port
    finally:
        srv.cleanup()


def test_scrape_reports_the_traffic_the_test_caused(metrics_server, tmp_path):
    srv, port = metrics_server
    dev = make_device(tmp_path, layers=LAYERS, blocks=16, page=PAGE)
    with connect(srv.cfg, spawn=False, name="metrics-engine") as c:
        ns = c.attach_namespace(FP, 1, SLOT, name="metrics-model", block_tokens=BLOCK_TOKENS)
        handle = c.register_device(ns.ns_id, rank=0, **dev.spec)
        keys = block_keys(FP, [b"m%d" % i for i in range(5)])
        offsets = c.reserve(ns.ns_id, keys)[:, 0]
        assert handle.save(np.arange(5), offsets)
        c.commit(ns.ns_id, keys)
        assert c.lookup(ns.ns_id, keys + block_keys(FP, [b"absent"]))[0] == 5
        c.pin(ns.ns_id, keys[:2])
        assert handle.load(np.arange(3), offsets[:3])
        (w,) = c.stats()["workers"]
        text = scrape(port)

    nsl = {"namespace": "metrics-model"}
    assert value(text, "hpkv_pool_capacity_bytes") == 64 << 20
    assert value(text, "hpkv_pool_used_bytes") == 5 * SLOT
    assert value(text, "hpkv_pool_pinned_bytes") == 2 * SLOT
    assert value(text, "hpkv_pool_blocks") == 5
    assert value(text, "hpkv_engines_attached") == 1
    assert value(text, "hpkv_namespace_blocks", **nsl, tier="dram") == 5
    assert value(text, "hpkv_namespace_pinned_blocks", **nsl) == 2
    assert value(text, "hpkv_hit_blocks_total", **nsl, tier="dram") == 5
    assert value(text, "hpkv_hit_blocks_total", **nsl, tier="storage") == 0
    assert value(text, "hpkv_hit_tokens_total", **nsl, tier="dram") == 5 * BLOCK_TOKENS
    assert value(text, "hpkv_lookup_misses_total", **nsl) == 1
    assert value(text, "hpkv_lookups_total", **nsl) == 1
    assert value(text, "hpkv_committed_blocks_total", **nsl) == 5
    assert value(text, "hpkv_requests_total") >= 4  # reserve, commit, lookup, pin

    wl = {"worker": str(w["slot"]), "kind": "transfer"}
    assert value(text, "hpkv_worker_saved_bytes_total", **wl) == 5 * SLOT
    assert value(text, "hpkv_worker_loaded_bytes_total", **wl) == 3 * SLOT
    assert value(text, "hpkv_worker_jobs_total", **wl) == 2
    assert value(text, "hpkv_worker_up", **wl) == 1
    assert value(text, "hpkv_worker_busy_seconds_total", **wl) > 0
    info = [labels for (name, labels) in samples(text) if name == "hpkv_worker_info"]
    assert [dict(lab)["pid"] for lab in info] == [str(w["pid"])]
    req_ring = w["rings"][0]
    assert value(text, "hpkv_ring_capacity", ring=req_ring) == 1024
    assert value(text, "hpkv_ring_depth", ring=req_ring) == 0


def test_names_carry_units_and_counters_are_typed_as_counters(metrics_server):
    srv, port = metrics_server
    with connect(srv.cfg, spawn=False) as c:
        c.attach_namespace(FP, 1, SLOT, name="typed")
        text = scrape(port)
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    assert types, text
    assert all(name.startswith("hpkv_") for name in types)
    assert types["hpkv_requests_total"] == "counter"
    assert types["hpkv_hit_blocks_total"] == "counter"
    assert types["hpkv_worker_saved_bytes_total"] == "counter"
    assert types["hpkv_pool_used_bytes"] == "gauge"
    assert types["hpkv_namespace_blocks"] == "gauge"
    assert types["hpkv_ring_depth"] == "gauge"
    for name, kind in types.items():
        assert (kind == "counter") == name.endswith("_total"), f"{name} is a {kind}"
        if "bytes" in name:
            assert name.endswith(("_bytes", "_bytes_total")), name
        if "seconds" in name:
            assert name.endswith(("_seconds", "_seconds_total")), name
    # every sample of the exposition parses, and counters only ever count up
    first = samples(text)
    time.sleep(0.3)
    second = samples(scrape(port))
    for (name, labels), v in first.items():
        if types.get(name) == "counter" and (name, labels) in second:
            assert second[(name, labels)] >= v, name


def test_port_in_use_is_logged_with_the_key_and_the_server_runs_on():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        srv = ServerProcess(private_env(HPKV_METRICS_PORT=str(port))).start()
        try:
            with connect(srv.cfg, spawn=False) as c:
                assert c.attach_namespace(FP, 1, SLOT).ns_id == 0
            log = srv.log()
            assert re.search(
                rf"ERROR hpkv.metrics.*cannot listen on 127\.0\.0\.1 port {port}.*"
                rf"HPKV_METRICS_PORT={port}",
                log,
            ), log
            assert srv.proc.poll() is None
        finally:
            srv.cleanup()


def test_metrics_are_off_by_default():
    srv = ServerProcess(private_env()).start()
    try:
        proc = psutil.Process(srv.proc.pid)
        conns = (
            proc.net_connections(kind="tcp") if hasattr(proc, "net_connections") else proc.connections("tcp")
        )
        assert conns == [], "no TCP socket without HPKV_METRICS_PORT"
        assert "Prometheus" not in srv.log()
    finally:
        srv.cleanup()


# ------------------------------------------------------------------ families of a snapshot (no server)
def _snapshot(**extra):
    snap = {
        "server": {"pid": 1, "start_time": 1.0, "heartbeat_age_s": 0.1, "storage": "/nvme/kv"},
        "pool": {"capacity_bytes": 100, "used_bytes": 10, "pinned_bytes": 0, "blocks": 1},
        "requests": 7,
        "errors": 0,
        "worker_restarts": 0,
        "clients": [],
        "rings": [],
        "workers": [],
        "namespaces": [
            {
                "id": i,
                "name": "llama",
                "fingerprint": fp,
                "block_tokens": 16,
                "world_size": 1,
                "blocks_dram": 1,
                "bytes_dram": 10,
                "blocks_pinned": 0,
                "blocks_storage": 0,
                "hits_dram": i + 1,
                "hits_storage": 0,
                "misses": 0,
                "lookups": 1,
                "evictions": 0,
                "reserve_failed": 0,
                "commits": 1,
                "blocks_reserved": 0,
            }
            for i, fp in enumerate(["aaaaaaaa11", "bbbbbbbb22"])
        ],
    }
    snap.update(extra)
    return snap


def _exposition(snap) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    class One:
        def collect(self):
            return families(snap, {})

    reg = CollectorRegistry(auto_describe=False)
    reg.register(One())
    return generate_latest(reg).decode()


def test_two_namespaces_with_one_name_get_distinct_labels():
    snap = _snapshot()
    assert namespace_labels(snap["namespaces"]) == {0: "llama@aaaaaaaa", 1: "llama@bbbbbbbb"}
    text = _exposition(snap)
    assert value(text, "hpkv_hit_blocks_total", namespace="llama@bbbbbbbb", tier="dram") == 2


def test_storage_figures_are_exported_when_the_segment_has_them():
    storage = {
        "path": "/nvme/kv",
        "files": 12,
        "bytes": 4096 * 12,
        "capacity_bytes": 1 << 30,
        "free_bytes": 5 << 30,
        "o_direct": True,
        "o_direct_reason": None,
        "io_errors": 1,
        "quarantined": 2,
        "spill_paused": False,
        "bytes_written": 777,
        "bytes_read": 555,
        "spills": 12,
        "promotes": 3,
        "evicted_files": 4,
    }
    text = _exposition(_snapshot(storage=storage))
    assert value(text, "hpkv_storage_enabled") == 1
    assert value(text, "hpkv_storage_files") == 12
    assert value(text, "hpkv_storage_free_bytes") == 5 << 30
    assert value(text, "hpkv_storage_o_direct") == 1
    assert value(text, "hpkv_storage_quarantined_files_total") == 2
    assert value(text, "hpkv_storage_written_bytes_total") == 777
    assert value(text, "hpkv_storage_evicted_files_total") == 4
    disabled = _exposition(_snapshot(storage={"path": None}, server={"pid": 1, "storage": None}))
    assert value(disabled, "hpkv_storage_enabled") == 0
    assert "hpkv_storage_files" not in disabled


def test_a_degraded_storage_tier_and_its_counters_are_exported():
    storage = {
        "path": "/nfs/kv",
        "state": "degraded",
        "degraded_reason": "a stat in the storage directory has not returned for over 1s",
        "lookups_bounded": 3,
        "stat_saturated": 7,
        "gone": 2,
        "spills_dropped": 5,
    }
    text = _exposition(_snapshot(storage=storage))
    assert value(text, "hpkv_storage_degraded") == 1
    assert value(text, "hpkv_storage_lookups_bounded_total") == 3
    assert value(text, "hpkv_storage_stat_saturated_total") == 7
    assert value(text, "hpkv_storage_gone_total") == 2
    assert value(text, "hpkv_storage_spills_dropped_total") == 5
    assert value(text, "hpkv_storage_promote_timeouts_total") == 0
    ok = _exposition(_snapshot(storage={**storage, "state": "ok"}))
    assert value(ok, "hpkv_storage_degraded") == 0


def test_the_metrics_fixture_moves_to_another_port_when_its_first_was_taken(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        taken = busy.getsockname()[1]
        picks = iter([taken, free_port()])
        monkeypatch.setitem(globals(), "free_port", lambda: next(picks))  # what start_with_metrics calls
        srv, port = start_with_metrics()
        try:
            assert port != taken
            assert "hpkv_pool_capacity_bytes" in scrape(port)
        finally:
            srv.cleanup()

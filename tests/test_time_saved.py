"""Per namespace and tier: what hpkv holds (``hpkv status``) and the prefill time its hits saved.

The vLLM connector's two sides run here against a real hpkv server and a real transfer
worker (no engine): the worker side loads saved blocks from DRAM and from storage, its stats
go to the scheduler side as vLLM hands them over, and the scheduler side reports the time
saved to the server. ``hpkv status`` must then show each tier's blocks and bytes, and a saved
time that is the loaded tokens at the prefill rate less the measured load time.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import psutil
import pytest

from hpkv.connectors.vllm.layout import Layout
from hpkv.connectors.vllm.metadata import LoadOp
from hpkv.connectors.vllm.scheduler import SchedulerSide
from hpkv.connectors.vllm.worker import WorkerSide
from hpkv.connectors.vllm.worth import Rate, TimeSaved
from hpkv.io_workers import kvfile
from hpkv.monitor.frame import fmt_seconds, render_text
from hpkv.monitor.metrics import families
from hpkv.monitor.sample import View
from hpkv.monitor.status import format_status
from hpkv.protocol.errors import ROW_MISSING, HpkvError, HpkvUnavailable
from hpkv.protocol.keys import block_keys, namespace_fingerprint
from hpkv.protocol.wire import slot_offset
from hpkv.testing.device import make_device
from hpkv.testing.memory_store import MemoryKvStore
from hpkv.testing.server import ServerProcess, client_of, private_env, status_json, wait_for

PAGE, LAYERS, BS = 4096, 4, 16
FP = namespace_fingerprint({"model": "time-saved-test"})
LAYOUT = Layout(
    fingerprint=FP,
    name="saved-model tp1 bs16",
    world_size=1,
    block_size=BS,
    num_layers=LAYERS,
    page_bytes=PAGE,
)
SHARD = LAYOUT.shard_bytes
PREFILL_TPS = 64.0  # the engine's prefill rate in these tests (tokens/s): a second per 64 tokens


@pytest.fixture
def server(tmp_path):
    storage = tmp_path / "storage"
    storage.mkdir()
    srv = ServerProcess(private_env(pool_size="64m", storage=str(storage))).start()
    try:
        yield srv
    finally:
        srv.cleanup()


class Engine:
    """A client of ``srv`` with a registered device, the connector's worker side on it, and
    its scheduler side (reporting on demand, not from its thread)."""

    def __init__(self, srv: ServerProcess, tmp_path):
        self.c = client_of(srv, name="time-saved-engine")
        self.ns_id = self.c.attach_namespace(FP, 1, SHARD, name=LAYOUT.name, block_tokens=BS).ns_id
        dev = make_device(tmp_path, layers=LAYERS, blocks=32, page=PAGE)
        self.device = self.c.register_device(self.ns_id, rank=0, **dev.spec)
        self.worker = WorkerSide(
            LAYOUT, 0, srv.pool_dir, "cpu", open_store=lambda spec: (self.c, self.ns_id, self.device)
        )
        self.worker._device = self.device  # connected
        self.scheduler = SchedulerSide(
            LAYOUT, None, lambda: (self.c, self.ns_id), lambda rid: None, report_every_s=None
        )
        self.scheduler.hpkv.client, self.scheduler.ns_id = self.c, self.ns_id  # connected

    def save(self, keys: list[bytes]) -> None:
        slots = self.c.reserve(self.ns_id, keys)[:, 0]
        assert (slots >= 0).all(), slots
        assert self.device.save(np.arange(len(keys)), slots)
        assert self.c.commit(self.ns_id, keys) == len(keys)

    def load(self, keys: list[bytes], offsets: np.ndarray) -> dict[str, float]:
        """A step's load of ``keys`` (``offsets``: the scheduler's pins, ROW_MISSING where only
        storage has a block); returns the worker's stats of it, as vLLM hands them over."""
        lost: list[BaseException] = []
        # into blocks 1.. (block 0 is vLLM's null block, which a load refuses)
        op = LoadOp("r1", keys, list(range(1, len(keys) + 1)), offsets)
        self.worker.load(self.c, self.ns_id, [op], lost.append)
        assert lost == [] and self.worker.take_load_errors() == set()
        stats = self.worker.take_stats()
        assert stats is not None
        self.scheduler.step_finished(stats.data)
        return stats.data

    def close(self) -> None:
        self.c.close()


def test_status_lists_each_namespace_with_its_blocks_and_bytes_per_tier(server, tmp_path):
    e = Engine(server, tmp_path)
    try:
        e.save(block_keys(FP, [b"s%d" % i for i in range(6)]))
        wait_for(lambda: e.c.stats()["storage"]["spills"] >= 6, what="6 blocks spilled")
        other_fp = namespace_fingerprint({"model": "other"})
        other = e.c.attach_namespace(other_fp, 2, 3000, name="other-model tp2 bs16", block_tokens=16)
        okeys = block_keys(other_fp, [b"o%d" % i for i in range(3)])
        e.c.reserve(other.ns_id, okeys)
        e.c.commit(other.ns_id, okeys, rank=0)
        e.c.commit(other.ns_id, okeys, rank=1)
        wait_for(lambda: e.c.stats()["storage"]["spills"] >= 6 + 3 * 2, what="the other's files")
        s = status_json(server.env)
    finally:
        e.close()
    by_name = {n["name"]: n for n in s["namespaces"]}
    mine, theirs = by_name[LAYOUT.name], by_name["other-model tp2 bs16"]
    assert mine["fingerprint"] == FP
    assert {t: (v["blocks"], v["bytes"]) for t, v in mine["tiers"].items()} == {
        "dram": (6, 6 * SHARD),
        "storage": (6, 6 * kvfile.file_size(SHARD)),
    }
    slot = 4096  # 3000 bytes take one 4 KiB slot a rank
    assert {t: (v["blocks"], v["bytes"]) for t, v in theirs["tiers"].items()} == {
        "dram": (3, 3 * 2 * slot),
        "storage": (3, 3 * 2 * kvfile.file_size(3000)),
    }
    text = format_status(s)
    assert "FINGERPRINT" in text and FP[:12] in text and "other-model tp2 bs16" in text


def test_dram_and_storage_hits_report_the_prefill_time_they_saved(server, tmp_path):
    e = Engine(server, tmp_path)
    try:
        keys = block_keys(FP, [b"h%d" % i for i in range(8)])
        e.save(keys)
        wait_for(lambda: e.c.stats()["storage"]["spills"] >= 8, what="8 blocks spilled")
        e.scheduler.policy.prefill.add(8192, 8192 / PREFILL_TPS)  # a measured 8192-token prefill
        # A DRAM hit of 4 blocks (pinned, as the scheduler pins them), then a storage hit of 8.
        dram = e.load(keys[:4], slot_offset(e.c.pin(e.ns_id, keys[:4])))
        e.c.unpin(e.ns_id, keys[:4])
        e.c.clear(e.ns_id)
        storage = e.load(keys, np.full((8, 1), ROW_MISSING, np.int64))
        assert e.scheduler.time_saved.report()
        s = status_json(server.env)
    finally:
        e.close()
    (ns,) = s["namespaces"]
    t = ns["tiers"]
    assert t["dram"]["loaded_tokens"] == dram["loaded_tokens_dram"] == 4 * BS
    assert t["storage"]["loaded_tokens"] == storage["loaded_tokens_storage"] == 8 * BS
    for tier, tokens, load_s in (
        ("dram", 4 * BS, dram["load_time_dram_s"]),
        ("storage", 8 * BS, storage["load_time_storage_s"]),
    ):
        assert t[tier]["prefill_saved_s"] == pytest.approx(tokens / PREFILL_TPS, abs=2e-6), tier
        assert t[tier]["load_s"] == pytest.approx(load_s, abs=2e-6) and load_s > 0, tier
        assert t[tier]["time_saved_s"] == pytest.approx(t[tier]["prefill_saved_s"] - t[tier]["load_s"])
    assert t["dram"]["time_saved_s"] > 0, "a 64-token DRAM load beats a second of prefill"
    assert ns["loaded_tokens_dram"] == 4 * BS and ns["prefill_saved_us_dram"] == round(
        4 * BS / PREFILL_TPS * 1e6
    )
    assert "saved-model tp1 bs16" in format_status(s)

    # hpkv-top: both tiers' net saving, then each tier's, where the screen is wide enough
    frame = render_text(View(pool_dir=server.pool_dir, status="up", snap=s, pid=s["server"]["pid"]), 200)
    head = next(line for line in frame.splitlines() if line.startswith("NAMESPACE"))
    row = next(line for line in frame.splitlines() if line.startswith("saved-model"))
    total = t["dram"]["time_saved_s"] + t["storage"]["time_saved_s"]
    for label, seconds in (
        ("TIME SAVED", total),
        ("SAVED DRAM", t["dram"]["time_saved_s"]),
        ("SAVED STOR", t["storage"]["time_saved_s"]),
    ):
        end = head.index(label) + len(label)
        assert row[:end].split()[-1] == fmt_seconds(seconds), label

    # Prometheus: the same figures, per namespace and tier
    got = {
        (m.name, sample.labels["tier"]): sample.value
        for m in families(s, {})
        for sample in m.samples
        if m.name
        in ("hpkv_loaded_tokens", "hpkv_prefill_saved_seconds", "hpkv_load_seconds", "hpkv_namespace_bytes")
    }
    for tier in ("dram", "storage"):
        assert got[("hpkv_loaded_tokens", tier)] == t[tier]["loaded_tokens"]
        assert got[("hpkv_prefill_saved_seconds", tier)] == t[tier]["prefill_saved_s"]
        assert got[("hpkv_load_seconds", tier)] == t[tier]["load_s"]
        assert got[("hpkv_namespace_bytes", tier)] == t[tier]["bytes"]


def test_a_report_for_a_namespace_the_client_did_not_attach_is_refused(server):
    with client_of(server) as a, client_of(server) as b:
        ns_id = a.attach_namespace(FP, 1, SHARD).ns_id
        with pytest.raises(HpkvError, match="not attached by this client"):
            b.report_time_saved(ns_id, {"dram": (16, 1000, 10)})
        with pytest.raises(HpkvError, match="must be an integer"):
            a.report_time_saved(ns_id, {"dram": (16, -1, 10)})
        with pytest.raises(HpkvError, match=r"\[tokens, prefill_us, load_us\]"):
            a.call("time_saved", ns_id=ns_id, storage=[1, 2])
        a.report_time_saved(ns_id, {"storage": (32, 2000, 500)})
        (ns,) = a.stats()["namespaces"]
    assert ns["tiers"]["storage"]["time_saved_s"] == pytest.approx(0.0015)
    assert ns["tiers"]["dram"]["loaded_tokens"] == 0, "the refused reports added nothing"


def test_a_report_the_server_does_not_answer_in_time_breaks_the_client_for_every_call(server):
    """The report runs on its own thread within the hot calls' timeout; its answer may come
    later, and would be read as the next control call's: the client is broken for all calls,
    and the connector's own thread, whose next call fails, reconnects."""
    with client_of(server, call_timeout=0.5) as c:
        ns_id = c.attach_namespace(FP, 1, SHARD).ns_id
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:  # a group stop is not done when kill() returns: a running thread may answer first
            wait_for(
                lambda: psutil.Process(server.proc.pid).status() == psutil.STATUS_STOPPED, what="stopped"
            )
            t0 = time.monotonic()
            with pytest.raises(HpkvUnavailable):
                c.report_time_saved(ns_id, {"dram": (16, 1000, 10)})
            assert time.monotonic() - t0 < 5, "bounded by the hot calls' timeout, not 30 s"
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        with pytest.raises(HpkvUnavailable, match="time_saved"):
            c.lookup(ns_id, block_keys(FP, [b"x"]))


# ------------------------------------------------------------------ the scheduler side's bookkeeping
def time_saved(world: int = 1) -> tuple[TimeSaved, Rate, list[dict]]:
    sent: list[dict] = []
    rate = Rate()
    return TimeSaved(world, rate, lambda r: bool(sent.append(r)) or True, every_s=None), rate, sent


def test_loads_before_the_prefill_rate_is_measured_are_reported_once_it_is():
    saved, rate, sent = time_saved()
    saved.loads_measured({"loaded_tokens_storage": 512, "load_time_storage_s": 0.25})
    assert saved.report() and sent == [], "no rate yet: nothing to say"
    rate.add(1000, 1.0)
    assert saved.report()
    assert sent == [{"storage": (512, 512_000, 250_000)}]
    assert saved.report() and len(sent) == 1, "reported once"


def test_stats_summed_over_ranks_count_each_token_once():
    saved, rate, sent = time_saved(world=2)
    rate.add(1000, 1.0)
    saved.loads_measured({"loaded_tokens_dram": 2 * 64, "load_time_dram_s": 2 * 0.004})
    saved.report()
    assert sent == [{"dram": (64, 64_000, 4_000)}]


def test_a_report_that_could_not_be_sent_is_kept_for_the_next():
    rate = Rate()
    rate.add(1000, 1.0)
    sent: list[dict] = []
    up = False
    saved = TimeSaved(1, rate, lambda r: up and (sent.append(r) or True), every_s=None)
    saved.loads_measured({"loaded_tokens_dram": 100, "load_time_dram_s": 0.01})
    assert not saved.report()
    saved.loads_measured({"loaded_tokens_dram": 100, "load_time_dram_s": 0.01})
    up = True
    assert saved.report()
    assert sent == [{"dram": (200, 200_000, 20_000)}]


def test_the_scheduler_side_reports_its_namespace_from_its_thread():
    store = MemoryKvStore()
    side = SchedulerSide(LAYOUT, None, lambda: (store, 5), lambda rid: None, report_every_s=0.05)
    side.hpkv.client = store
    side.ns_id = 5
    side.policy.prefill.add(4096, 2.0)
    side.step_finished({"loaded_tokens_dram": 64, "load_time_dram_s": 0.001})
    try:
        wait_for(lambda: store.time_saved, timeout=5, what="a report")
    finally:
        side.time_saved.close()
    assert store.time_saved == {(5, "dram"): [64, 31_250, 1_000]}

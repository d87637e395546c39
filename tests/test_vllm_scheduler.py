"""The vLLM connector's scheduler-side bookkeeping against an in-memory hpkv store:
milliseconds, no vLLM server (the end-to-end tests in test_vllm_connector.py run real vLLM)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest

from hpkv.connectors.vllm.layout import Layout
from hpkv.connectors.vllm.scheduler import SchedulerSide
from hpkv.connectors.vllm.worth import LoadPolicy
from hpkv.protocol.errors import ROW_MISSING
from hpkv.protocol.keys import block_keys
from hpkv.protocol.wire import Tier
from hpkv.testing.memory_store import MemoryKvStore

BS = 16
NS = 7
LAYOUT = Layout(fingerprint="ab" * 16, name="unit", world_size=1, block_size=BS, num_layers=2, page_bytes=64)


@dataclass
class Req:
    request_id: str
    num_tokens: int
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    kv_transfer_params: dict | None = None


def request(rid: str, tokens: int, prefix: str = "p") -> Req:
    """A request whose full blocks hash by (prefix, block index): same prefix, same blocks."""
    hashes = [hashlib.sha256(f"{prefix}/{i}".encode()).digest() for i in range(tokens // BS)]
    return Req(rid, tokens, block_hashes=hashes)


def step(*reqs: tuple[Req, int], preempted: tuple[str, ...] = ()) -> SimpleNamespace:
    """A scheduler output scheduling ``n`` new tokens of each request (all new requests)."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r.request_id, num_computed_tokens=r.num_computed_tokens) for r, _ in reqs
        ],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={r.request_id: n for r, n in reqs},
        preempted_req_ids=set(preempted),
    )


class Engine:
    """The scheduler side wired to an in-memory store, with vLLM's block table faked: the
    blocks of request ``r`` are 100*k .. for the k-th request seen."""

    def __init__(
        self,
        threshold: int = 0,
        store: MemoryKvStore | None = None,
        background: bool = True,
        dram_background: bool | None = None,
    ):
        self.store = store or MemoryKvStore()
        self.tables: dict[str, list[int]] = {}
        self.side = SchedulerSide(
            LAYOUT,
            threshold,
            lambda: (self.store, NS),
            self.block_ids,
            background_storage_loads=background,
            background_dram_loads=dram_background,
        )
        self.background: dict[str, bool] = {}
        self.side.hpkv.connect_now(timeout=5)
        assert self.side.hpkv.client is self.store

    def block_ids(self, rid: str) -> tuple[list[int], ...] | None:
        """vLLM's block table of a request: one list per KV cache group (one group here)."""
        return (self.tables[rid],) if rid in self.tables else None

    def admit(self, r: Req) -> int:
        """What vLLM does for a new request: ask for external tokens, allocate, get them."""
        self.side.on_new_request(r)
        n, self.background[r.request_id] = self.side.get_num_new_matched_tokens(r, r.num_computed_tokens)
        self.tables[r.request_id] = [100 * len(self.tables) + i for i in range(r.num_tokens // BS + 1)]
        self.side.update_state_after_alloc(r, (self.tables[r.request_id],), n)
        return n

    def save_all(self, meta) -> None:
        """What the workers do with a step's saves: copy, then commit."""
        for op in meta.saves:
            self.store.commit(NS, op.keys)


def test_a_miss_saves_every_full_block_once_and_the_next_request_hits_them():
    e = Engine()
    r = request("a", 5 * BS + 3)
    assert e.admit(r) == 0
    meta = e.side.build_connector_meta(step((r, r.num_tokens)))
    assert meta.loads == []
    (save,) = meta.saves
    assert save.block_ids == e.tables["a"][:5]
    assert save.keys == block_keys(LAYOUT.fingerprint, r.block_hashes)
    assert save.offsets.shape == (5, 1) and (save.offsets >= 0).all()
    e.save_all(meta)
    r.num_computed_tokens = r.num_tokens
    assert e.side.build_connector_meta(step((r, 1))).saves == [], "saved blocks are not saved again"
    e.side.request_finished("a")

    b = request("b", 5 * BS + 3)
    assert e.admit(b) == 5 * BS
    assert e.background["b"] is False, "a DRAM hit loads in the step (milliseconds)"
    meta = e.side.build_connector_meta(step((b, 3)))
    (load,) = meta.loads
    assert load.block_ids == e.tables["b"][:5] and load.keys == save.keys
    assert (load.offsets == save.offsets).all()
    assert e.side.hit_tiers("b", 5 * BS) == (5 * BS, 0)
    assert meta.saves == [], "blocks that came from hpkv are not saved back"
    assert e.store.pinned() == 5
    e.side.request_finished("b")
    assert e.store.pinned() == 0, "a finished request unpins its hit"


def test_a_request_that_asks_hpkv_to_skip_it_neither_loads_nor_saves():
    e = Engine()
    r = request("a", 4 * BS + 1)
    e.admit(r)
    e.save_all(e.side.build_connector_meta(step((r, r.num_tokens))))
    assert e.store.ready(NS) == 4

    hit = request("b", 4 * BS + 1)
    hit.kv_transfer_params = {"hpkv_skip": True}
    assert e.admit(hit) == 0, "blocks hpkv holds are not loaded for it"
    assert e.store.pinned() == 0
    miss = request("c", 6 * BS + 1, prefix="other")
    miss.kv_transfer_params = {"hpkv_skip": True, "something_else": 1}
    assert e.admit(miss) == 0
    meta = e.side.build_connector_meta(step((hit, hit.num_tokens), (miss, miss.num_tokens)))
    assert meta.loads == [] and meta.saves == [], "nothing of it is saved"

    # Preempted and scheduled again (vLLM keeps the request object): still left alone.
    miss.num_computed_tokens = 0
    e.side.build_connector_meta(step(preempted=("c",)))
    assert e.side.get_num_new_matched_tokens(miss, 0) == (0, False)
    assert e.side.build_connector_meta(step((miss, miss.num_tokens))).saves == []

    for i, value in enumerate((False, "true", 1)):  # only JSON true skips
        again = request(f"d{i}", 6 * BS + 1, prefix=f"other{i}")
        again.kv_transfer_params = {"hpkv_skip": value}
        assert e.admit(again) == 0
        (save,) = e.side.build_connector_meta(step((again, again.num_tokens))).saves
        assert len(save.keys) == 6, f"hpkv_skip {value!r} is an ordinary request"


def test_a_skipped_request_vllm_never_announced_is_still_left_alone():
    e = Engine()
    r = request("a", 4 * BS + 1)
    r.kv_transfer_params = {"hpkv_skip": True}
    assert e.side.get_num_new_matched_tokens(r, 0) == (0, False)  # no on_new_request first
    e.tables["a"] = list(range(5))
    assert e.side.build_connector_meta(step((r, r.num_tokens))).saves == []


def test_a_hit_leaves_the_last_token_to_compute():
    e = Engine()
    r = request("a", 4 * BS)
    e.admit(r)
    e.save_all(e.side.build_connector_meta(step((r, r.num_tokens))))
    assert e.store.ready(NS) == 4
    assert e.admit(request("b", 4 * BS)) == 3 * BS, "a prompt of whole blocks recomputes its last block"


def test_hits_below_the_threshold_load_nothing():
    e = Engine(threshold=4 * BS)
    r = request("a", 3 * BS + 1)
    e.admit(r)
    e.save_all(e.side.build_connector_meta(step((r, r.num_tokens))))
    assert e.admit(request("b", 3 * BS + 1)) == 0
    assert e.side.build_connector_meta(step()).loads == []
    assert e.store.pinned() == 0


def test_storage_hits_are_reported_per_tier_and_load_with_missing_rows():
    e = Engine()
    r = request("a", 4 * BS + 1)
    e.admit(r)
    e.save_all(e.side.build_connector_meta(step((r, r.num_tokens))))
    assert e.side.reset_cache() and e.store.ready(NS) == 0, "reset drops the DRAM copies"
    b = request("b", 4 * BS + 1)
    assert e.admit(b) == 4 * BS
    assert e.side.hit_tiers("b", 4 * BS) == (0, 4 * BS)
    assert e.background["b"] is True, "a hit that needs the disk loads in the background"
    (load,) = e.side.build_connector_meta(step((b, 1))).loads
    assert (load.offsets == ROW_MISSING).all(), "not in DRAM: the worker promotes them"
    assert load.background


def test_a_block_still_being_checked_on_storage_defers_the_request_then_it_hits():
    e = Engine()
    r = request("a", 4 * BS + 1)
    e.admit(r)
    e.save_all(e.side.build_connector_meta(step((r, r.num_tokens))))
    e.side.reset_cache()
    b = request("b", 4 * BS + 1)
    e.store.checking[e.side._keys(b.block_hashes[:1])[0]] = 2  # its stat outlives two lookups
    e.side.on_new_request(b)
    assert e.side.get_num_new_matched_tokens(b, 0) == (None, False), "not scheduled yet: asked again"
    assert e.side.get_num_new_matched_tokens(b, 0) == (None, False)
    assert e.side.get_num_new_matched_tokens(b, 0) == (4 * BS, True), "confirmed: the whole hit"


def test_a_check_that_outlasts_the_retry_bound_is_recomputed():
    e = Engine()
    e.side.lookup_retry_s = 0.05
    r = request("a", 4 * BS + 1)
    e.admit(r)
    e.save_all(e.side.build_connector_meta(step((r, r.num_tokens))))
    e.side.reset_cache()
    b = request("b", 4 * BS + 1)
    e.store.checking[e.side._keys(b.block_hashes[2:3])[0]] = 1000  # a hung stat
    e.side.on_new_request(b)
    assert e.side.get_num_new_matched_tokens(b, 0) == (None, False)
    time.sleep(0.06)
    assert e.side.get_num_new_matched_tokens(b, 0) == (2 * BS, True), "the confirmed prefix, no longer"


def test_dram_hits_and_async_off_load_in_the_step():
    e = Engine(background=False)
    r = request("a", 4 * BS + 1)
    e.admit(r)
    e.save_all(e.side.build_connector_meta(step((r, r.num_tokens))))
    e.side.request_finished("a")  # nothing else runs: auto loads a DRAM hit in the step
    assert e.admit(request("b", 4 * BS + 1)) == 4 * BS and e.background["b"] is False
    e.side.reset_cache()
    assert e.admit(request("c", 4 * BS + 1)) == 4 * BS
    assert e.background["c"] is False, "HPKV_ASYNC_STORAGE_LOADS=0: storage hits load in the step too"
    assert not any(op.background for op in e.side.build_connector_meta(step()).loads)


def dram_hit_while(e: Engine, running: bool, params: dict | None = None, rid: str = "b") -> tuple[bool, bool]:
    """Admit a request whose 4 blocks DRAM holds (saved by a first request ``a``, which is
    still running when ``running``, else finished): (the background flag vLLM got, the one
    its load carries to the workers)."""
    if "a" not in e.tables:
        a = request("a", 4 * BS + 1)
        e.admit(a)
        e.save_all(e.side.build_connector_meta(step((a, a.num_tokens))))
        a.num_computed_tokens = a.num_tokens
        if not running:
            e.side.request_finished("a")
    b = request(rid, 4 * BS + 1)
    b.kv_transfer_params = params
    assert e.admit(b) == 4 * BS and e.side.hit_tiers(rid, 4 * BS) == (4 * BS, 0)
    (load,) = e.side.build_connector_meta(step((b, 1))).loads
    return e.background[rid], load.background


def test_auto_loads_a_dram_hit_in_the_background_while_other_requests_run():
    assert dram_hit_while(Engine(), running=True) == (True, True), (
        "the running request need not wait for the copy"
    )


def test_auto_loads_a_dram_hit_in_the_step_when_nothing_else_runs():
    assert dram_hit_while(Engine(), running=False) == (False, False), "nobody waits: no async round trip"


def test_a_finished_request_no_longer_counts_as_running():
    e = Engine()
    dram_hit_while(e, running=True)
    e.side.request_finished("a")
    e.side.request_finished("b")
    assert dram_hit_while(e, running=True, rid="c") == (False, False)


def test_async_dram_loads_on_loads_every_dram_hit_in_the_background():
    assert dram_hit_while(Engine(dram_background=True), running=False) == (True, True)


def test_async_dram_loads_off_loads_every_dram_hit_in_the_step_whatever_the_request_asks():
    e = Engine(dram_background=False)
    assert dram_hit_while(e, running=True, params={"hpkv_async_dram_load": True}) == (False, False)


@pytest.mark.parametrize("asked", [True, False])
def test_a_request_chooses_how_its_dram_hit_loads_unless_the_key_is_off(asked):
    for running in (True, False):
        e = Engine()
        assert dram_hit_while(e, running, params={"hpkv_async_dram_load": asked}) == (asked, asked)


def test_a_request_that_asks_with_a_string_is_not_heard():
    e = Engine()
    assert dram_hit_while(e, running=True, params={"hpkv_async_dram_load": "false"}) == (True, True)


def test_the_dram_setting_leaves_storage_hits_to_async_storage_loads():
    e = Engine(background=False, dram_background=True)
    r = request("a", 4 * BS + 1)
    e.admit(r)
    e.save_all(e.side.build_connector_meta(step((r, r.num_tokens))))
    e.side.reset_cache()  # only on storage now
    assert e.admit(request("b", 4 * BS + 1)) == 4 * BS
    assert e.background["b"] is False, "HPKV_ASYNC_STORAGE_LOADS=0 decides a storage hit"


def test_a_full_pool_saves_what_fits():
    e = Engine(store=MemoryKvStore(capacity_blocks=2))
    r = request("a", 4 * BS + 1)
    e.admit(r)
    (save,) = e.side.build_connector_meta(step((r, r.num_tokens))).saves
    assert save.block_ids == e.tables["a"][:2]


def test_a_preempted_request_does_not_save_its_blocks_twice():
    e = Engine()
    r = request("a", 4 * BS + 1)
    e.admit(r)
    e.save_all(e.side.build_connector_meta(step((r, 2 * BS))))
    r.num_computed_tokens = 0  # preempted: resumes from scratch with new blocks
    e.tables["a"] = [900 + i for i in range(5)]
    (save,) = e.side.build_connector_meta(step((r, r.num_tokens), preempted=("a",))).saves
    assert save.block_ids == [902, 903], "blocks hpkv has are reserved as present, not rewritten"


def test_no_block_table_yet_means_no_saves_and_no_error():
    e = Engine()
    r = request("a", 4 * BS + 1)
    e.admit(r)
    e.tables.clear()
    assert e.side.build_connector_meta(step((r, r.num_tokens))).saves == []


@pytest.mark.parametrize("failing", ["lookup", "pin", "reserve", "unpin", "clear"])
def test_a_failing_hpkv_means_recompute_and_a_reconnect(failing):
    e = Engine()
    r = request("a", 4 * BS + 1)
    e.admit(r)
    e.save_all(e.side.build_connector_meta(step((r, r.num_tokens))))
    e.store.fail.add(failing)
    b = request("b", 6 * BS + 1)  # 4 blocks to load, 2 new ones to save
    n = e.admit(b)
    b.num_computed_tokens = n
    meta = e.side.build_connector_meta(step((b, b.num_tokens - n)))
    if failing in ("unpin", "clear"):  # still connected while the step is built
        assert [op.block_ids for op in meta.saves] == [e.tables["b"][4:6]]
    e.side.request_finished("b")
    e.side.reset_cache()
    if failing == "lookup":
        assert n == 0 and meta.loads == []
    elif failing == "pin":
        (load,) = meta.loads
        assert (load.offsets == ROW_MISSING).all(), "unpinned blocks are loaded by nobody: recompute"
    assert e.side.hpkv.client is None, f"a failed {failing} drops the connection"
    assert e.store.closed
    assert e.admit(request("c", 4 * BS + 1)) == 0, "no store: a miss, no error"


def test_reconnect_gets_a_new_store():
    stores = [MemoryKvStore(), MemoryKvStore()]
    side = SchedulerSide(LAYOUT, 0, lambda: (stores.pop(0), NS), lambda rid: ([0] * 8,))
    side.hpkv.connect_now(timeout=5)
    first = side.hpkv.client
    side.hpkv.lost(RuntimeError("gone"))
    side.hpkv._next_try = 0.0  # do not wait RECONNECT_INTERVAL_S in a unit test
    side.hpkv.connect_now(timeout=5)
    assert side.hpkv.client is not None and side.hpkv.client is not first
    assert np.array_equal(side.hpkv.client.reserve(NS, [b"k" * 16]), [[0]])


def test_a_failed_connection_is_retried_soon_then_less_often():
    import logging

    from hpkv.connectors.reconnect import Reconnecting

    attempts: list[float] = []

    def connect() -> MemoryKvStore:
        attempts.append(time.monotonic())
        if len(attempts) <= 3:
            raise ConnectionResetError(104, "Connection reset by peer")  # a start-up race
        return MemoryKvStore()

    conn = Reconnecting("test", connect, logging.getLogger("test"), interval_s=0.8, first_retry_s=0.1)
    deadline = time.monotonic() + 10
    while conn.get() is None:  # what every engine step does
        assert time.monotonic() < deadline, attempts
        time.sleep(0.01)
    waits = [b - a for a, b in zip(attempts, attempts[1:], strict=False)]
    # 0.1, 0.2 and 0.4 s after each failure (not 0.8 s each): up in ~0.7 s, not 2.4 s
    assert len(waits) == 3, waits
    for waited, want in zip(waits, (0.1, 0.2, 0.4), strict=True):
        assert want - 0.02 <= waited < want + 0.3, waits
    conn.lost(RuntimeError("gone"))
    assert conn._failures == 0, "a success starts the back-off over"


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def measured_policy(prefill_tps: float, dram_tps: float | None, storage_tps: float | None) -> LoadPolicy:
    """An auto policy that has seen steps at ``prefill_tps`` and loads at the given rates."""
    clock = Clock()
    p = LoadPolicy(None, clock=clock)
    for _ in range(3):
        p.step_scheduled(1024)
        clock.t += 1024 / prefill_tps
        p.step_finished()
    p.step_scheduled(3)  # a decode step says nothing about the prefill rate
    clock.t += 10.0
    p.step_finished()
    stats = {}
    if dram_tps:
        stats.update(loaded_tokens_dram=1024, load_time_dram_s=1024 / dram_tps)
    if storage_tps:
        stats.update(loaded_tokens_storage=1024, load_time_storage_s=1024 / storage_tps)
    p.loads_measured(stats)
    return p


D, S = int(Tier.DRAM), int(Tier.STORAGE)


def test_a_fixed_threshold_loads_all_or_nothing():
    p = LoadPolicy(64)
    assert p.blocks_to_load([S, S], BS) == 0 and p.blocks_to_load([D] * 4, BS) == 4


def test_auto_loads_everything_until_rates_are_measured():
    assert LoadPolicy(None).blocks_to_load([D, D, S, S], BS) == 4


def test_auto_skips_a_storage_tier_slower_than_prefill_but_keeps_the_dram_prefix():
    slow_disk = measured_policy(prefill_tps=2000, dram_tps=200_000, storage_tps=500)
    assert slow_disk.prefill.tokens_per_s == pytest.approx(2000)
    assert slow_disk.blocks_to_load([D, D, S, S, S], BS) == 2
    assert slow_disk.blocks_to_load([S, S, S], BS) == 0
    fast_disk = measured_policy(prefill_tps=2000, dram_tps=200_000, storage_tps=20_000)
    assert fast_disk.blocks_to_load([D, D, S, S, S], BS) == 5


def test_the_scheduler_in_auto_mode_loads_only_the_dram_part_of_a_hit_from_a_slow_disk():
    e = Engine()
    e.side.policy = measured_policy(prefill_tps=2000, dram_tps=200_000, storage_tps=500)
    r = request("a", 6 * BS + 1)
    e.admit(r)
    e.save_all(e.side.build_connector_meta(step((r, r.num_tokens))))
    e.side.reset_cache()  # all 6 blocks now only on storage
    e.store.promote(NS, block_keys(LAYOUT.fingerprint, r.block_hashes[:2]))  # 2 back in DRAM
    e.side.request_finished("a")  # nothing else runs: the DRAM part loads in the step
    assert e.admit(request("b", 6 * BS + 1)) == 2 * BS
    assert e.background["b"] is False, "the DRAM part loads in the step"


def test_a_remote_store_hit_loads_as_a_storage_hit_does():
    R = int(Tier.REMOTE)
    slow_disk = measured_policy(prefill_tps=2000, dram_tps=200_000, storage_tps=500)
    assert slow_disk.blocks_to_load([D, D, R, R], BS) == 2, "at the rate of loads from below the pool"
    e = Engine(background=True, dram_background=False)
    assert e.side.loads_in_background(request("x", 4 * BS), [D, R]), "a background load"
    assert not e.side.loads_in_background(request("y", 4 * BS), [D, D])

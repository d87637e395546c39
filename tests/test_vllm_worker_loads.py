"""Storage loads in parts (hpkv.connectors.promote), mostly through the vLLM connector's
worker-side loads, against an in-memory hpkv store and a recording block mover: how a storage
load is split into parts, that each part's copy runs while the next part is read, and that
every pin is released whatever fails (milliseconds; the end-to-end tests in
test_vllm_connector.py and test_sglang.py run the same code in real vLLM and SGLang)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from hpkv.connectors.promote import PROMOTE_PARTS, load_in_parts, promote_parts
from hpkv.connectors.vllm import worker as worker_module
from hpkv.connectors.vllm.layout import Layout
from hpkv.connectors.vllm.metadata import HpkvMetadata, LoadOp
from hpkv.connectors.vllm.worker import WorkerSide
from hpkv.protocol.errors import ROW_MISSING, HpkvUnavailable
from hpkv.protocol.keys import block_keys
from hpkv.testing.memory_store import MemoryKvStore

NS = 3
LAYOUT = Layout(
    fingerprint="cd" * 16, name="unit", world_size=1, block_size=16, num_layers=2, page_bytes=2048
)
SHARD = LAYOUT.shard_bytes


class Store(MemoryKvStore):
    """Records each promote's keys; ``fail_promote`` makes that promote call (1-based) raise."""

    def __init__(self, fail_promote: int = 0, world_size: int = 1):
        super().__init__(world_size=world_size, slot_bytes=SHARD)
        self.promotes: list[list[bytes]] = []
        self.timeouts: list[float | None] = []
        self.entered = threading.Condition()
        self.fail_promote = fail_promote

    def promote(self, ns_id, keys, timeout=None):
        with self.entered:
            self.promotes.append(list(keys))
            self.timeouts.append(timeout)
            self.entered.notify_all()
        if len(self.promotes) == self.fail_promote:
            raise HpkvUnavailable("the disk went away")
        return super().promote(ns_id, keys, timeout)


class Mover:
    """Copies nothing; records each load (``fail_copy``: that load, 1-based, fails). With
    ``promotes_after``, the k-th copy of a load whose storage blocks come in that many parts
    ends only once the k-th promote has begun (or after 2 s, recorded as False): it ran while
    the part after it was being read. A load that promotes first and copies after never
    lets the k-th promote begin before the k-th copy ends."""

    def __init__(
        self,
        store: Store,
        fail_copy: int = 0,
        promotes_after: int = 0,
        raise_copy: int = 0,
        copy_s: float = 0.0,
    ):
        self.store, self.fail_copy, self.promotes_after = store, fail_copy, promotes_after
        self.copy_s = copy_s  # each load takes this long
        self.raise_copy = raise_copy  # that load (1-based) raises, as a dead transfer worker's does
        self.loads: list[list[int]] = []
        self.offsets: list[list[int]] = []
        self.beside_next_promote: list[bool] = []

    def load(self, blocks, offsets) -> bool:
        self.loads.append([int(b) for b in blocks])
        self.offsets.append([int(o) for o in offsets])
        k = len(self.loads)
        time.sleep(self.copy_s)
        if k <= self.promotes_after:
            with self.store.entered:
                self.beside_next_promote.append(
                    self.store.entered.wait_for(lambda: len(self.store.promotes) >= k, timeout=2.0)
                )
        if k == self.raise_copy:
            with self.store.entered:  # the next part's promote is under way: its pins must not leak
                assert self.store.entered.wait_for(lambda: len(self.store.promotes) > k - 1, timeout=2.0)
            raise HpkvUnavailable("transfer worker 0 answered nothing for 10s")
        return k != self.fail_copy

    def save(self, blocks, offsets) -> bool:
        return True


def stored_blocks(store: Store, n: int, in_dram: int = 0) -> tuple[list[bytes], np.ndarray]:
    """``n`` blocks on storage only, except the first ``in_dram`` (pinned, as the scheduler does)."""
    keys = block_keys(LAYOUT.fingerprint, [f"b{i}".encode() for i in range(n)])
    store.reserve(NS, keys)
    store.commit(NS, keys)
    store.clear(NS)
    offsets = np.full((n, 1), ROW_MISSING, np.int64)
    if in_dram:
        offsets[:in_dram] = store.promote(NS, keys[:in_dram])
        store.promotes.clear()
    return keys, offsets


def worker(store: Store, mover: Mover, part_blocks: int) -> WorkerSide:
    side = WorkerSide(LAYOUT, 0, "/nonexistent", "cpu", open_store=lambda spec: (store, NS, mover))
    side._device = mover  # connected (open_store would do it on first use)
    side.promote_part_bytes = part_blocks * SHARD
    return side


def load(
    side: WorkerSide, store: Store, keys: list[bytes], offsets: np.ndarray, timeout: float | None = None
) -> list[BaseException]:
    lost: list[BaseException] = []
    op = LoadOp("r1", keys, list(range(100, 100 + len(keys))), offsets, background=True)
    side.load(store, NS, [op], lost.append, timeout)
    return lost


class Connection:
    """One of several connections to ``store``: records the keys its promotes pinned and the
    keys unpinned through it (the server's pins belong to the connection that made them)."""

    def __init__(self, store: Store):
        self.store = store
        self.pinned: list[bytes] = []
        self.unpinned: list[bytes] = []

    def promote(self, ns_id, keys, timeout=None):
        rows = self.store.promote(ns_id, keys, timeout)
        self.pinned += [k for k, row in zip(keys, rows, strict=True) if (row >= 0).all()]
        return rows

    def unpin(self, ns_id, keys):
        self.unpinned += list(keys)
        self.store.unpin(ns_id, keys)


def test_parts_are_at_least_the_part_size_and_at_most_eight():
    missing = np.arange(64)
    seven_mib = 7 << 20  # Qwen2.5-7B: one 128-token block
    assert [len(p) for p in promote_parts(missing, seven_mib, 16 << 20)] == [8] * PROMOTE_PARTS
    assert len(promote_parts(np.arange(10), 512 << 10, 16 << 20)) == 1, "5 MiB in all: one part"
    assert [len(p) for p in promote_parts(np.arange(7), SHARD, 2 * SHARD)] == [3, 2, 2]
    assert [len(p) for p in promote_parts(missing, seven_mib, 0)] == [64], "0: one part"
    assert promote_parts(np.arange(0), SHARD, SHARD) == []
    parts = promote_parts(np.arange(100, 164), SHARD, SHARD)
    assert np.array_equal(np.concatenate(parts), np.arange(100, 164)), "every block, in order"


def test_each_parts_copy_runs_while_the_next_part_is_promoted():
    store = Store()
    keys, offsets = stored_blocks(store, 8, in_dram=2)
    mover = Mover(store, promotes_after=3)
    side = worker(store, mover, part_blocks=2)
    assert load(side, store, keys, offsets) == []
    assert store.promotes == [keys[2:4], keys[4:6], keys[6:8]], "the storage blocks, in 3 parts"
    assert mover.loads == [[100, 101], [102, 103], [104, 105], [106, 107]], "DRAM blocks first"
    # The DRAM blocks were copied while part 1 was promoted, part 1 while part 2 was, part 2
    # while part 3 was.
    assert mover.beside_next_promote == [True, True, True]
    assert side.take_load_errors() == set()
    assert store.pinned() == 2, "the promoted blocks are unpinned; the scheduler's 2 pins stay its own"
    s = side.stats.data
    assert (s["loaded_tokens_dram"], s["loaded_tokens_storage"]) == (2 * 16, 6 * 16)


def test_a_load_in_one_part_promotes_once_on_the_calling_thread():
    store = Store()
    keys, offsets = stored_blocks(store, 5)
    mover = Mover(store)
    side = worker(store, mover, part_blocks=8)
    before = threading.active_count()
    assert load(side, store, keys, offsets) == []
    assert store.promotes == [keys] and mover.loads == [[100, 101, 102, 103, 104]]
    assert threading.active_count() == before and store.pinned() == 0


def test_a_background_dram_load_is_copied_in_batches_a_save_can_come_between(monkeypatch):
    # The step thread's saves share the device handle and the transfer worker: between two
    # batches, not after the whole hit.
    monkeypatch.setattr(worker_module, "BACKGROUND_COPY_BATCH_BYTES", 2 * SHARD)
    store = Store()
    keys, offsets = stored_blocks(store, 5, in_dram=5)
    mover = Mover(store)
    side = WorkerSide(
        LAYOUT, 0, "/nonexistent", "cpu", lambda spec: (store, NS, mover), open_load_store=lambda: (store, NS)
    )
    side._device = mover
    op = LoadOp("r1", keys, list(range(100, 105)), offsets, background=True)
    side.start_load_kv(HpkvMetadata(loads=[op]))
    deadline = time.monotonic() + 5
    while not (done := side.take_finished_loads(idle_step=True)) and time.monotonic() < deadline:
        pass
    side.shutdown()
    assert done == {"r1"} and side.take_load_errors() == set()
    assert mover.loads == [[100, 101], [102, 103], [104]]
    assert store.promotes == [], "all of it in DRAM: nothing promoted"


def test_a_load_in_the_step_is_one_copy():
    store = Store()
    keys, offsets = stored_blocks(store, 5, in_dram=5)
    mover = Mover(store)
    assert load(worker(store, mover, part_blocks=2), store, keys, offsets) == []
    assert mover.loads == [[100, 101, 102, 103, 104]]


@pytest.mark.parametrize("failing", [1, 2, 3])
def test_a_promote_that_fails_mid_load_reports_every_block_and_leaves_no_pin(failing):
    store = Store(fail_promote=failing)
    keys, offsets = stored_blocks(store, 6)
    mover = Mover(store)
    side = worker(store, mover, part_blocks=2)
    lost = load(side, store, keys, offsets)
    assert len(lost) == 1 and "the disk went away" in str(lost[0])
    assert side.take_load_errors() == set(range(100, 106)), "vLLM recomputes all of it"
    assert len(store.promotes) == failing, "no promote is started after one failed"
    assert len(mover.loads) == failing - 1, "the parts promoted before it were copied"
    assert store.pinned() == 0, "what was promoted before the failure is unpinned"


def test_a_failed_copy_of_one_part_fails_only_that_part():
    store = Store()
    keys, offsets = stored_blocks(store, 6)
    mover = Mover(store, fail_copy=2)
    side = worker(store, mover, part_blocks=2)
    assert load(side, store, keys, offsets) == []
    assert side.take_load_errors() == {102, 103}
    assert side.stats.data["loaded_tokens_storage"] == 4 * 16 and store.pinned() == 0


def test_a_block_no_promote_could_load_is_neither_copied_nor_pinned():
    store = Store()
    keys, offsets = stored_blocks(store, 6)
    del store.blocks[(NS, keys[3])]  # its file is gone
    mover = Mover(store)
    side = worker(store, mover, part_blocks=2)
    assert load(side, store, keys, offsets) == []
    assert mover.loads == [[100, 101], [102], [104, 105]]
    assert side.take_load_errors() == {103} and store.pinned() == 0


def test_a_copy_that_raises_while_the_next_part_is_read_unpins_that_part_too():
    store = Store()
    keys, offsets = stored_blocks(store, 6)
    mover = Mover(store, raise_copy=1)  # part 1's copy raises while part 2 is being promoted
    side = worker(store, mover, part_blocks=2)
    lost = load(side, store, keys, offsets)
    assert len(lost) == 1 and "answered nothing" in str(lost[0])
    assert side.take_load_errors() == set(range(100, 106))
    assert store.promotes == [keys[0:2], keys[2:4]], "part 3 is never started"
    assert store.pinned() == 0, "parts 1 and 2 were promoted (pinned for us) and are unpinned"


def test_the_parts_share_one_promote_deadline():
    # Three parts, each copy 0.3 s, 1 s for the whole load: the third promote starts after
    # two copies and gets what is left, not a fresh second.
    store = Store()
    keys, offsets = stored_blocks(store, 6)
    side = worker(store, Mover(store, copy_s=0.3), part_blocks=2)
    assert load(side, store, keys, offsets, timeout=1.0) == []
    timeouts = [t for t in store.timeouts if t is not None]
    assert len(timeouts) == 3, f"every part gets a bound: {store.timeouts}"
    first, second, third = timeouts
    assert 1.0 >= first >= second >= third > 0
    assert third <= 0.75, store.timeouts


def test_rank_1_of_two_copies_its_own_shards_of_each_part():
    # Tensor parallel 2: each rank loads its own shard of every block; the parts are sized
    # by one rank's shard bytes, and rank 1 copies from rank 1's pool offsets.
    layout = Layout(
        fingerprint="ef" * 16, name="tp2", world_size=2, block_size=16, num_layers=2, page_bytes=2048
    )
    store = Store(world_size=2)
    keys = block_keys(layout.fingerprint, [f"b{i}".encode() for i in range(6)])
    store.reserve(NS, keys)
    for rank in (0, 1):
        store.commit(NS, keys, rank=rank)
    store.clear(NS)
    mover = Mover(store)
    side = WorkerSide(layout, 1, "/nonexistent", "cpu", open_store=lambda spec: (store, NS, mover))
    side._device = mover
    side.promote_part_bytes = 2 * layout.shard_bytes
    op = LoadOp("r1", keys, list(range(100, 106)), np.full((6, 2), ROW_MISSING, np.int64), background=True)
    side.load(store, NS, [op], lambda exc: pytest.fail(f"lost: {exc}"))
    assert store.promotes == [keys[0:2], keys[2:4], keys[4:6]]
    assert mover.loads == [[100, 101], [102, 103], [104, 105]]
    rank1 = [int(store.blocks[(NS, k)].offset + SHARD) for k in keys]
    assert sum(mover.offsets, []) == rank1, "rank 1's shards, not rank 0's"
    assert side.take_load_errors() == set() and store.pinned() == 0


def test_a_prefix_load_stops_after_a_part_that_came_back_short():
    # SGLang uses the leading pages that arrived: once a part misses a page (its file is
    # gone), the pages after it are of no use. The part already being read ahead completes
    # and is unpinned; the one after it never starts.
    store = Store()
    keys, offsets = stored_blocks(store, 8)
    del store.blocks[(NS, keys[3])]
    copies: list[list[int]] = []

    def copy(idx, offs):
        copies.append([int(i) for i in idx])
        return True

    ok = load_in_parts(store, NS, keys, offsets[:, 0].copy(), 0, SHARD, 2 * SHARD, 5.0, copy, True)
    assert store.promotes == [keys[0:2], keys[2:4], keys[4:6]], "part 3 was read ahead; part 4 never starts"
    assert copies == [[0, 1], [2]]
    assert ok.tolist() == [True, True, True] + [False] * 5
    assert store.pinned() == 0


def test_a_second_connection_reads_the_next_part_while_the_first_is_read():
    store = Store()
    keys, offsets = stored_blocks(store, 8)
    first_saw_second: list[bool] = []
    promote = store.promote

    def first_part_waits(ns_id, ks, timeout=None):
        rows = promote(ns_id, ks, timeout)
        if list(ks) == keys[0:2]:  # ends only once the second part's promote has begun
            with store.entered:
                first_saw_second.append(store.entered.wait_for(lambda: len(store.promotes) >= 2, timeout=2.0))
        return rows

    store.promote = first_part_waits
    a, b = Connection(store), Connection(store)
    copies: list[list[int]] = []

    def copy(idx, offs):
        copies.append([int(i) for i in idx])
        return True

    ok = load_in_parts(a, NS, keys, offsets[:, 0].copy(), 0, SHARD, 2 * SHARD, 5.0, copy, ahead=b)
    assert ok.all()
    assert first_saw_second == [True], "two parts in flight at once"
    assert copies == [[0, 1], [2, 3], [4, 5], [6, 7]], "copied in order"
    assert (a.pinned, b.pinned) == (keys[0:2] + keys[4:6], keys[2:4] + keys[6:8]), "parts alternate"
    assert sorted(a.unpinned) == sorted(a.pinned) and sorted(b.unpinned) == sorted(b.pinned)
    assert store.pinned() == 0


def test_a_prefix_load_read_two_parts_ahead_unpins_both_through_their_connections():
    store = Store()
    keys, offsets = stored_blocks(store, 8)
    del store.blocks[(NS, keys[1])]
    a, b = Connection(store), Connection(store)
    ok = load_in_parts(
        a, NS, keys, offsets[:, 0].copy(), 0, SHARD, 2 * SHARD, 5.0, lambda i, o: True, True, b
    )
    assert ok.tolist() == [True] + [False] * 7
    assert len(store.promotes) == 3, "parts 2 and 3 were being read ahead when part 1 came back short"
    assert sorted(a.unpinned) == sorted(a.pinned) and sorted(b.unpinned) == sorted(b.pinned)
    assert store.pinned() == 0

"""The vLLM connector's worker-side saves on the CPU backend, against an in-memory hpkv store and
a transfer worker the test answers by hand: a save is submitted at the end of the step and not
waited for, its keys are committed when every copy of it is answered, vLLM frees a finished
request's blocks only then, a preempted request's saves are finished before its blocks are
reused, and a transfer worker that fails or a lost hpkv never reaches vLLM (milliseconds; every
real-vLLM test in test_vllm_connector.py runs the same code)."""

from __future__ import annotations

import errno

from hpkv.connectors.vllm.layout import Layout
from hpkv.connectors.vllm.metadata import HpkvMetadata, SaveOp
from hpkv.connectors.vllm.worker import WorkerSide
from hpkv.protocol.keys import block_keys
from hpkv.ring import RingClosed
from hpkv.testing.memory_store import MemoryKvStore

NS = 5
LAYOUT = Layout(
    fingerprint="ef" * 16, name="unit", world_size=1, block_size=16, num_layers=2, page_bytes=2048
)


class HandAnsweredWorkers:
    """A device handle with two transfer workers that complete a job only when the test says
    so (statuses are claimed once, as DeviceHandle's are); ``fail_poll`` makes polls raise."""

    def __init__(self) -> None:
        self.seq = 0
        self.open: set[tuple[int, int]] = set()
        self.answered: dict[tuple[int, int], int] = {}
        self.fail_poll: Exception | None = None
        self.waited: list[list[tuple[int, int]]] = []

    def submit(self, kind, blocks, offsets, event=-1):
        tickets = []
        for w in (0, 1):  # split across both workers, as DeviceHandle does
            self.seq += 1
            tickets.append((w, self.seq))
        self.open.update(tickets)
        return tickets

    def answer(self, ticket, status: int = 0) -> None:
        self.open.discard(ticket)
        self.answered[ticket] = status

    def poll(self, tickets):
        if self.fail_poll is not None:
            raise self.fail_poll
        return {t: self.answered.pop(t) for t in tickets if t in self.answered}

    def wait(self, tickets, timeout=None):
        self.waited.append(list(tickets))
        for t in list(tickets):
            if t in self.open:
                self.answer(t)
        return self.poll(tickets)


def side_with(store: MemoryKvStore, mover: HandAnsweredWorkers) -> WorkerSide:
    side = WorkerSide(LAYOUT, 0, "/nonexistent", "cpu", open_store=lambda spec: (store, NS, mover))
    side.hpkv.connect_now(timeout=1.0)
    return side


def save_step(store: MemoryKvStore, req: str, names: list[str]) -> tuple[HpkvMetadata, list[bytes]]:
    keys = block_keys(LAYOUT.fingerprint, [n.encode() for n in names])
    offsets = store.reserve(NS, keys)
    meta = HpkvMetadata(saves=[SaveOp(req, keys, list(range(len(keys))), offsets)])
    return meta, keys


def test_a_save_is_not_waited_for_and_its_request_is_freed_once_every_copy_is_answered():
    store, mover = MemoryKvStore(slot_bytes=LAYOUT.shard_bytes), HandAnsweredWorkers()
    side = side_with(store, mover)
    meta, keys = save_step(store, "r1", ["a", "b"])
    side.wait_for_save(meta)
    assert len(mover.open) == 2 and not mover.waited, "submitted, not waited for"
    assert side.finished_saves({"r1"}) == set(), "vLLM must not free blocks a copy still reads"
    first, second = sorted(mover.open)
    mover.answer(first)
    assert side.finished_saves(set()) == set(), "one of two copies answered"
    assert store.lookup(NS, keys) == (0, []), "committed only once every copy is done"
    mover.answer(second)
    assert side.finished_saves(set()) == {"r1"}, "its status from the first poll was kept"
    assert store.lookup(NS, keys) == (2, [1, 1])
    assert side.stats.data["saved_tokens"] == 2 * LAYOUT.block_size


def test_a_request_without_saves_in_flight_is_freed_at_once():
    store, mover = MemoryKvStore(slot_bytes=LAYOUT.shard_bytes), HandAnsweredWorkers()
    side = side_with(store, mover)
    meta, _ = save_step(store, "r1", ["a"])
    side.wait_for_save(meta)
    for t in list(mover.open):
        mover.answer(t)
    assert side.finished_saves(set()) == set(), "not finished yet: vLLM keeps it"
    assert side.finished_saves({"r1"}) == {"r1"}


def test_a_preempted_requests_saves_are_finished_before_its_blocks_are_reused():
    store, mover = MemoryKvStore(slot_bytes=LAYOUT.shard_bytes), HandAnsweredWorkers()
    side = side_with(store, mover)
    meta, keys = save_step(store, "p1", ["a"])
    other, _ = save_step(store, "q1", ["b"])
    side.wait_for_save(meta)
    side.wait_for_save(other)
    side.handle_preemptions({"p1"})
    assert len(mover.waited) == 1 and store.lookup(NS, keys) == (1, [1]), "p1's copy waited for"
    assert len(mover.open) == 2, "q1's copy is still not waited for"


def test_a_failed_copy_aborts_the_save_and_still_frees_the_request():
    store, mover = MemoryKvStore(slot_bytes=LAYOUT.shard_bytes), HandAnsweredWorkers()
    side = side_with(store, mover)
    meta, keys = save_step(store, "r1", ["a"])
    side.wait_for_save(meta)
    first, second = sorted(mover.open)
    mover.answer(first)
    mover.answer(second, -errno.EFAULT)
    assert side.finished_saves({"r1"}) == {"r1"}
    assert store.lookup(NS, keys) == (0, []) and side.stats.data["save_failed_blocks"] == 1


def test_a_transfer_worker_link_that_breaks_loses_the_save_not_the_engine():
    store, mover = MemoryKvStore(slot_bytes=LAYOUT.shard_bytes), HandAnsweredWorkers()
    side = side_with(store, mover)
    meta, keys = save_step(store, "r1", ["a"])
    side.wait_for_save(meta)
    mover.fail_poll = RingClosed("the ring was closed in this process; attach it again to use it")
    assert side.finished_saves({"r1"}) == {"r1"}, "vLLM gets its blocks back"
    assert side.hpkv.client is None, "the connection is dropped: the next use reconnects"
    assert side.stats.data["save_failed_blocks"] == 1


def test_a_save_made_before_a_reconnect_is_not_polled_on_the_new_link():
    store, mover = MemoryKvStore(slot_bytes=LAYOUT.shard_bytes), HandAnsweredWorkers()
    side = side_with(store, mover)
    meta, _ = save_step(store, "r1", ["a"])
    side.wait_for_save(meta)
    fresh = HandAnsweredWorkers()
    side._device = fresh  # type: ignore[assignment]  # as a reconnect's open_store leaves it
    assert side.finished_saves({"r1"}) == {"r1"} and side.stats.data["save_failed_blocks"] == 1
    assert not fresh.waited, "nothing asked of the new link for the old save"


def test_a_disabled_worker_still_frees_requests_the_scheduler_saved():
    store, mover = MemoryKvStore(slot_bytes=LAYOUT.shard_bytes), HandAnsweredWorkers()
    side = side_with(store, mover)
    side.enabled = False
    meta, _ = save_step(store, "r1", ["a"])
    side.wait_for_save(meta)
    assert not mover.open
    assert side.finished_saves({"r1"}) == {"r1"}, "the scheduler delayed its free: it must hear back"

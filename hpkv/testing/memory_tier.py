"""An in-memory tier below the pool (:class:`hpkv.engine.tiers.LowerTier`) with fault
injection, for unit tests of the logic above a tier in milliseconds: no worker processes,
no files.

Its medium is a dict (``medium``: key → the bytes of each rank's shard); what it believes
it holds is a :class:`~hpkv.engine.storage.catalog.FileCatalog`, as in the file tier, so the
index sees the same identity and hits. Spills and promotes finish on a later :meth:`poll`,
never at once, like IO. Faults:

* ``delay_polls``: polls a job waits before it finishes (slow answers);
* ``fail_spills`` / ``fail_promotes``: keys whose spill / promote fails;
* :meth:`lose`: a block's data vanishes underneath (files deleted from outside): a lookup
  that checks it, or a promote of it, misses, and the tier forgets it;
* ``presence_polls``: a slow medium for lookups (a stat on a slow mount). A lookup that must
  ask the medium about a key nobody knows starts a check that ends after this many polls
  (None: never, a hung mount), and parks the call for at most ``lookup_wait`` seconds; at
  most ``max_checks`` checks run at once (beyond: saturated, the lookup answers at once).
  0 (the default) answers at once, as before.

With ``pool`` (a byte array the size of the index's pool) the data really moves: a spill
copies the slots out, a promote copies them back in.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpkv.engine.index import Block, Index, Namespace
from hpkv.engine.storage.catalog import FileCatalog
from hpkv.engine.tiers import (
    CatalogTier,
    Client,
    ParkedLookup,
    ParkedPromote,
    Presence,
    PromoteAnswer,
    settle_waiters,
)
from hpkv.protocol.stats import NsCounter
from hpkv.protocol.wire import Tier


@dataclass
class _Job:
    spill: bool
    block: Block
    polls_left: int
    waiters: list[tuple[ParkedPromote, int]] = field(default_factory=list)


@dataclass
class _Check:
    """A lookup's question to the slow medium: are these keys there? (answered in order)"""

    ns: Namespace
    keys: list[bytes]
    polls_left: int | None  # None: never ends (a hung medium)
    waiters: list[ParkedLookup] = field(default_factory=list)


class MemoryTier(CatalogTier):
    name = "storage"
    degraded = False

    def __init__(
        self, index: Index, pool: np.ndarray | None = None, delay_polls: int = 1, tier: int = Tier.STORAGE
    ):
        self.index = index
        self.pool = pool
        self.tier = tier  # its hits' wire tier (Tier.REMOTE: a second tier, below the files)
        self.catalog = FileCatalog(index, tier)
        self.medium: dict[bytes, list[bytes]] = {}
        self.delay_polls = delay_polls
        self.fail_spills: set[bytes] = set()
        self.fail_promotes: set[bytes] = set()
        self.attached: set[int] = set()
        self.presence_polls: int | None = 0
        self.lookup_wait = 0.005
        self.max_checks = 4
        self.saturated = 0  # lookups answered at once because max_checks were running
        self._checks: list[_Check] = []
        self._jobs: list[_Job] = []
        self._promoting: dict[bytes, _Job] = {}
        self._calls: list[ParkedPromote] = []
        self._answers: list[PromoteAnswer] = []
        self._dirty = False

    # ------------------------------------------------------------ faults and set-up
    def lose(self, key: bytes) -> None:
        """The block's data is gone underneath; the tier does not know yet."""
        self.medium.pop(key, None)

    def put(self, ns: Namespace, key: bytes, shards: list[bytes] | None = None) -> None:
        """Data written by someone else (another server): found by a lookup, not known yet."""
        self.medium[key] = shards if shards is not None else [b""] * ns.world_size

    # ------------------------------------------------------------ the contract
    def lookup(
        self,
        ns: Namespace,
        keys: list[bytes],
        hit: int,
        tiers: list[int],
        call: ParkedLookup | None = None,
    ) -> Presence:
        if self.presence_polls != 0:
            return self._slow_lookup(ns, keys, hit, call)
        for i in range(hit):
            if tiers[i] == self.tier and keys[i] not in self.medium and keys[i] not in self._promoting:
                self.catalog.forget(keys[i])
                del tiers[i:]
                hit = i
                break
        while hit < len(keys) and self._learn(ns, keys[hit]):
            more, more_tiers = self.index.lookup(ns.ns_id, keys[hit:])
            if not more:
                break
            tiers.extend(more_tiers)
            hit += more
        return Presence(hit)

    def _slow_lookup(self, ns: Namespace, keys: list[bytes], hit: int, call: ParkedLookup | None) -> Presence:
        """A slow medium: what is known stands; the keys after it are asked about off the
        request loop (found ones join the catalog, so the index has them when the call is
        answered). Deletions underneath are found by promotes only in this mode."""
        if hit >= len(keys) or not self.catalog.unknown(keys[hit]):
            return Presence(hit)
        running = next((c for c in self._checks if keys[hit] in c.keys), None)
        if running is None:
            if len(self._checks) >= self.max_checks:
                self.saturated += 1
                return Presence(hit)
            running = _Check(ns, [k for k in keys[hit:] if self.catalog.unknown(k)], self.presence_polls)
            self._checks.append(running)
        if call is None:
            return Presence(hit, True)  # unconfirmed: still being asked
        running.waiters.append(call)
        call.outstanding += 1
        call.deadline = max(call.deadline, time.monotonic() + self.lookup_wait)
        return Presence(hit, True)

    def _poll_checks(self) -> None:
        left = []
        for check in self._checks:
            if check.polls_left is not None:
                check.polls_left -= 1
            if check.polls_left is None or check.polls_left > 0:
                left.append(check)
                continue
            for k in check.keys:
                if not self._learn(check.ns, k) and k not in self.catalog:
                    break
            for call in check.waiters:
                call.outstanding -= 1
        self._checks = left

    def _learn(self, ns: Namespace, key: bytes) -> bool:
        return self.catalog.unknown(key) and key in self.medium and self.catalog.add(ns, key)

    def promote(
        self, client: Client, seq: int, ns: Namespace, keys: list[bytes], timeout: float
    ) -> np.ndarray | None:
        rows = np.full((len(keys), ns.world_size), -1, np.int64)
        call = ParkedPromote(client, seq, ns, keys, rows, time.monotonic() + timeout)
        dram = 0
        for i, k in enumerate(keys):
            slots = self.index.pin(ns, [k], owner=client.cid)[0]
            running = self._promoting.get(k)
            if slots is not None:
                rows[i] = slots
                dram += 1
                self.catalog.touch(k)
            elif running is not None:
                if running.block.ns is ns:
                    running.waiters.append((call, i))
                    call.outstanding += 1
            elif self.catalog.owner(k) is ns or self._learn(ns, k):
                b = self.index.begin_promote(ns, k)
                if b is None:
                    continue
                job = _Job(False, b, self.delay_polls, [(call, i)])
                self._promoting[k] = job
                self._jobs.append(job)
                call.outstanding += 1
        ns.counters[NsCounter.LOADS_DRAM] += dram
        if call.outstanding == 0:
            return rows
        self._calls.append(call)
        return None

    def spill(self, blocks: Iterable[Block]) -> None:
        for b in blocks:
            if b.key in self.catalog:
                self.catalog.touch(b.key)
                continue
            self.index.spill_started(b)
            self._jobs.append(_Job(True, b, self.delay_polls))

    def touch(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            self.catalog.touch(k)

    def pending_spills(self) -> int:
        return sum(j.spill for j in self._jobs)

    def poll(self) -> list[PromoteAnswer]:
        self._poll_checks()
        due = []
        for job in self._jobs:
            job.polls_left -= 1
            if job.polls_left <= 0:
                due.append(job)
        self._jobs = [j for j in self._jobs if j.polls_left > 0]
        for job in due:
            (self._finish_spill if job.spill else self._finish_promote)(job)
        now = time.monotonic()
        for call in self._calls:
            if not call.done and now >= call.deadline:
                call.finish(self._answers)
        self._calls = [c for c in self._calls if not c.done]
        answers, self._answers = self._answers, []
        return answers

    def client_gone(self, client: Client) -> None:
        for call in self._calls:
            if call.client is client:
                call.done = True
        self._calls = [c for c in self._calls if not c.done]

    def attach(self, ns: Namespace) -> None:
        self.attached.add(ns.ns_id)

    def detach(self, ns: Namespace) -> None:
        self.attached.discard(ns.ns_id)
        self.catalog.detach(ns)

    def worker_died(self, worker: Any) -> bool:
        return False

    def take_catalog_dirty(self) -> bool:
        dirty, self._dirty = self._dirty, False
        return dirty

    def describe(self) -> dict[str, Any]:
        return {"path": "memory", "blocks": len(self.catalog)}

    def shutdown(self) -> None:
        self._jobs.clear()

    # ------------------------------------------------------------ endings
    def _finish_spill(self, job: _Job) -> None:
        b = job.block
        self.index.set_io(b, -1)
        if b.key in self.fail_spills:
            self.index.skip_spill(b)  # evictable without a copy below
            return
        self.medium[b.key] = self._read_slots(b)
        self.catalog.add(b.ns, b.key)

    def _finish_promote(self, job: _Job) -> None:
        b = job.block
        key = b.key
        self._promoting.pop(key, None)
        data = self.medium.get(key)
        ok = data is not None and key not in self.fail_promotes
        if ok:
            assert data is not None
            self._write_slots(b, data)
        self.index.finish_promote(key, ok)
        if ok:
            self.catalog.touch(key)
        elif data is None:
            self.catalog.forget(key)  # lost underneath: no hit any more
        counter = NsCounter.LOADS_STORAGE if self.tier == Tier.STORAGE else NsCounter.LOADS_REMOTE
        settle_waiters(self.index, b, ok, job.waiters, self._answers, counter)

    def _read_slots(self, b: Block) -> list[bytes]:
        if self.pool is None or b.slots is None:
            return [b""] * b.ns.world_size
        n = b.ns.shard_bytes
        return [self.pool[off : off + n].tobytes() for off in b.slots]

    def _write_slots(self, b: Block, data: list[bytes]) -> None:
        if self.pool is None or b.slots is None:
            return
        for off, shard in zip(b.slots, data, strict=True):
            self.pool[off : off + len(shard)] = np.frombuffer(shard, np.uint8)

"""An in-memory :class:`~hpkv.client.contract.KvStore` with the server's semantics, for fast
unit tests of connector bookkeeping (no server, no rings, no engine).

It follows the index's rules: a reservation is written once per rank and becomes a DRAM
block when every rank committed; pinned blocks are not evicted; ``clear`` drops a
namespace's DRAM copies and keeps what storage holds; a promote moves a storage block back
into DRAM, pinned for the caller. ``fail`` makes the named calls raise
:class:`~hpkv.protocol.errors.HpkvUnavailable`, as a dead server would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hpkv.client.contract import Events, Probe
from hpkv.protocol.errors import ROW_MISSING, ROW_POOL_FULL, ROW_PRESENT, HpkvUnavailable, NotOwner
from hpkv.protocol.events import REMOVED
from hpkv.protocol.wire import Tier


@dataclass
class _Block:
    offset: int
    committed: set[int] = field(default_factory=set)
    in_dram: bool = False
    stored: bool = False
    pins: int = 0


class MemoryKvStore:
    def __init__(
        self,
        world_size: int = 1,
        slot_bytes: int = 4096,
        capacity_blocks: int = 1 << 20,
        write_through: bool = True,
    ):
        self.server_pid = 0
        self.world = world_size
        self.slot_bytes = slot_bytes
        self.capacity = capacity_blocks
        self.write_through = write_through  # committed blocks are also "on storage"
        self.blocks: dict[tuple[int, bytes], _Block] = {}
        self.fail: set[str] = set()
        self.checking: dict[bytes, int] = {}  # key -> probes that still find it unconfirmed
        self.calls: list[str] = []
        self.time_saved: dict[tuple[int, str], list[int]] = {}  # (ns, tier) -> [tokens, prefill µs, load µs]
        self.closed = False
        self._next_offset = 0
        self.log: list[tuple[int, bytes, int]] = []  # (ns id, key, code) once events are watched
        self.watched: set[int] = set()

    def _event(self, ns_id: int, key: bytes, code: int) -> None:
        if ns_id in self.watched:
            self.log.append((ns_id, key, code))

    def evict(self, ns_id: int, key: bytes, tier: Tier) -> None:
        """The block left ``tier`` (as the server's LRU or storage capacity would drop it)."""
        b = self.blocks[(ns_id, key)]
        if tier == Tier.DRAM:
            b.in_dram = False
        else:
            b.stored = False
        self._event(ns_id, key, int(tier) | REMOVED)
        if not (b.in_dram or b.stored):
            del self.blocks[(ns_id, key)]

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail or self.closed:
            raise HpkvUnavailable(f"the in-memory hpkv store refuses {name!r}")

    def _rows(self, n: int) -> np.ndarray:
        return np.full((n, self.world), ROW_MISSING, np.int64)

    def _row(self, b: _Block) -> np.ndarray:
        return b.offset + np.arange(self.world, dtype=np.int64) * self.slot_bytes

    def _dram_blocks(self) -> int:
        return sum(1 for b in self.blocks.values() if b.in_dram or len(b.committed) < self.world)

    # ---------------------------------------------------------------- KvStore
    def lookup(self, ns_id: int, keys: Sequence[bytes]) -> tuple[int, list[int]]:
        self._call("lookup")
        tiers: list[int] = []
        for k in keys:
            b = self.blocks.get((ns_id, k))
            if b is None or not (b.in_dram or b.stored):
                break
            tiers.append(Tier.DRAM if b.in_dram else Tier.STORAGE)
        return len(tiers), tiers

    def probe(self, ns_id: int, keys: Sequence[bytes]) -> Probe:
        """A lookup whose prefix ends at a key of ``checking`` (still being checked, for that
        many more probes): unconfirmed."""
        hit, tiers = self.lookup(ns_id, keys)
        for i, k in enumerate(keys[: hit + 1]):
            if self.checking.get(k, 0) > 0:
                self.checking[k] -= 1
                return Probe(i, tiers[:i], True)
        return Probe(hit, tiers, False)

    def probe_each(self, ns_id: int, keys: Sequence[bytes]) -> Probe:
        """Every key's tier (0: missing); a key of ``checking`` is missing and unconfirmed."""
        self._call("lookup")
        tiers: list[int] = []
        unconfirmed = False
        for k in keys:
            b = self.blocks.get((ns_id, k))
            if self.checking.get(k, 0) > 0:
                self.checking[k] -= 1
                unconfirmed = True
                tiers.append(Tier.MISS)
            elif b is None or not (b.in_dram or b.stored):
                tiers.append(Tier.MISS)
            else:
                tiers.append(Tier.DRAM if b.in_dram else Tier.STORAGE)
        hit = next((i for i, t in enumerate(tiers) if t == Tier.MISS), len(tiers))
        return Probe(hit, tiers, unconfirmed)

    def reserve(self, ns_id: int, keys: Sequence[bytes]) -> np.ndarray:
        self._call("reserve")
        rows = self._rows(len(keys))
        for i, k in enumerate(keys):
            if (ns_id, k) in self.blocks:
                rows[i] = ROW_PRESENT
            elif self._dram_blocks() >= self.capacity:
                rows[i] = ROW_POOL_FULL
            else:
                b = self.blocks[(ns_id, k)] = _Block(self._next_offset)
                self._next_offset += self.world * self.slot_bytes
                rows[i] = self._row(b)
        return rows

    def commit(self, ns_id: int, keys: Sequence[bytes], rank: int = 0) -> int:
        self._call("commit")
        ready = 0
        for k in keys:
            b = self.blocks.get((ns_id, k))
            if b is None or b.in_dram:
                raise NotOwner(f"key {k.hex()} is not reserved")
            b.committed.add(rank)
            if len(b.committed) == self.world:
                b.in_dram = True
                b.stored = self.write_through
                ready += 1
                self._event(ns_id, k, Tier.DRAM)
                if b.stored:
                    self._event(ns_id, k, Tier.STORAGE)
        return ready

    def abort(self, ns_id: int, keys: Sequence[bytes]) -> None:
        self._call("abort")
        for k in keys:
            b = self.blocks.get((ns_id, k))
            if b is not None and not b.in_dram:
                del self.blocks[(ns_id, k)]

    def pin(self, ns_id: int, keys: Sequence[bytes]) -> np.ndarray:
        self._call("pin")
        rows = self._rows(len(keys))
        for i, k in enumerate(keys):
            b = self.blocks.get((ns_id, k))
            if b is not None and b.in_dram:
                b.pins += 1
                rows[i] = self._row(b)
        return rows

    def promote(self, ns_id: int, keys: Sequence[bytes], timeout: float | None = None) -> np.ndarray:
        self._call("promote")
        rows = self._rows(len(keys))
        for i, k in enumerate(keys):
            b = self.blocks.get((ns_id, k))
            if b is not None and (b.in_dram or b.stored):
                if not b.in_dram:
                    self._event(ns_id, k, Tier.DRAM)
                b.in_dram = True
                b.pins += 1
                rows[i] = self._row(b)
        return rows

    def unpin(self, ns_id: int, keys: Sequence[bytes]) -> None:
        self._call("unpin")
        for k in keys:
            b = self.blocks.get((ns_id, k))
            if b is not None and b.pins > 0:
                b.pins -= 1

    def clear(self, ns_id: int) -> int:
        self._call("clear")
        dropped = 0
        for (ns, k), b in list(self.blocks.items()):
            if ns == ns_id and b.in_dram:
                b.in_dram = False
                dropped += 1
                self._event(ns, k, Tier.DRAM | REMOVED)
                if not b.stored:
                    del self.blocks[(ns, k)]
        return dropped

    def events(self, ns_id: int, since: int, limit: int = 8192) -> Events:
        self._call("events")
        self.watched.add(ns_id)
        if since < 0:
            return Events([], len(self.log), 0, False)
        mine = [(k, c) for n, k, c in self.log[since : since + limit] if n == ns_id]
        end = min(len(self.log), since + limit)
        return Events(mine, end, 0, end < len(self.log))

    def report_time_saved(self, ns_id: int, tiers: dict[str, tuple[int, int, int]]) -> None:
        self._call("report_time_saved")
        for tier, values in tiers.items():
            now = self.time_saved.setdefault((ns_id, tier), [0, 0, 0])
            for i, v in enumerate(values):
                now[i] += v

    def close(self) -> None:
        self.closed = True

    # ---------------------------------------------------------------- for assertions
    def pinned(self) -> int:
        return sum(b.pins for b in self.blocks.values())

    def ready(self, ns_id: int) -> int:
        return sum(1 for (ns, _), b in self.blocks.items() if ns == ns_id and b.in_dram)

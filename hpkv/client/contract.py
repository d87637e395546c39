"""The typed contract of the hpkv client's hot calls.

Connectors depend on these protocols, not on :class:`~hpkv.client.client.HpkvClient`, so
their bookkeeping can be unit-tested against an in-memory implementation
(:mod:`hpkv.testing.memory_store`) in milliseconds, beside the end-to-end tests with real
engines. Every call raises :class:`~hpkv.protocol.errors.HpkvError` on failure
(:class:`~hpkv.protocol.errors.HpkvUnavailable` when the server is gone or slow): the caller
recomputes.

Per-row answers are pool slot values ``[len(keys), world]`` with the sentinels of
:mod:`hpkv.protocol.errors` (``ROW_PRESENT``, ``ROW_POOL_FULL``, ``ROW_MISSING``): a byte
offset, and for a reserve the slot's generation above it (``hpkv.protocol.wire.slot_offset``
gives the offset; copy jobs take the value as it is)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np


class Probe(NamedTuple):
    """A lookup's answer: ``hit`` leading keys present, the tier of each (1 DRAM, 2 storage),
    and whether the key after them is still being checked on storage."""

    hit: int
    tiers: list[int]
    unconfirmed: bool


class Events(NamedTuple):
    """An ``events`` call's answer: (key, code) records (:mod:`hpkv.protocol.events`), the seq to
    ask from next time, how many records before them the server's log no longer had, and
    whether more are waiting."""

    records: list[tuple[bytes, int]]
    seq: int
    lost: int
    more: bool


class KvStore(Protocol):
    """The hot calls of one client of the hpkv server (one namespace id per model layout)."""

    server_pid: int

    def lookup(self, ns_id: int, keys: Sequence[bytes]) -> tuple[int, list[int]]:
        """(number of leading keys present, the :class:`~hpkv.protocol.wire.Tier` of each)."""
        ...

    def probe(self, ns_id: int, keys: Sequence[bytes]) -> Probe:
        """A lookup that also says whether the key after the prefix is still being checked
        on storage (its bound ended first): an engine that can wait asks again later."""
        ...

    def probe_each(self, ns_id: int, keys: Sequence[bytes]) -> Probe:
        """A lookup that answers every key: ``tiers`` has one entry a key, 0 where missing;
        ``hit`` the leading keys present; ``unconfirmed``: some key is still being checked."""
        ...

    def reserve(self, ns_id: int, keys: Sequence[bytes]) -> np.ndarray:
        """Pool slots to write new blocks into; ROW_PRESENT / ROW_POOL_FULL rows need no write."""
        ...

    def commit(self, ns_id: int, keys: Sequence[bytes], rank: int = 0) -> int:
        """This rank's shards of reserved blocks are written; returns blocks that became ready."""
        ...

    def abort(self, ns_id: int, keys: Sequence[bytes]) -> None:
        """Drop reservations whose shards could not be written."""
        ...

    def pin(self, ns_id: int, keys: Sequence[bytes]) -> np.ndarray:
        """Keep DRAM blocks from eviction while they are loaded; ROW_MISSING where not in DRAM."""
        ...

    def promote(self, ns_id: int, keys: Sequence[bytes], timeout: float | None = None) -> np.ndarray:
        """Read storage blocks into the pool, pinned for the caller; ROW_MISSING where it failed."""
        ...

    def unpin(self, ns_id: int, keys: Sequence[bytes]) -> None: ...

    def clear(self, ns_id: int) -> int:
        """Drop the namespace from the DRAM tier (files stay); returns the blocks dropped."""
        ...

    def events(self, ns_id: int, since: int, limit: int = 8192) -> Events:
        """The namespace's tier changes (blocks stored in or removed from DRAM and storage) from
        seq ``since`` on; ``since`` -1 starts watching (the server logs a namespace's changes
        only once asked) and answers no records, only the seq to ask from."""
        ...

    def report_time_saved(self, ns_id: int, tiers: dict[str, tuple[int, int, int]]) -> None:
        """Add ``{"dram" | "storage": (tokens loaded, prefill µs saved, load µs)}`` to the
        namespace's prefill-time-saved counters (``hpkv status``, hpkv-top, Prometheus)."""
        ...

    def close(self) -> None: ...


class BlockMover(Protocol):
    """Copies between an engine's KV cache blocks and pool slots (a device's transfer workers)."""

    def save(self, blocks: np.ndarray, offsets: np.ndarray) -> bool:
        """KV cache blocks → pool byte offsets; True once every copy completed."""
        ...

    def load(self, blocks: np.ndarray, offsets: np.ndarray) -> bool:
        """Pool byte offsets → KV cache blocks; True once every copy completed."""
        ...

"""The contract of a tier below the DRAM pool, and the list of them the server drives.

A tier keeps KV blocks the pool has no room for (files on a local disk today:
:class:`hpkv.engine.storage.tier.FileTier`; an in-memory one for tests:
:class:`hpkv.testing.memory_tier.MemoryTier`). It runs in the server under the server's
lock, and it never calls the server back: work that ends later (a promote waiting for
IO) is *returned* by :meth:`LowerTier.poll` as values, and the server answers the
parked calls and takes their clients again itself.

The pool's index (:class:`hpkv.engine.index.Index`) owns slots, pins and reservations; a
tier owns which keys it holds and tells the index through its public methods
(``files_added`` / ``files_gone``, ``begin_promote`` / ``finish_promote``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from hpkv.engine.index import Block, Namespace


class Client(Protocol):
    """What a tier needs of the server's record of a connected client."""

    cid: int
    alive: bool


@dataclass
class ParkedPromote:
    """A client's PROMOTE waiting for a tier's work; answered once, when done or at its deadline.
    ``rows`` holds the pinned pool offsets per key and rank, -1 where not (yet) loaded."""

    client: Client
    seq: int
    ns: Namespace
    keys: list[bytes]
    rows: np.ndarray
    deadline: float
    outstanding: int = 0
    done: bool = False


class PromoteAnswer(NamedTuple):
    """A parked promote's answer (:meth:`LowerTier.poll`): the server writes ``rows`` into the
    client's mailbox, completes call ``seq`` and takes the client's next calls again."""

    client: Any  # the server's Client record, as the call brought it
    seq: int
    rows: np.ndarray


class Presence(NamedTuple):
    """A lookup's prefix as a tier knows it now. ``pending``: the tier is still finding out
    about the next keys (a later :meth:`LowerTier.poll` knows more), so a caller that can
    wait may park the lookup and ask again; a tier that answers at once says False."""

    hit: int
    pending: bool = False


class LowerTier(Protocol):
    """A tier below the DRAM pool. Every method runs under the server's lock on the request
    loop, except where it says otherwise; none blocks on the tier's IO."""

    name: str  # the stats snapshot's section ("storage")

    def lookup(self, ns: Namespace, keys: list[bytes], hit: int, tiers: list[int]) -> Presence:
        """Check and continue a lookup's prefix: ``keys[:hit]`` were found (their wire tiers in
        ``tiers``); cut it at the first hit of this tier that is gone, extend it with keys this
        tier holds. ``tiers`` is cut and extended in place. No side effect on recency."""
        ...

    def promote(
        self, client: Client, seq: int, ns: Namespace, keys: list[bytes], timeout: float
    ) -> np.ndarray | None:
        """A PROMOTE: pin each key's pool slots for ``client``, reading into fresh slots the
        keys the tier holds. Returns the rows now (``int64 [len(keys), world]``, -1: missing),
        or None when the call is parked: its answer comes from :meth:`poll`, by ``timeout``."""
        ...

    def spill(self, blocks: Iterable[Block]) -> None:
        """Write-through of blocks that just became READY (their slots stay unevictable while
        the tier reads them)."""
        ...

    def touch(self, keys: Iterable[bytes]) -> None:
        """The blocks were used (pinned for loading): the tier's copies are recent too."""
        ...

    def pending_spills(self) -> int:
        """Blocks whose spill is queued or running (what a stop drains first)."""
        ...

    def poll(self) -> list[PromoteAnswer]:
        """Take finished work: answers of parked promotes (done, failed or past their deadline).
        Called by the request loop without the lock held (the tier takes it)."""
        ...

    def client_gone(self, client: Client) -> None:
        """Forget a dropped client's parked call: it gets no answer (its pins are released by
        the server)."""
        ...

    def attach(self, ns: Namespace) -> None:
        """A namespace was attached: start learning what the tier holds of it."""
        ...

    def detach(self, ns: Namespace) -> None:
        """The server released ``ns`` (the index dropped it; its id will be reused): forget it."""
        ...

    def worker_died(self, worker: Any) -> bool:
        """Supervisor: a worker process exited; True if it is one of this tier's (the tier
        recovers its jobs and restarts it on the request loop)."""
        ...

    def take_catalog_dirty(self) -> bool:
        """Whether what :meth:`describe` says changed since the last call."""
        ...

    def describe(self) -> dict[str, Any]:
        """The strings of the stats snapshot's section (the numbers are in the stats segment)."""
        ...

    def shutdown(self) -> None:
        """Stop the tier's threads and close its rings (the server stopped its workers)."""
        ...


class TierList:
    """The tiers below the pool in priority order, driven as one by the server.

    A lookup asks each tier in turn to check and extend the prefix. Write-through and
    promotes go to the first tier (the only one today); routing them by where each key
    lives is for the issue that adds a second tier. Empty when storage is off."""

    def __init__(self, tiers: Iterable[LowerTier] = ()):
        self.tiers = list(tiers)

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def lookup(self, ns: Namespace, keys: list[bytes], hit: int, tiers: list[int]) -> Presence:
        pending = False
        for t in self.tiers:
            hit, more = t.lookup(ns, keys, hit, tiers)
            pending |= more
        return Presence(hit, pending)

    def promote(
        self, client: Client, seq: int, ns: Namespace, keys: list[bytes], timeout: float
    ) -> np.ndarray | None:
        return self.tiers[0].promote(client, seq, ns, keys, timeout)

    def spill(self, blocks: list[Block]) -> None:
        if self.tiers:
            self.tiers[0].spill(blocks)

    def touch(self, keys: list[bytes]) -> None:
        for t in self.tiers:
            t.touch(keys)

    def pending_spills(self) -> int:
        return sum(t.pending_spills() for t in self.tiers)

    def poll(self) -> list[PromoteAnswer]:
        answers: list[PromoteAnswer] = []
        for t in self.tiers:
            answers += t.poll()
        return answers

    def client_gone(self, client: Client) -> None:
        for t in self.tiers:
            t.client_gone(client)

    def attach(self, ns: Namespace) -> None:
        for t in self.tiers:
            t.attach(ns)

    def detach(self, ns: Namespace) -> None:
        for t in self.tiers:
            t.detach(ns)

    def worker_died(self, worker: Any) -> bool:
        return any(t.worker_died(worker) for t in self.tiers)

    def take_catalog_dirty(self) -> bool:
        return any([t.take_catalog_dirty() for t in self.tiers])  # a list: every tier's flag is taken

    def describe(self) -> dict[str, Any]:
        """The stats snapshot's ``storage`` section (``{"path": None}`` when there is no tier)."""
        return self.tiers[0].describe() if self.tiers else {"path": None}

    def shutdown(self) -> None:
        for t in self.tiers:
            t.shutdown()

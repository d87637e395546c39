"""The contract of a tier below the DRAM pool, and the list of them the server drives.

A tier keeps KV blocks the pool has no room for (files on a local disk:
:class:`hpkv.engine.storage.tier.FileTier`; a store shared by several nodes:
:class:`hpkv.engine.remote.RemoteTier`; an in-memory one for tests:
:class:`hpkv.testing.memory_tier.MemoryTier`). It runs in the server under the server's
lock, and it never calls the server back: work that ends later (a promote waiting for
IO, a lookup waiting for a stat) is *returned* by :meth:`LowerTier.poll` as values, and the
server answers the parked calls and takes their clients again itself.

A tier never makes the request loop wait on its medium: a lookup that needs to ask it
(files another server wrote or deleted) is parked with a short bound
(``HPKV_STORAGE_LOOKUP_WAIT_MS`` for the file tier) and answered from what is known then.

The pool's index (:class:`hpkv.engine.index.Index`) owns slots, pins and reservations; a
tier owns which keys it holds and tells the index through its public methods
(``files_added`` / ``files_gone``, ``begin_promote`` / ``finish_promote``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from hpkv.engine.index import Block, Index, Namespace
from hpkv.protocol.stats import NsCounter

if TYPE_CHECKING:
    from hpkv.engine.storage.catalog import FileCatalog


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

    def finish(self, answers: list[PromoteAnswer]) -> None:
        """Answer the call once (with what ``rows`` holds now), unless its client is gone."""
        self.done = True
        if self.client.alive:
            answers.append(PromoteAnswer(self.client, self.seq, self.rows))


def settle_waiters(
    index: Index,
    b: Block,
    ok: bool,
    waiters: list[tuple[ParkedPromote, int]],
    answers: list[PromoteAnswer],
    counter: int = NsCounter.LOADS_STORAGE,
) -> None:
    """A promote of ``b`` ended: pin it for every call still waiting (``(call, row)``), answer
    the calls that waited for nothing else, and count the blocks loaded (in ``counter``, the
    tier's loads)."""
    loaded = 0
    for call, row in waiters:
        if ok and not call.done and call.client.alive:
            call.rows[row] = index.pin(b.ns, [b.key], owner=call.client.cid)[0]
            loaded += 1
        call.outstanding -= 1
        if call.outstanding == 0 and not call.done:
            call.finish(answers)
    b.ns.counters[counter] += loaded


@dataclass
class ParkedLookup:
    """A client's LOOKUP waiting for tiers to check keys with their medium; answered once, when
    ``outstanding`` drops to 0 or at ``deadline``: what is not confirmed by then is a miss for
    this lookup. ``n`` keys are still in the client's mailbox (it waits for this answer)."""

    client: Client
    seq: int
    ns: Namespace
    n: int
    deadline: float
    outstanding: int = 0
    done: bool = False
    each: bool = False  # a FLAG_EACH lookup: every key answered


class LookupAnswer(NamedTuple):
    """A parked lookup's turn to be answered (:meth:`TierList.poll`): the server runs the
    lookup again, without parking, and answers it as any lookup."""

    client: Any  # the server's Client record, as the call brought it
    seq: int
    ns: Namespace
    n: int
    each: bool = False


class PromoteAnswer(NamedTuple):
    """A parked promote's answer (:meth:`LowerTier.poll`): the server writes ``rows`` into the
    client's mailbox, completes call ``seq`` and takes the client's next calls again."""

    client: Any  # the server's Client record, as the call brought it
    seq: int
    rows: np.ndarray


class Presence(NamedTuple):
    """A lookup's prefix as a tier knows it now. ``pending``: the tier is still finding out
    about the next keys (a later :meth:`LowerTier.poll` knows more). With a call to park, the
    call is parked and asked again; without one (a parked call answered at its bound), the
    answer says so, and the engine may ask again later instead of taking the miss for good."""

    hit: int
    pending: bool = False


class LowerTier(Protocol):
    """A tier below the DRAM pool. Every method runs under the server's lock on the request
    loop, except where it says otherwise; none blocks on the tier's IO."""

    name: str  # the stats snapshot's section ("storage")

    def holds(self, ns: Namespace, key: bytes) -> bool:
        """The tier has ``ns``'s ``key`` (its catalog knows the copy) or is reading it into the
        pool now: a promote of it is this tier's (:class:`TierList` routes it here)."""
        ...

    def lookup(
        self,
        ns: Namespace,
        keys: list[bytes],
        hit: int,
        tiers: list[int],
        call: ParkedLookup | None = None,
    ) -> Presence:
        """Check and continue a lookup's prefix: ``keys[:hit]`` were found (their wire tiers in
        ``tiers``); cut it at the first hit of this tier that is gone, extend it with keys this
        tier holds. ``tiers`` is cut and extended in place. No side effect on recency.

        Never waits on the medium. When the answer needs it (a key nobody knows, a hit not
        checked lately) and ``call`` is given, the tier starts the checks, adds them to
        ``call.outstanding`` (taking them off in :meth:`poll` as they end), moves
        ``call.deadline`` to its bound at the latest, and says ``pending`` (``hit`` and
        ``tiers`` may then be left as they came). Without ``call`` (the answer of a parked
        lookup) or when it cannot start them (its checks are saturated) it answers from what
        it knows now: a key not confirmed is a miss for this lookup (not forgotten); without
        ``call`` it says ``pending`` when the key after its prefix is still being checked."""
        ...

    def learning(self, ns: Namespace) -> bool:
        """The tier is still learning what it holds of ``ns`` (its journals read after a
        restart): a key it does not know yet may be one it holds."""
        ...

    def discover(self, ns: Namespace, keys: list[bytes], call: ParkedLookup | None = None) -> bool:
        """Keys a FLAG_EACH lookup found nowhere past its leading prefix: while the tier is
        still learning what it holds of ``ns`` (after a restart), check them as
        :meth:`lookup` checks unknown keys after the prefix. True while a check is
        outstanding (``call`` parked on it as :meth:`lookup` parks it); False at once when the
        tier knows all it holds."""
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
        """Take finished work: answers of parked promotes (done, failed or past their deadline),
        and the results of lookup checks (the parked lookups' ``outstanding`` counts drop).
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

    @property
    def degraded(self) -> bool:
        """The medium answers late or not at all (a hung mount): nothing waits on it now."""
        ...

    def describe(self) -> dict[str, Any]:
        """The strings of the stats snapshot's section (the numbers are in the stats segment)."""
        ...

    def shutdown(self) -> None:
        """Stop the tier's threads and close its rings (the server stopped its workers)."""
        ...


class CatalogTier:
    """What every tier here shares: the keys it holds are its catalog's (``catalog``), and the
    reads of them into the pool that are running are ``_promoting`` (key -> the tier's op)."""

    catalog: FileCatalog
    _promoting: dict[bytes, Any]

    def holds(self, ns: Namespace, key: bytes) -> bool:
        """:meth:`LowerTier.holds`: the catalog has ``ns``'s ``key``, or a read of it runs."""
        return key in self._promoting or self.catalog.owner(key) is ns


class _Joint(NamedTuple):
    """A PROMOTE split over several tiers, some parked: the whole call's rows, and per tier
    still to answer the positions of its keys in the call."""

    rows: np.ndarray
    parts: dict[int, list[int]]


class TierList:
    """The tiers below the pool in priority order (HPKV_TIER_ORDER: files, then the remote
    store, by default), driven as one by the server.

    A lookup asks each tier in turn to check and extend the prefix; when a tier says it is
    still finding out (``pending``), the call is parked here (the tiers after it are asked
    too, so each starts its own checks of the keys after the prefix: files another server
    wrote, objects another node published), and :meth:`poll` returns its
    :class:`LookupAnswer` once no tier has checks of it outstanding or its deadline passed.
    Write-through goes to every tier (each decides whether it keeps a copy); a promote is
    routed key by key to the tier that holds the key (the first one in order: by default a file
    is read rather than a remote object), its parts answered as one call; a key no tier holds
    (a DRAM block, or one nobody knows) goes to tier ``fallback`` (the file tier, which pins
    DRAM blocks for its admission rules and stats unknown keys, wherever it is in the order).
    Empty when storage is off."""

    def __init__(self, tiers: Iterable[LowerTier] = (), fallback: int = 0):
        self.tiers = list(tiers)
        self.fallback = fallback
        self._lookups: list[ParkedLookup] = []
        self._joints: dict[tuple[int, int], _Joint] = {}  # (id(client), seq) -> its promote's parts

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def lookup(
        self,
        ns: Namespace,
        keys: list[bytes],
        hit: int,
        tiers: list[int],
        call: ParkedLookup | None = None,
    ) -> Presence:
        """Pending from any tier parks ``call`` (after every tier had its turn to start checks);
        without ``call`` it ends the answer there, pending (unconfirmed)."""
        parked = False
        for t in self.tiers:
            hit, pending = t.lookup(ns, keys, hit, tiers, call)
            if pending:
                if call is None:
                    return Presence(hit, True)
                parked = True
        if parked:
            assert call is not None
            self._park(call)
            return Presence(hit, True)
        return Presence(hit, False)

    def _park(self, call: ParkedLookup) -> None:
        """Answered by :meth:`poll` once its checks ended (a FLAG_EACH lookup parks once for
        all its runs)."""
        if not any(c is call for c in self._lookups):
            self._lookups.append(call)

    def learning(self, ns: Namespace) -> bool:
        return any(t.learning(ns) for t in self.tiers)

    def discover(self, ns: Namespace, keys: list[bytes], call: ParkedLookup | None = None) -> bool:
        """:meth:`LowerTier.discover` of every tier; a pending one parks ``call`` as
        :meth:`lookup` does."""
        pending = False
        for t in self.tiers:
            pending |= t.discover(ns, keys, call)
        if pending and call is not None:
            self._park(call)
        return pending

    def _route(self, ns: Namespace, key: bytes) -> int:
        """The tier a promote of ``key`` goes to: the first that holds it, else ``fallback`` (a
        DRAM block is pinned by any tier; the file tier may look for a key nobody knows)."""
        for i, t in enumerate(self.tiers):
            if t.holds(ns, key):
                return i
        return self.fallback

    def promote(
        self, client: Client, seq: int, ns: Namespace, keys: list[bytes], timeout: float
    ) -> np.ndarray | None:
        if len(self.tiers) == 1:
            return self.tiers[0].promote(client, seq, ns, keys, timeout)
        parts: dict[int, list[int]] = {}
        for i, k in enumerate(keys):
            parts.setdefault(self._route(ns, k), []).append(i)
        if len(parts) == 1:
            (only,) = parts
            return self.tiers[only].promote(client, seq, ns, keys, timeout)
        rows = np.full((len(keys), ns.world_size), -1, np.int64)
        parked: dict[int, list[int]] = {}
        for ti, pos in sorted(parts.items()):
            got = self.tiers[ti].promote(client, seq, ns, [keys[i] for i in pos], timeout)
            if got is None:
                parked[ti] = pos
            else:
                rows[pos] = got
        if not parked:
            return rows
        self._joints[(id(client), seq)] = _Joint(rows, parked)
        return None

    def spill(self, blocks: list[Block]) -> None:
        for t in self.tiers:
            t.spill(blocks)

    def touch(self, keys: list[bytes]) -> None:
        for t in self.tiers:
            t.touch(keys)

    def pending_spills(self) -> int:
        return sum(t.pending_spills() for t in self.tiers)

    def poll(self) -> list[PromoteAnswer | LookupAnswer]:
        answers: list[PromoteAnswer | LookupAnswer] = []
        for ti, t in enumerate(self.tiers):
            for a in t.poll():
                joint = self._joints.get((id(a.client), a.seq)) if self._joints else None
                pos = joint.parts.pop(ti, None) if joint is not None else None
                if joint is None or pos is None:
                    answers.append(a)
                    continue
                joint.rows[pos] = a.rows
                if not joint.parts:  # every part answered: the call's answer
                    del self._joints[(id(a.client), a.seq)]
                    answers.append(PromoteAnswer(a.client, a.seq, joint.rows))
        if self._lookups:
            now = time.monotonic()
            for call in self._lookups:
                if not call.done and (call.outstanding <= 0 or now >= call.deadline):
                    call.done = True
                    if call.client.alive:
                        answers.append(LookupAnswer(call.client, call.seq, call.ns, call.n, call.each))
            self._lookups = [call for call in self._lookups if not call.done]
        return answers

    def next_deadline(self) -> float | None:
        """The earliest deadline of a parked lookup (the request loop wakes by then)."""
        return min((c.deadline for c in self._lookups), default=None)

    def client_gone(self, client: Client) -> None:
        for k in [k for k in self._joints if k[0] == id(client)]:
            del self._joints[k]
        for call in self._lookups:
            if call.client is client:
                call.done = True
        self._lookups = [call for call in self._lookups if not call.done]
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

    @property
    def degraded(self) -> bool:
        """Every tier with spills pending is degraded: a stop waits for no spill that can end
        (the files' spills are waited for while the remote store is down, and the other way)."""
        busy = [t for t in self.tiers if t.pending_spills()]
        return bool(busy) and all(t.degraded for t in busy)

    def take_catalog_dirty(self) -> bool:
        return any([t.take_catalog_dirty() for t in self.tiers])  # a list: every tier's flag is taken

    def describe(self) -> dict[str, Any]:
        """The stats snapshot's ``storage`` section (``{"path": None}`` when there is no tier):
        each tier's strings, the ``fallback`` (file) tier's where two name the same, then the
        first tier's."""
        out: dict[str, Any] = {"path": None}
        for i in sorted(range(len(self.tiers)), key=lambda i: (i == self.fallback, -i)):
            out.update(self.tiers[i].describe())
        return out

    def shutdown(self) -> None:
        for t in self.tiers:
            t.shutdown()

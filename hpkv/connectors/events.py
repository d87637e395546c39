"""KV events for cache-aware routers, the engine-independent part: which of a namespace's blocks
entered or left hpkv's tiers, fetched from the hpkv server, and tracked per block so that a
router hears each change once.

* the server logs (key, tier, stored/removed) per namespace once asked
  (:mod:`hpkv.engine.events`), bounded;
* :class:`EventFeed` fetches the records in a background thread, at most every
  ``interval_s`` and only while the engine takes events, into a bounded queue: the request
  loop never waits on hpkv for events, and an hpkv failure only stops them;
* :class:`TierTracker` remembers, for the blocks this engine saved (or loaded), their key →
  the engine's view of the block (its hash, its parent's, its tokens), bounded, and turns the
  records into runs of blocks that changed tier; each engine's module builds its own events
  from the runs (:mod:`hpkv.connectors.vllm.events`, :mod:`hpkv.connectors.sglang.events`).

Records of keys the engine does not know (another engine's saves, blocks found on disk, or
forgotten by the bound) are skipped: a router learns those blocks from the engine that saved
them, or not at all (a missed hit, never a wrong one).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from hpkv.client.contract import KvStore
from hpkv.protocol.events import REMOVED
from hpkv.protocol.wire import Tier

log = logging.getLogger("hpkv.events")

MAX_BLOCKS = 1 << 16  # blocks whose hashes are remembered (≈ 300-600 B each with 16-32 tokens)
MAX_PENDING = 1 << 16  # fetched records not yet translated
INTERVAL_S = 0.1  # the feed asks the server at most this often
RETRY_S = 10.0  # after a failed fetch
SERVER_CHANGED = b""  # a queued marker: the records after it come from another server
TIERS = (int(Tier.DRAM), int(Tier.STORAGE))  # the tiers whose changes are published


class TrackedBlock(Protocol):
    """What the tracker needs of an engine's block: its hash, its parent's (None: the first
    block), its KV cache group, and the tiers it was announced in (bit ``t``: tier ``t``)."""

    hash: Any
    parent: Any
    group: int
    tiers: int


B = TypeVar("B", bound=TrackedBlock)


class TierTracker(Generic[B]):
    """key → the engine's block, and records → events. The engine's event thread only.

    Subclasses build the events: :meth:`stored` (a chain of blocks, each the parent of the
    next, that entered ``tier``), :meth:`removed` (blocks of one group that left ``tier``) and
    :meth:`all_cleared`."""

    def __init__(self, max_blocks: int = MAX_BLOCKS):
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[bytes, B] = OrderedDict()  # least recently saved/hit first
        self.unknown = 0  # records of keys not remembered (skipped)
        self.forgotten = 0  # blocks dropped by the bound

    def __len__(self) -> int:
        return len(self._blocks)

    # ------------------------------------------------------------------ for subclasses
    def stored(self, run: list[B], tier: int) -> Any:
        raise NotImplementedError

    def removed(self, run: list[B], tier: int) -> Any:
        raise NotImplementedError

    def all_cleared(self) -> Any:
        raise NotImplementedError

    # ------------------------------------------------------------------
    def known(self, key: bytes) -> bool:
        """Whether ``key`` is remembered; a remembered key's block is not captured again."""
        blocks = self._blocks
        if key in blocks:
            blocks.move_to_end(key)
            return True
        return False

    def add(self, key: bytes, block: B) -> None:
        """Remember ``key``'s block (the caller checked :meth:`known`)."""
        blocks = self._blocks
        blocks[key] = block
        if len(blocks) > self.max_blocks:
            blocks.popitem(last=False)
            self.forgotten += 1

    def translate(self, records: Sequence[tuple[bytes, int]]) -> list[Any]:
        """The events of these (key, code) records, in order: a chain of stored blocks (each the
        parent of the next) in one tier is one stored event, as the engines publish their own;
        the removals in a row from one tier and group are one removed event. A record that
        changes nothing a router was told (a block stored twice, removed from a tier it was
        not announced in) is skipped."""
        out: list[Any] = []
        run: list[B] = []  # blocks of the event being built: all stored, or all removed
        run_code = 0
        for key, code in records:
            if key == SERVER_CHANGED:
                self._flush(out, run, run_code)
                run = []
                out.extend(self.server_changed())
                continue
            b = self._blocks.get(key)
            if b is None:
                self.unknown += 1
                continue
            if not self._apply(key, b, code):
                continue
            if run and not (
                code == run_code and b.group == run[-1].group and (code & REMOVED or b.parent == run[-1].hash)
            ):
                self._flush(out, run, run_code)
                run = []
            run.append(b)
            run_code = code
        self._flush(out, run, run_code)
        return out

    def _apply(self, key: bytes, b: B, code: int) -> bool:
        """Note the record's change of ``b``'s tiers; False when it is no news to a router."""
        tier = code & ~REMOVED
        if tier not in TIERS:
            return False
        bit = 1 << tier
        if code & REMOVED:
            if not b.tiers & bit:
                return False
            b.tiers &= ~bit
            if not b.tiers:  # in no tier now: forgotten until it is saved or hit again
                del self._blocks[key]
            return True
        if b.tiers & bit:
            return False
        b.tiers |= bit
        return True

    def _flush(self, out: list[Any], run: list[B], code: int) -> None:
        if run:
            tier = code & ~REMOVED
            out.append(self.removed(run, tier) if code & REMOVED else self.stored(run, tier))

    def cleared(self) -> list[Any]:
        """``reset_cache`` dropped the namespace from the DRAM pool (its files stay): the router
        forgets everything of this engine (the all-cleared event, as the engine's own reset
        publishes), then hears again of the blocks still on storage."""
        return [self.all_cleared(), *self.forget_dram()]

    def forget_dram(self) -> list[Any]:
        """The namespace left the DRAM pool and the router forgot every block (the engine
        published its all-cleared event): the stored events of the blocks still on storage."""
        dram = 1 << int(Tier.DRAM)
        storage = 1 << int(Tier.STORAGE)
        for key, b in list(self._blocks.items()):
            if b.tiers == dram:  # in DRAM only: gone (a block saved but not committed yet stays)
                del self._blocks[key]
            b.tiers &= ~dram
        stored = [k for k, b in self._blocks.items() if b.tiers & storage]
        for k in stored:
            self._blocks[k].tiers &= ~storage  # announced again, below
        return self.translate([(k, int(Tier.STORAGE)) for k in stored])

    def server_changed(self) -> list[Any]:
        """Another hpkv server answers now (the old one stopped or died): its pool, and so
        every block announced in DRAM, is gone; files stay (a router hears again of those the
        new server's records mention)."""
        dram = 1 << int(Tier.DRAM)
        return self.translate(
            [(k, int(Tier.DRAM) | REMOVED) for k, b in self._blocks.items() if b.tiers & dram]
        )


class EventFeed:
    """Fetches the namespace's records from the hpkv server in a background thread.

    ``client()`` gives the current client (None while hpkv is away), ``ns_id()`` its namespace
    id. :meth:`take` (scheduler thread) returns the records fetched so far and asks for the
    next fetch: the feed fetches only while the engine steps (vLLM calls ``take_events`` every step),
    at most every ``interval_s``. A failed fetch only delays the next one (``RETRY_S``); the
    scheduler's own calls decide whether hpkv is lost."""

    def __init__(
        self,
        client: Callable[[], KvStore | None],
        ns_id: Callable[[], int],
        interval_s: float = INTERVAL_S,
        max_pending: int = MAX_PENDING,
    ):
        self._client = client
        self._ns_id = ns_id
        self.interval_s = interval_s
        self._pending: deque[tuple[bytes, int]] = deque()  # appended by the thread, popped by take
        self.max_pending = max_pending
        self.lost = 0  # records the server's log or this queue no longer had
        self._watching: tuple[Any, int] | None = None  # (client, ns id) whose seq is _seq
        self._server_pid: int | None = None
        self._seq = -1
        self._wanted = threading.Event()
        self._stop = threading.Event()
        self._refused_logged = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start watching now (saves made from here on are published) and the thread."""
        self._fetch()
        self._thread = threading.Thread(target=self._run, name="hpkv-kv-events", daemon=True)
        self._thread.start()

    def take(self) -> list[tuple[bytes, int]]:
        self._wanted.set()
        out: list[tuple[bytes, int]] = []
        pending = self._pending
        while pending:
            out.append(pending.popleft())
        return out

    def close(self) -> None:
        self._stop.set()
        self._wanted.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wanted.wait()
            if self._stop.is_set():
                return
            self._wanted.clear()
            wait = self.interval_s if self._fetch() else RETRY_S
            self._stop.wait(wait)

    def _fetch(self) -> bool:
        """Fetch what the server logged since the last fetch; False if it failed."""
        client = self._client()
        if client is None:
            return True  # hpkv is away: the scheduler's reconnection brings it back
        try:
            ns = self._ns_id()
            if self._watching != (client, ns):  # a new connection: start watching (again)
                ans = client.events(ns, -1)
                pid = getattr(client, "server_pid", None)
                if self._server_pid is not None and pid != self._server_pid:
                    self._push(SERVER_CHANGED, 0)
                self._server_pid = pid
                self._watching, self._seq = (client, ns), ans.seq
                return True  # nothing before this: the next fetch reads what comes
            more = True
            while more and not self._stop.is_set():
                ans = client.events(ns, self._seq)
                self._seq = ans.seq
                self.lost += ans.lost
                for rec in ans.records:
                    self._push(*rec)
                more = ans.more
        except Exception as exc:  # noqa: BLE001 - hpkv trouble: events stop, the engine goes on
            if not self._refused_logged:
                self._refused_logged = True
                log.warning(
                    "hpkv: cannot fetch KV events from the hpkv server (%s); retrying every %gs", exc, RETRY_S
                )
            return False
        return True

    def _push(self, key: bytes, code: int) -> None:
        if len(self._pending) >= self.max_pending:
            self.lost += 1  # the engine stopped taking them: the oldest wait, the newest go
            return
        self._pending.append((key, code))

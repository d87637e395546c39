"""Storage loads in parts: a load's blocks that only storage holds are promoted (disk or remote
store → pool) in a few parts, read ahead on helper threads, while the caller copies each part
that has arrived (pool → the engine's KV cache or host pool). Shared by the vLLM and SGLang
connectors."""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from hpkv.client.contract import KvStore

# A storage load is promoted in up to this many parts of at least HPKV_PROMOTE_PART_SIZE,
# each copied while the next is read (Qwen2.5-7B's 8192-token prompt: 8 parts of 56 MiB at
# the default 16 MiB).
PROMOTE_PARTS = 8


def promote_parts(missing: np.ndarray, shard_bytes: int, min_part_bytes: int) -> list[np.ndarray]:
    """The parts a storage load is promoted in: up to PROMOTE_PARTS, none under
    ``min_part_bytes`` (0: one part). A part's copy out of the pool overlaps the next
    part's read; each part costs a round trip to the server and a drain of the IO workers."""
    if not len(missing):
        return []
    if min_part_bytes <= 0:
        return [missing]
    min_blocks = max(1, -(-min_part_bytes // max(1, shard_bytes)))
    n = max(1, min(PROMOTE_PARTS, len(missing) // min_blocks))
    return [p for p in np.array_split(missing, n) if len(p)]


class PromoteAhead:
    """Promotes the parts of a load on threads of their own, ahead of the caller, who copies
    each part while the next ones are read. Part ``i`` goes through ``clients[i % depth]``
    (a client takes one call at a time): with two clients two parts are in flight, so the
    IO or remote workers read the next part while the server answers one and the caller
    starts the one after (measured: with one, the workers sat idle ~25 ms per part of a
    remote hit). On exit every promote that was started has ended and ``promoted`` lists,
    per client, the keys it pinned for the caller (to unpin through it), also when a part
    failed or the caller stopped early."""

    def __init__(
        self,
        clients: Sequence[KvStore],
        ns_id: int,
        keys: list[bytes],
        parts: list[np.ndarray],
        timeout: float,
    ):
        """``timeout`` bounds all the parts' promotes together."""
        self.clients, self.ns_id, self.keys, self.parts = list(clients), ns_id, keys, parts
        self._deadline = time.monotonic() + timeout
        self._pool: ThreadPoolExecutor | None = None
        self._pending: deque[tuple[int, Future[np.ndarray]]] = deque()
        self.promoted: list[list[bytes]] = [[] for _ in self.clients]

    def _answered(self, i: int, rows: np.ndarray) -> None:
        keys = self.promoted[i % len(self.clients)]
        keys.extend(self.keys[k] for k, row in zip(self.parts[i], rows, strict=True) if (row >= 0).all())

    def __enter__(self) -> PromoteAhead:
        """With several parts, starts the first parts' promotes (the caller copies its DRAM
        blocks meanwhile)."""
        if len(self.parts) > 1:
            depth = min(len(self.clients), len(self.parts))
            self._pool = ThreadPoolExecutor(depth, thread_name_prefix="hpkv-promote")
            for i in range(depth):
                self._start(i)
        return self

    def _left(self) -> float:
        return max(0.001, self._deadline - time.monotonic())

    def _promote(self, i: int) -> np.ndarray:
        client = self.clients[i % len(self.clients)]
        return client.promote(self.ns_id, [self.keys[k] for k in self.parts[i]], timeout=self._left())

    def _start(self, i: int) -> None:
        assert self._pool is not None
        self._pending.append((i, self._pool.submit(self._promote, i)))

    def results(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(part, its rows) in order."""
        if self._pool is None:  # one part: no thread
            for i, part in enumerate(self.parts):
                rows = self._promote(i)
                self._answered(i, rows)
                yield part, rows
            return
        while self._pending:
            i, fut = self._pending.popleft()
            rows = fut.result()
            self._answered(i, rows)
            nxt = i + len(self.clients)
            if nxt < len(self.parts):  # its client is free again
                self._start(nxt)
            yield self.parts[i], rows

    def __exit__(self, *exc: object) -> None:
        if self._pool is None:
            return
        for i, fut in self._pending:  # started, never collected: its pins are ours too
            with contextlib.suppress(Exception):
                self._answered(i, fut.result())
        self._pending.clear()
        self._pool.shutdown(wait=True)


def load_in_parts(
    client: KvStore,
    ns_id: int,
    keys: list[bytes],
    offsets: np.ndarray,
    rank: int,
    shard_bytes: int,
    part_bytes: int,
    timeout: float,
    copy: Callable[[np.ndarray, np.ndarray], bool],
    stop_after_short_part: bool = False,
    ahead: KvStore | None = None,
) -> np.ndarray:
    """Copy ``keys`` out of the pool, promoting from storage those not in DRAM; per key, True
    when its copy succeeded.

    ``offsets``: this rank's pool offsets of the keys, those in DRAM pinned by the caller,
    negative for the ones to promote; filled in as parts arrive. ``copy(indices, offsets)``
    copies those keys (one batch) and says whether it succeeded. The DRAM keys are copied
    while the first part of the others is promoted (:func:`promote_parts` of ``part_bytes``),
    each part while the next is, all on this thread; ``timeout`` bounds all the promotes.
    ``stop_after_short_part``: once a part came back with a key missing, copy nothing more and
    start no further promote (a caller that can use only a prefix; the parts already being read
    ahead still complete, and are unpinned). ``ahead``: a second connection to the same server
    and namespace (same ``ns_id``), through which every other part is promoted, so that two
    parts are read at once (:class:`PromoteAhead`). The keys promoted here are unpinned before
    it returns, also when it raises (what ``copy`` or a promote raised)."""
    ok = np.zeros(len(keys), bool)
    parts = promote_parts(np.flatnonzero(offsets < 0), shard_bytes, part_bytes)
    clients = [client] if ahead is None else [client, ahead]
    reading = PromoteAhead(clients, ns_id, keys, parts, timeout)

    def copy_ready(idx: np.ndarray) -> None:
        idx = idx[offsets[idx] >= 0]
        if len(idx):
            ok[idx] = copy(idx, offsets[idx])

    try:
        with reading:
            copy_ready(np.flatnonzero(offsets >= 0))
            for part, rows in reading.results():
                offsets[part] = rows[:, rank]
                copy_ready(part)
                if stop_after_short_part and (rows[:, rank] < 0).any():
                    break
    finally:  # every promote has ended (PromoteAhead's exit waits for them)
        for owner, promoted in zip(clients, reading.promoted, strict=True):
            if promoted:  # pins are the connection's: released through it
                with contextlib.suppress(Exception):
                    owner.unpin(ns_id, promoted)
    return ok

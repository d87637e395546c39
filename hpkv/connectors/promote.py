"""Storage loads in parts: a load's blocks that only storage holds are promoted (disk → pool)
in a few parts, one after the other on a helper thread, while the caller copies each part
that has arrived (pool → the engine's KV cache or host pool). Shared by the vLLM and SGLang
connectors."""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
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
    """Promotes the parts of a load one after the other on a thread of its own, one part ahead
    of the caller, who copies each part while the next is read. On exit every promote that
    was started has ended and ``promoted`` lists the keys pinned for the caller (to unpin),
    also when a part failed or the caller stopped early."""

    def __init__(
        self, client: KvStore, ns_id: int, keys: list[bytes], parts: list[np.ndarray], timeout: float
    ):
        """``timeout`` bounds all the parts' promotes together."""
        self.client, self.ns_id, self.keys, self.parts = client, ns_id, keys, parts
        self._deadline = time.monotonic() + timeout
        self._pool: ThreadPoolExecutor | None = None
        self._pending: deque[tuple[np.ndarray, Future[np.ndarray]]] = deque()
        self.promoted: list[bytes] = []

    def _answered(self, part: np.ndarray, rows: np.ndarray) -> None:
        self.promoted.extend(self.keys[i] for i, row in zip(part, rows, strict=True) if (row >= 0).all())

    def __enter__(self) -> PromoteAhead:
        """With several parts, starts the first part's promote (the caller copies its DRAM
        blocks meanwhile)."""
        if len(self.parts) > 1:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="hpkv-promote")
            self._start(self.parts[0])
        return self

    def _left(self) -> float:
        return max(0.001, self._deadline - time.monotonic())

    def _start(self, part: np.ndarray) -> None:
        assert self._pool is not None
        keys = [self.keys[i] for i in part]
        self._pending.append(
            (part, self._pool.submit(self.client.promote, self.ns_id, keys, timeout=self._left()))
        )

    def results(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(part, its rows) in order."""
        if self._pool is None:  # one part: no thread
            for part in self.parts:
                rows = self.client.promote(self.ns_id, [self.keys[i] for i in part], timeout=self._left())
                self._answered(part, rows)
                yield part, rows
            return
        for nxt in [*self.parts[1:], None]:
            part, fut = self._pending.popleft()
            rows = fut.result()
            self._answered(part, rows)
            if nxt is not None:
                self._start(nxt)
            yield part, rows

    def __exit__(self, *exc: object) -> None:
        if self._pool is None:
            return
        for part, fut in self._pending:  # started, never collected: its pins are ours too
            with contextlib.suppress(Exception):
                self._answered(part, fut.result())
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
) -> np.ndarray:
    """Copy ``keys`` out of the pool, promoting from storage those not in DRAM; per key, True
    when its copy succeeded.

    ``offsets``: this rank's pool offsets of the keys, those in DRAM pinned by the caller,
    negative for the ones to promote; filled in as parts arrive. ``copy(indices, offsets)``
    copies those keys (one batch) and says whether it succeeded. The DRAM keys are copied
    while the first part of the others is promoted (:func:`promote_parts` of ``part_bytes``),
    each part while the next is, all on this thread; ``timeout`` bounds all the promotes.
    ``stop_after_short_part``: once a part came back with a key missing, copy nothing more and
    start no further promote (a caller that can use only a prefix; the part already being read
    ahead still completes, and is unpinned). The keys promoted here are unpinned before it
    returns, also when it raises (what ``copy`` or a promote raised)."""
    ok = np.zeros(len(keys), bool)
    parts = promote_parts(np.flatnonzero(offsets < 0), shard_bytes, part_bytes)
    ahead = PromoteAhead(client, ns_id, keys, parts, timeout)

    def copy_ready(idx: np.ndarray) -> None:
        idx = idx[offsets[idx] >= 0]
        if len(idx):
            ok[idx] = copy(idx, offsets[idx])

    try:
        with ahead:
            copy_ready(np.flatnonzero(offsets >= 0))
            for part, rows in ahead.results():
                offsets[part] = rows[:, rank]
                copy_ready(part)
                if stop_after_short_part and (rows[:, rank] < 0).any():
                    break
    finally:
        if ahead.promoted:  # every promote has ended (PromoteAhead's exit waits for them)
            with contextlib.suppress(Exception):
                client.unpin(ns_id, ahead.promoted)
    return ok

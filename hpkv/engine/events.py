"""The per-namespace event log: which blocks entered or left a tier, for KV-event publishers.

An engine publishes KV events (vLLM's ``--kv-events-config``) so a cache-aware router knows
which replica holds which prefix. Only the server knows when a block is committed in the
pool, spilled to storage, evicted or dropped; only the engine knows the block hashes the
router matches. So the server logs (key, what happened) per namespace and the engine's
connector fetches "records since seq" now and then (control call ``events``) and translates
the keys it saved into its own hashes (:mod:`hpkv.connectors.vllm.events`).

Bounded and off by default: a namespace has a log only once a client asked for its events
(:meth:`NsEventLog` is made by the first ``events`` call), and a log is a fixed ring of
:data:`CAPACITY` records of :data:`RECORD` bytes (1.1 MiB), no Python object per record.
A reader that falls more than :data:`CAPACITY` records behind loses the oldest ones and is
told how many (``lost``); nothing ever waits for a reader.

Invariants: ``head`` counts every record ever appended (the next record's seq); record
``s`` lives at ``(s % CAPACITY) * RECORD`` while ``s >= head - CAPACITY``. Everything here
runs under the server's lock (appends from the request loop and the storage tier, reads from
the control thread). The record format is :mod:`hpkv.protocol.events`.
"""

from __future__ import annotations

from collections.abc import Iterable

from hpkv.protocol.events import RECORD, REMOVED
from hpkv.protocol.keys import KEY_BYTES
from hpkv.protocol.wire import Tier

CAPACITY = 1 << 16  # records kept per namespace (at 17 bytes: 1.1 MiB)
MAX_READ = 8192  # records one ``events`` call returns (the reader asks again for more)
STORED_DRAM = int(Tier.DRAM)
STORED_STORAGE = int(Tier.STORAGE)
REMOVED_DRAM = int(Tier.DRAM) | REMOVED
REMOVED_STORAGE = int(Tier.STORAGE) | REMOVED


class NsEventLog:
    """One namespace's ring of (key, code) records."""

    __slots__ = ("buf", "head")

    def __init__(self) -> None:
        self.buf = bytearray(CAPACITY * RECORD)
        self.head = 0

    def add(self, key: bytes, code: int) -> None:
        pos = (self.head % CAPACITY) * RECORD
        self.buf[pos : pos + KEY_BYTES] = key
        self.buf[pos + KEY_BYTES] = code
        self.head += 1

    def add_many(self, keys: Iterable[bytes], code: int) -> None:
        for k in keys:
            self.add(k, code)

    def read(self, since: int, limit: int = MAX_READ) -> tuple[bytes, int, int]:
        """(records from ``since`` on, at most ``limit`` of them; the seq after them; how many
        records before them were lost to the ring). ``since`` < 0 starts at the head (nothing
        old: the caller just started watching)."""
        if since < 0 or since > self.head:
            return b"", self.head, 0
        oldest = max(self.head - CAPACITY, 0)
        lost = max(oldest - since, 0)
        start = since + lost
        end = min(self.head, start + max(limit, 0))
        out = bytearray()
        s = start
        while s < end:  # at most two slices: the ring wraps once
            pos = s % CAPACITY
            n = min(end - s, CAPACITY - pos)
            out += self.buf[pos * RECORD : (pos + n) * RECORD]
            s += n
        return bytes(out), end, lost

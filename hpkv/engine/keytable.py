"""A native table of 16-byte block keys → (owning namespace, tier), for lookups at C speed
(native/keytable.c).

It behaves like the ``dict`` it replaces for the index (``t.set(key, ns, tier)``,
``t.get(key)``, ``t.pop(key, None)``), plus :meth:`prefix`, which answers a whole
lookup over keys lying in a buffer (the client's mailbox) without building a
Python object per key. A key belongs to one namespace: a lookup for another
namespace does not see it.

A table made with ``columns=True`` (the storage catalog's) also keeps a 64-bit recency
and a 32-bit stamp per key (:meth:`columns`, :meth:`set_recency`, :meth:`set_stamp`),
and finds the least recent keys in one pass (:meth:`oldest`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from hpkv.common.native import ffi, lib
from hpkv.protocol.stats import MAX_NS


class KeyTable:
    # Small at first (4096 slots, ~200 KB with columns): the table grows step by step, and a
    # server with few stored blocks should not hold megabytes for them.
    def __init__(self, initial_capacity: int = 1 << 12, columns: bool = False):
        new = lib.hpkv_keytable_new_columns if columns else lib.hpkv_keytable_new
        self._t = ffi.gc(new(initial_capacity), lib.hpkv_keytable_free)
        if self._t == ffi.NULL:
            raise MemoryError("cannot allocate the key table")
        self.has_columns = columns
        self._set = lib.hpkv_keytable_set
        self._get = lib.hpkv_keytable_get
        self._remove = lib.hpkv_keytable_remove
        self._prefix = lib.hpkv_keytable_prefix
        self._ns_out = ffi.new("uint8_t *")
        self._rec_out = ffi.new("uint64_t *")
        self._stamp_out = ffi.new("uint32_t *")
        self._get_columns = lib.hpkv_keytable_get_columns
        self._set_recency = lib.hpkv_keytable_set_recency
        self._set_stamp = lib.hpkv_keytable_set_stamp
        self._peek = lib.hpkv_keytable_peek

    def set(self, key: bytes, ns: int, value: int) -> None:
        """Insert or update ``key``, owned by namespace ``ns`` (0..MAX_NS-1), with ``value`` (1..3:
        a :class:`~hpkv.protocol.wire.Tier`; both share one byte a key in the table)."""
        if len(key) != 16 or not 1 <= value <= 3 or not 0 <= ns < MAX_NS:
            raise ValueError(
                f"key must be 16 bytes, ns 0..{MAX_NS - 1} and value 1..3, "
                f"got {len(key)} bytes, ns {ns}, value {value}"
            )
        if self._set(self._t, key, ns, value) != 0:
            raise MemoryError("cannot grow the key table")

    def get(self, key: bytes, default: Any = None, ns: int | None = None) -> Any:
        """The key's value; ``default`` when absent, or owned by another namespace than ``ns``."""
        v = self._get(self._t, key, self._ns_out)
        return v if v and (ns is None or self._ns_out[0] == ns) else default

    def owner(self, key: bytes) -> int | None:
        """The namespace the key belongs to, None when absent."""
        return self._ns_out[0] if self._get(self._t, key, self._ns_out) else None

    def __contains__(self, key: bytes) -> bool:
        return self._get(self._t, key, ffi.NULL) != 0

    def pop(self, key: bytes, default: Any = None) -> Any:
        v = self._get(self._t, key, ffi.NULL)
        if not v:
            return default
        self._remove(self._t, key)
        return v

    def __len__(self) -> int:
        return int(lib.hpkv_keytable_len(self._t))

    def peek(self, key: bytes) -> int:
        """``value | owner << 2 | stamp << 8`` of ``key`` in one call (0 when absent): for
        callers on a hot path that need more than the value."""
        return int(self._peek(self._t, key))

    def peeker(self) -> Callable[[bytes], int]:
        """:meth:`peek` as a bare function of the key, for loops per key of a lookup (one
        Python call less per key)."""
        return functools.partial(self._peek, self._t)

    def get_many(self, keys: bytes, n: int) -> bytes:
        """The value of each of ``n`` 16-byte keys in ``keys`` (0: absent)."""
        out = bytearray(n)
        lib.hpkv_keytable_get_many(self._t, keys, n, ffi.from_buffer(out, require_writable=True))
        return bytes(out)

    def set_many(self, keys: bytes, n: int, ns: int, value: int, rec: int = 0, rec_step: int = 0) -> None:
        """:meth:`set` for ``n`` 16-byte keys in ``keys``; with columns key i's recency is
        ``rec + i * rec_step``."""
        if len(keys) != 16 * n or not 1 <= value <= 3 or not 0 <= ns < MAX_NS:
            raise ValueError(f"{n} keys need {16 * n} bytes, got {len(keys)}; ns {ns}, value {value}")
        if lib.hpkv_keytable_set_many(self._t, keys, n, ns, value, rec, rec_step) != 0:
            raise MemoryError("cannot grow the key table")

    def capacity(self) -> int:
        """Slots the arrays hold (live keys, free slots and tombstones)."""
        return int(lib.hpkv_keytable_capacity(self._t))

    def prefix(self, ns: int, keys: Any, n: int, out: Any) -> int:
        """Leading keys of namespace ``ns`` present among ``n`` 16-byte keys in buffer ``keys``;
        their values go to ``out``. A key of another namespace ends the prefix like a miss."""
        return int(
            self._prefix(self._t, ns, ffi.from_buffer(keys), n, ffi.from_buffer(out, require_writable=True))
        )

    def each(self, ns: int, keys: Any, n: int, out: Any) -> int:
        """The value of each of ``n`` 16-byte keys in buffer ``keys`` present in namespace
        ``ns`` to ``out`` (0 for the others); returns how many are."""
        return int(
            lib.hpkv_keytable_each(
                self._t, ns, ffi.from_buffer(keys), n, ffi.from_buffer(out, require_writable=True)
            )
        )

    def lookup(self, ns: int, keys: Sequence[bytes]) -> tuple[int, list[int]]:
        out = bytearray(len(keys))
        n = self.prefix(ns, b"".join(keys), len(keys), out)
        return n, list(out[:n])

    # ------------------------------------------------------------ columns
    def columns(self, key: bytes) -> tuple[int, int, int, int]:
        """(value, owner, recency, stamp) of ``key``; value 0 (and the rest 0) when absent."""
        v = self._get_columns(self._t, key, self._ns_out, self._rec_out, self._stamp_out)
        if not v:
            return 0, 0, 0, 0
        return v, self._ns_out[0], self._rec_out[0], self._stamp_out[0]

    def set_recency(self, key: bytes, rec: int) -> bool:
        """False when the key is absent."""
        return bool(self._set_recency(self._t, key, rec))

    def set_stamp(self, key: bytes, stamp: int) -> bool:
        """False when the key is absent."""
        return bool(self._set_stamp(self._t, key, stamp))

    def stale(self, keys: bytes, n: int, ns: int, mask: int, now: int, age: int) -> bytes:
        """For each of ``n`` 16-byte keys: 1 when present with a bit of ``mask``, owned by ``ns``,
        and its stamp 0 or at least ``age`` older than ``now`` (modulo 2**32), else 0."""
        out = bytearray(n)
        lib.hpkv_keytable_stale(
            self._t, keys, n, ns, mask, now, age, ffi.from_buffer(out, require_writable=True)
        )
        return bytes(out)

    def oldest(self, mask: int, k: int) -> list[tuple[bytes, int]]:
        """The (at most) ``k`` keys whose value has a bit of ``mask``, least recent first,
        with their recency: one pass over the table."""
        k = min(k, len(self))
        if k <= 0:
            return []
        keys = ffi.new("uint8_t[]", 16 * k)
        recs = ffi.new("uint64_t[]", k)
        n = int(lib.hpkv_keytable_oldest(self._t, mask, k, keys, recs))
        raw = ffi.buffer(keys, 16 * n)[:]
        return [(raw[16 * i : 16 * i + 16], int(recs[i])) for i in range(n)]

    def select(self, mask: int, ns: int | None = None) -> list[bytes]:
        """The keys (of namespace ``ns``, or all) whose value has a bit of ``mask``."""
        raw = self.select_raw(mask, ns)
        return [raw[i : i + 16] for i in range(0, len(raw), 16)]

    def select_raw(self, mask: int, ns: int | None = None) -> bytes:
        """:meth:`select` as one string of 16-byte keys (no Python object per key)."""
        cap = len(self)
        if cap == 0:
            return b""
        keys = ffi.new("uint8_t[]", 16 * cap)
        n = int(lib.hpkv_keytable_select(self._t, -1 if ns is None else ns, mask, keys, cap))
        return ffi.buffer(keys, 16 * n)[:]

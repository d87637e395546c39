"""A native table of 16-byte block keys → (owning namespace, tier), for lookups at C speed
(native/keytable.c).

It behaves like the ``dict`` it replaces for the index (``t.set(key, ns, tier)``,
``t.get(key)``, ``t.pop(key, None)``), plus :meth:`prefix`, which answers a whole
lookup over keys lying in a buffer (the client's mailbox) without building a
Python object per key. A key belongs to one namespace: a lookup for another
namespace does not see it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hpkv.common.native import ffi, lib
from hpkv.protocol.stats import MAX_NS


class KeyTable:
    def __init__(self, initial_capacity: int = 1 << 16):
        self._t = ffi.gc(lib.hpkv_keytable_new(initial_capacity), lib.hpkv_keytable_free)
        if self._t == ffi.NULL:
            raise MemoryError("cannot allocate the key table")
        self._set = lib.hpkv_keytable_set
        self._get = lib.hpkv_keytable_get
        self._remove = lib.hpkv_keytable_remove
        self._prefix = lib.hpkv_keytable_prefix
        self._ns_out = ffi.new("uint8_t *")

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

    def prefix(self, ns: int, keys: Any, n: int, out: Any) -> int:
        """Leading keys of namespace ``ns`` present among ``n`` 16-byte keys in buffer ``keys``;
        their values go to ``out``. A key of another namespace ends the prefix like a miss."""
        return int(
            self._prefix(self._t, ns, ffi.from_buffer(keys), n, ffi.from_buffer(out, require_writable=True))
        )

    def lookup(self, ns: int, keys: Sequence[bytes]) -> tuple[int, list[int]]:
        out = bytearray(len(keys))
        n = self.prefix(ns, b"".join(keys), len(keys), out)
        return n, list(out[:n])

"""A native table of 16-byte block keys → tier, for lookups at C speed (native/keytable.c).

It behaves like the ``dict`` it replaces for the index (``t[key] = tier``,
``t.get(key)``, ``t.pop(key, None)``), plus :meth:`prefix`, which answers a whole
lookup over keys lying in a buffer (the client's mailbox) without building a
Python object per key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hpkv.common.native import ffi, lib


class KeyTable:
    def __init__(self, initial_capacity: int = 1 << 16):
        self._t = ffi.gc(lib.hpkv_keytable_new(initial_capacity), lib.hpkv_keytable_free)
        if self._t == ffi.NULL:
            raise MemoryError("cannot allocate the key table")
        self._set = lib.hpkv_keytable_set
        self._get = lib.hpkv_keytable_get
        self._remove = lib.hpkv_keytable_remove
        self._prefix = lib.hpkv_keytable_prefix

    def __setitem__(self, key: bytes, value: int) -> None:
        if len(key) != 16 or not 1 <= value <= 255:
            raise ValueError(f"key must be 16 bytes and value 1..255, got {len(key)} bytes and {value}")
        if self._set(self._t, key, value) != 0:
            raise MemoryError("cannot grow the key table")

    def get(self, key: bytes, default: Any = None) -> Any:
        v = self._get(self._t, key)
        return v if v else default

    def __contains__(self, key: bytes) -> bool:
        return self._get(self._t, key) != 0

    def pop(self, key: bytes, default: Any = None) -> Any:
        v = self._get(self._t, key)
        if not v:
            return default
        self._remove(self._t, key)
        return v

    def __len__(self) -> int:
        return int(lib.hpkv_keytable_len(self._t))

    def prefix(self, keys: Any, n: int, out: Any) -> int:
        """Leading present keys among ``n`` 16-byte keys in buffer ``keys``; their values go to ``out``."""
        return int(
            self._prefix(self._t, ffi.from_buffer(keys), n, ffi.from_buffer(out, require_writable=True))
        )

    def lookup(self, keys: Sequence[bytes]) -> tuple[int, list[int]]:
        out = bytearray(len(keys))
        n = self.prefix(b"".join(keys), len(keys), out)
        return n, list(out[:n])

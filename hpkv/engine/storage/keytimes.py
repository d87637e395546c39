"""16-byte block keys → (time, tag) at ~26 bytes a key: the journal writer's live blocks and the
evictor's view of the directory, which hold every block of a namespace (or of the whole
directory) and so must not cost a Python object each (a dict entry, a record and its key
object took ~210 bytes a block).

The keys lie in one sorted numpy array (searched by bisection) beside an int64 array of times
and a uint16 array of tags (what the owner makes of it: an index into its own short list of
block shapes). A removed key is marked :data:`DEAD` in place; a new key waits in a small dict
until enough have come to merge them all into the arrays in one pass (at most 1/64 of the
keys, or :data:`MERGE_MIN`): inserting one at a time would copy the arrays each time.

Used by one thread at a time (its owner's lock).
"""

from __future__ import annotations

import numpy as np

DEAD = 0xFFFF  # the tag of a removed key (callers' tags are 0..0xFFFE)
MERGE_MIN = 4096  # new keys held in the dict before they are merged into the arrays
KEY = np.dtype("S16")  # compared as bytes (all 16 of them: no key is shorter)


class KeyTimes:
    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._keys = np.empty(0, KEY)  # sorted
        self._times = np.empty(0, np.int64)
        self._tags = np.empty(0, np.uint16)
        self._dead = 0  # DEAD slots in the arrays
        self._new: dict[bytes, tuple[int, int]] = {}  # keys not in the arrays yet

    def __len__(self) -> int:
        return len(self._keys) - self._dead + len(self._new)

    def __contains__(self, key: bytes) -> bool:
        return self.get(key) is not None

    def get(self, key: bytes) -> tuple[int, int] | None:
        """(time, tag) of ``key``, None when absent."""
        got = self._new.get(key)
        if got is not None:
            return got
        i = self._find(key)
        return None if i < 0 else (int(self._times[i]), int(self._tags[i]))

    def put(self, key: bytes, time: int, tag: int) -> None:
        i = self._find(key)
        if i >= 0:
            self._times[i] = time
            self._tags[i] = tag
            return
        i = self._slot(key)
        if i >= 0:  # removed earlier: its slot is reused
            self._times[i] = time
            self._tags[i] = tag
            self._dead -= 1
            return
        self._new[key] = (time, tag)
        if len(self._new) >= max(MERGE_MIN, len(self._keys) >> 6):
            self._merge()

    def remove(self, key: bytes) -> bool:
        if self._new.pop(key, None) is not None:
            return True
        i = self._find(key)
        if i < 0:
            return False
        self._tags[i] = DEAD
        self._dead += 1
        if self._dead > MERGE_MIN and self._dead > len(self._keys) >> 1:
            self._merge()
        return True

    def put_many(self, keys: bytes, time: int, tag: int) -> None:
        """:meth:`put` of the 16-byte keys laid end to end in ``keys``, all with one time and tag,
        in one merge."""
        self._merge()
        new = np.unique(np.frombuffer(keys, KEY))
        if not len(new):
            return
        pos = np.searchsorted(self._keys, new)
        there = pos < len(self._keys)
        there[there] = self._keys[pos[there]] == new[there]
        self._times[pos[there]] = time  # (no DEAD slots after the merge)
        self._tags[pos[there]] = tag
        new, pos = new[~there], pos[~there]
        self._keys = np.insert(self._keys, pos, new)
        self._times = np.insert(self._times, pos, time)
        self._tags = np.insert(self._tags, pos, tag)

    def missing(self, keys: bytes) -> bytes:
        """The keys of ``keys`` (16 bytes each, end to end) that are absent, in order."""
        want = np.frombuffer(keys, KEY)
        if not len(want):
            return b""
        self._merge()
        pos = np.searchsorted(self._keys, want)
        ok = pos < len(self._keys)
        ok[ok] = (self._keys[pos[ok]] == want[ok]) & (self._tags[pos[ok]] != DEAD)
        return want[~ok].tobytes()

    def oldest(self, k: int) -> list[tuple[int, bytes, int]]:
        """The (at most) ``k`` keys of smallest time, smallest first, as (time, key, tag)."""
        self._merge()
        n = len(self._keys)
        k = min(k, n)
        if k <= 0:
            return []
        times = self._times
        if k < n:
            at = np.argpartition(times, k - 1)[:k]
        else:
            at = np.arange(n)
        at = at[np.argsort(times[at], kind="stable")]
        raw = self._keys[at].tobytes()
        return [(int(times[j]), raw[16 * i : 16 * i + 16], int(self._tags[j])) for i, j in enumerate(at)]

    def by_time(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(keys, times, tags) of every key, in time order (copies)."""
        self._merge()
        order = np.argsort(self._times, kind="stable")
        return self._keys[order], self._times[order], self._tags[order]

    def nbytes(self) -> int:
        """Bytes of the arrays (the dict of new keys aside)."""
        return self._keys.nbytes + self._times.nbytes + self._tags.nbytes

    def _slot(self, key: bytes) -> int:
        """The key's position in the arrays, live or DEAD; -1 when not there."""
        keys = self._keys
        i = int(np.searchsorted(keys, key))
        return i if i < len(keys) and keys[i : i + 1].tobytes() == key else -1

    def _find(self, key: bytes) -> int:
        """The key's position in the arrays when live there, else -1."""
        i = self._slot(key)
        return i if i >= 0 and self._tags[i] != DEAD else -1

    def _merge(self) -> None:
        """The new keys into the arrays, the DEAD slots out (one pass)."""
        if self._dead:
            live = self._tags != DEAD
            self._keys, self._times, self._tags = self._keys[live], self._times[live], self._tags[live]
            self._dead = 0
        if not self._new:
            return
        keys = np.array(list(self._new), KEY)
        times = np.fromiter((t for t, _ in self._new.values()), np.int64, len(keys))
        tags = np.fromiter((g for _, g in self._new.values()), np.uint16, len(keys))
        self._new = {}
        order = np.argsort(keys, kind="stable")
        keys, times, tags = keys[order], times[order], tags[order]
        pos = np.searchsorted(self._keys, keys)
        self._keys = np.insert(self._keys, pos, keys)
        self._times = np.insert(self._times, pos, times)
        self._tags = np.insert(self._tags, pos, tags)

"""The pool's slot fence, as the server and the transfer workers see it (contract in native/fence.h).

One uint32 word per :data:`~hpkv.protocol.wire.SLOT_UNIT` of the pool, in a file the server
creates beside the pool (``pool.gen``) and maps together with its transfer workers; clients
never map it. The server bumps a slot's generation when it frees the slot and hands the
generation out with the slot; a transfer worker writes a slot only while it still has the
generation of the job. So a save submitted after its reservation was released (a dead or
hung engine's late copy) is refused instead of landing in a slot another key now owns, and
a released slot can be reused at once, without waiting on any worker's queue.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np

from hpkv.common.native import ffi, lib
from hpkv.common.shm import map_file
from hpkv.protocol import wire as P


class SlotFence:
    def __init__(self, path: str):
        self.path = path
        self._mm = map_file(path)
        self.words = np.frombuffer(self._mm, np.uint32)
        self._c = ffi.from_buffer("uint32_t[]", self.words)
        self.num_words = len(self.words)

    @classmethod
    def create(cls, path: str, pool_bytes: int) -> SlotFence:
        """A fresh fence for a pool of ``pool_bytes`` (every generation 0), replacing any old file."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(4, -(-pool_bytes // P.SLOT_UNIT) * 4))
        finally:
            os.close(fd)
        return cls(path)

    # ------------------------------------------------------------ server side
    def generations(self, offsets: np.ndarray) -> np.ndarray:
        """The current generation of the slots at these byte offsets (non-negative ones)."""
        return (self.words[offsets // P.SLOT_UNIT] & P.SLOT_GEN_MASK).astype(np.int64)

    def bump(self, offset: int) -> bool:
        """Start the slot at ``offset`` on a new generation: no save made for an older one can
        land from now on. False while a worker is copying into it (try again later)."""
        return lib.hpkv_fence_bump(self._c, self.num_words, offset // P.SLOT_UNIT) >= 0

    def clear_holder(self, holder: int) -> int:
        """Drop the holds of a dead worker (``holder`` = its stats slot + 1); returns how many."""
        return int(lib.hpkv_fence_clear_holder(self._c, self.num_words, holder))

    # ------------------------------------------------------------ transfer worker side
    def enter(self, offsets: np.ndarray, gens: np.ndarray, holder: int) -> int:
        """Hold every slot of a save batch if each still has its generation: -1 when all are
        held, else the position of the first refused slot (nothing held then)."""
        rc = lib.hpkv_fence_enter(*self._batch(offsets, gens), holder)
        if rc == lib.HPKV_FENCE_EARG:
            raise ValueError(f"bad fence arguments (holder {holder})")
        return -1 if rc == 0 else -int(rc) - 1

    def leave(self, offsets: np.ndarray, gens: np.ndarray, holder: int) -> None:
        """Give back what :meth:`enter` held, once the copy's stores are complete."""
        lib.hpkv_fence_leave(*self._batch(offsets, gens), holder)

    def _batch(self, offsets: np.ndarray, gens: np.ndarray) -> tuple:
        """The arguments enter and leave share: the words, the slot unit, the batch."""
        return (
            self._c,
            self.num_words,
            P.SLOT_UNIT,
            ffi.from_buffer("int64_t[]", offsets),
            ffi.from_buffer("uint32_t[]", gens),
            len(offsets),
        )

    def close(self) -> None:
        self._c = None
        self.words = np.empty(0, np.uint32)
        with contextlib.suppress(BufferError):
            self._mm.close()


def decode_slots(values: np.ndarray, slot_bytes: int, pool_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """A job's slot values → (pool byte offsets, generations as uint32). Raises ValueError for
    a negative value, an offset that is not a multiple of the slot size (it used to be floored
    to a slot silently) or one past the pool."""
    if (values < 0).any():
        i = int(np.argmax(values < 0))
        raise ValueError(f"slot value [{i}] = {int(values[i])} is negative (a reserve sentinel, not a slot)")
    offsets = values & P.SLOT_OFFSET_MASK
    bad = (offsets % slot_bytes != 0) | (offsets + slot_bytes > pool_bytes)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"pool offset [{i}] = {int(offsets[i])} is not the start of a {slot_bytes} B slot of the "
            f"{pool_bytes} B pool (offsets must be multiples of the slot size, as reserve/pin return them)"
        )
    return offsets, P.slot_generation(values).astype(np.uint32)

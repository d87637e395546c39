"""The client ↔ server protocol: file names in the pool directory, mailbox and job-arena layout.

Control path. A client connects to ``server.sock`` (Unix socket) and speaks
newline-delimited JSON for the rare calls: hello, namespace, register_device,
clear, time_saved, stats, shutdown. The socket also tells the server when a client dies
(EOF): its pins and reservations are released.

Hot path. ``hello`` hands the client a ring pair and a *mailbox* (a shared-memory
file). A hot call (lookup, reserve, commit, pin, unpin) writes its keys into the
request half of the mailbox, pushes one descriptor on the request ring (the
server sleeps on a doorbell shared by all request rings), and pops the answer,
whose data the server wrote into the response half. One call is in flight per
client, so one mailbox suffices.

Copies. ``register_device`` starts the device's transfer workers and hands the
client one ring pair and one *job arena* per worker. A job (COPY_SAVE / COPY_LOAD)
is ``n`` device block ids followed by ``n`` pool slot numbers (int64) in arena
slot ``seq % JOB_SLOTS``; the worker answers with a COMPLETION carrying the seq.

Storage. ``promote`` (hot call PROMOTE, keys in the mailbox, a2 = the client's
timeout in ms) answers like ``pin`` — pool offsets ``[n, world]``, -1 rows for
blocks that could not be loaded — once the IO workers have read the files; the
server answers by that timeout whatever is still in flight. IO jobs go from the
server to its IO workers as single descriptors (see :func:`io_job`), no arena.
"""

from __future__ import annotations

import os
from enum import IntEnum
from typing import Any

from hpkv.common.native import lib
from hpkv.protocol.keys import KEY_BYTES

# Descriptor kinds: defined once, in native/ring.h.
LOOKUP = lib.HPKV_DESC_LOOKUP
RESERVE = lib.HPKV_DESC_RESERVE
COMMIT = lib.HPKV_DESC_COMMIT
PIN = lib.HPKV_DESC_PIN
UNPIN = lib.HPKV_DESC_UNPIN
COPY_SAVE = lib.HPKV_DESC_COPY_SAVE
COPY_LOAD = lib.HPKV_DESC_COPY_LOAD
SPILL = lib.HPKV_DESC_SPILL  # IO job: pool slot -> KV file
PROMOTE = lib.HPKV_DESC_PROMOTE  # hot call (client -> server) and IO job (KV file -> pool slot)
COMPLETION = lib.HPKV_DESC_COMPLETION
ERROR = lib.HPKV_DESC_ERROR
SHUTDOWN = lib.HPKV_DESC_SHUTDOWN


class Tier(IntEnum):
    """Where a lookup found a block (also the wire code)."""

    MISS = 0
    DRAM = 1
    STORAGE = 2  # local KV files
    # A shared store of several nodes (Mooncake Store), below the files. A client treats
    # every tier from STORAGE up as a load that waits on a medium (a background load).
    REMOTE = 3


# Flags of a COMMIT: the shard could not be written; drop the reservation instead.
FLAG_ABORT = 1

# Flags of a LOOKUP: answer every key (its tier, 0 where missing), not the leading prefix only.
# A sliding-window model's hit needs some blocks of a group and not the ones before them.
FLAG_EACH = 1

# Status codes carried in descriptors besides -errno: one definition, hpkv.protocol.errors.Status.

# Flags of an IO job's completion.
IO_EXISTED = 1  # spill: a complete file was already in place, nothing written
IO_DIRECT_FALLBACK = 2  # O_DIRECT was refused at run time (EINVAL); the worker went buffered

# Files in the pool directory. The server owns them all.
LOCK_FILE = "server.lock"
SOCKET_FILE = "server.sock"
LOG_FILE = "server.log"
POOL_FILE = "pool"
SPAWN_LOCK_FILE = "spawn.lock"
OWNED_SUFFIXES = (".ring", ".bell", ".mbox", ".jobs", ".gen")  # removed at start-up and shutdown

# An engine worker's KV cache, exported as a shared-memory file in the pool directory
# (CPU backend). The pid in the name lets the server remove the file of a dead engine.
DEVICE_FILE_PREFIX = "kvcache-"


def device_file_name(pid: int, rank: int) -> str:
    return f"{DEVICE_FILE_PREFIX}{pid}-r{rank}"


def device_file_pid(name: str) -> int | None:
    if not name.startswith(DEVICE_FILE_PREFIX):
        return None
    pid, _, _ = name[len(DEVICE_FILE_PREFIX) :].partition("-")
    return int(pid) if pid.isdigit() else None


RING_CAPACITY = 1024

MAILBOX_BYTES = 8 << 20
MAILBOX_HALF = MAILBOX_BYTES // 2
MAX_KEYS_PER_CALL = MAILBOX_HALF // (KEY_BYTES * 8)  # reserve answers 8-byte slots x world size


def max_keys_per_call(world_size: int) -> int:
    """Keys one reserve/pin/promote may carry at this world size: its answer (8 bytes per rank
    per key) must fit the mailbox's answer half (MAX_KEYS_PER_CALL assumes world <= 16)."""
    return min(MAX_KEYS_PER_CALL, MAILBOX_HALF // (8 * max(1, world_size)))


JOB_SLOTS = 64  # jobs in flight per worker (arena slots)
JOB_SLOT_BYTES = 128 * 1024  # 8192 (block, slot) pairs per job
MAX_PAIRS_PER_JOB = JOB_SLOT_BYTES // 16
JOB_ARENA_BYTES = JOB_SLOTS * JOB_SLOT_BYTES

SLOT_UNIT = 4096  # pool slots are addressed in 4 KiB units (allocator alignment)

# A reserve answer's slot value: the pool byte offset (< 2**SLOT_GEN_SHIFT) with the slot's
# generation above it (native/fence.h); a save job carries it as is, and the transfer worker
# writes only while the slot still has that generation. Pin/promote answers carry offsets only
# (loads read pinned slots). Negative values stay the sentinels (ROW_*).
SLOT_GEN_SHIFT = 40
SLOT_OFFSET_MASK = (1 << SLOT_GEN_SHIFT) - 1
SLOT_GEN_MASK = lib.HPKV_FENCE_GEN_MASK
FENCE_SUFFIX = ".gen"  # the pool's slot generations: POOL_FILE + FENCE_SUFFIX, server-owned


def slot_offset(values: Any) -> Any:
    """The pool byte offsets of reserve-answer slot values (an int or an int64 array);
    sentinels (negative) stay as they are."""
    import numpy as np

    if isinstance(values, int | np.integer):
        v = int(values)
        return v if v < 0 else v & SLOT_OFFSET_MASK
    arr = np.asarray(values, np.int64)
    return np.where(arr < 0, arr, arr & SLOT_OFFSET_MASK)


def slot_generation(values: Any) -> Any:
    """The slot generations of reserve-answer slot values (non-negative ones)."""
    return values >> SLOT_GEN_SHIFT


def io_job(
    namespace: bytes, key: bytes, rank: int, world: int, offset: int, length: int
) -> tuple[int, tuple[int, int, int, int, int, int]]:
    """An IO job's (flags, a0..a5): flags = rank | world << 8; a0 pool offset, a1 payload
    bytes, a2/a3 the 16-byte key, a4/a5 the 16-byte namespace fingerprint (little-endian u64s)."""
    k = int.from_bytes(key, "little")
    f = int.from_bytes(namespace, "little")
    return rank | world << 8, (offset, length, k & _U64, k >> 64, f & _U64, f >> 64)


def decode_io_job(flags: int, a: tuple[int, ...]) -> tuple[bytes, bytes, int, int, int, int]:
    """Inverse of :func:`io_job`: (namespace, key, rank, world, offset, length)."""
    key = (a[2] | a[3] << 64).to_bytes(KEY_BYTES, "little")
    ns = (a[4] | a[5] << 64).to_bytes(KEY_BYTES, "little")
    return ns, key, flags & 0xFF, flags >> 8, a[0], a[1]


_U64 = (1 << 64) - 1


def read_lock_pid(directory: str) -> int | None:
    """The pid the server wrote into its lock file in ``directory`` (None: no server or unreadable)."""
    try:
        fd = os.open(os.path.join(directory, LOCK_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd) as f:
            return int(f.read(32).strip() or 0) or None
    except (OSError, ValueError):
        return None


def live_server_pid(directory: str) -> int | None:
    """The pid of the live server of the pool directory ``directory``: the one holding its lock."""
    import fcntl

    try:
        fd = os.open(os.path.join(directory, LOCK_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None  # nobody holds the lock: no server
    except BlockingIOError:
        return read_lock_pid(directory)
    finally:
        os.close(fd)

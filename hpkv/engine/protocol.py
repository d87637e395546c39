"""The client ↔ server protocol: file names in the pool directory, mailbox and job-arena layout.

Control path. A client connects to ``server.sock`` (Unix socket) and speaks
newline-delimited JSON for the rare calls: hello, namespace, register_device,
clear, stats, shutdown. The socket also tells the server when a client dies
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
"""
from __future__ import annotations

import os

import numpy as np

from hpkv.engine.keys import KEY_BYTES
from hpkv.native import lib

# Descriptor kinds: defined once, in native/ring.h.
LOOKUP = lib.HPKV_DESC_LOOKUP
RESERVE = lib.HPKV_DESC_RESERVE
COMMIT = lib.HPKV_DESC_COMMIT
PIN = lib.HPKV_DESC_PIN
UNPIN = lib.HPKV_DESC_UNPIN
COPY_SAVE = lib.HPKV_DESC_COPY_SAVE
COPY_LOAD = lib.HPKV_DESC_COPY_LOAD
COMPLETION = lib.HPKV_DESC_COMPLETION
ERROR = lib.HPKV_DESC_ERROR
SHUTDOWN = lib.HPKV_DESC_SHUTDOWN

# Status codes carried in descriptors besides -errno.
E_NO_NAMESPACE = -2001
E_TOO_MANY_KEYS = -2002
E_BAD_REQUEST = -2003
E_WORKER_DIED = -2004

# Files in the pool directory. The server owns them all.
LOCK_FILE = "server.lock"
SOCKET_FILE = "server.sock"
LOG_FILE = "server.log"
POOL_FILE = "pool"
SPAWN_LOCK_FILE = "spawn.lock"
OWNED_SUFFIXES = (".ring", ".bell", ".mbox", ".jobs")   # removed at start-up and shutdown

RING_CAPACITY = 1024

MAILBOX_BYTES = 8 << 20
MAILBOX_HALF = MAILBOX_BYTES // 2
MAX_KEYS_PER_CALL = MAILBOX_HALF // (KEY_BYTES * 8)  # reserve answers 8-byte slots x world size

JOB_SLOTS = 64                      # jobs in flight per worker (arena slots)
JOB_SLOT_BYTES = 128 * 1024         # 8192 (block, slot) pairs per job
MAX_PAIRS_PER_JOB = JOB_SLOT_BYTES // 16
JOB_ARENA_BYTES = JOB_SLOTS * JOB_SLOT_BYTES

SLOT_UNIT = 4096  # pool slots are addressed in 4 KiB units (allocator alignment)


def status_message(status: int) -> str:
    names = {E_NO_NAMESPACE: "namespace not attached", E_TOO_MANY_KEYS: "too many keys in one call",
             E_BAD_REQUEST: "bad request", E_WORKER_DIED: "the transfer worker died during the job"}
    if status in names:
        return names[status]
    return os.strerror(-status) if status < 0 else "ok"


def keys_to_array(keys: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(keys), dtype=f"V{KEY_BYTES}") if keys else np.empty(0, f"V{KEY_BYTES}")

"""Lock-free shared-memory rings: how every job and completion travels between processes.

A :class:`Ring` is a single-producer / single-consumer queue of fixed 64-byte
descriptors (:class:`Desc`; numpy view :data:`DESC_DTYPE`; kinds :class:`Kind`,
all defined once in ``native/ring.h``) in a file under a tmpfs directory (the
engine passes ``HPKV_SHARE_MEM_FILE_PATH``). One process creates it by name,
another attaches the other end, whenever it starts and whoever its parent is::

    req = Ring.create(shm_dir, "client7.req", 4096, role="consumer", doorbell=bell)  # server
    req = Ring.attach(shm_dir, "client7.req", role="producer")                        # client
    req.push(Kind.LOOKUP, seq, key_lo, key_hi)         # client
    d = req.pop(timeout=1.0)                           # server: Desc(kind, flags, status, seq, a0..a5)
    n = req.pop_batch(out_array, timeout=0.01)         # one native call for up to len(out) descriptors

Waiting spins briefly (``spin_us``, default 50 µs ≈ the cost of one cross-vCPU
wake-up on the dev VM) and then sleeps on a shared futex. A wait on a ring whose
peer was killed raises :class:`PeerDead` instead of hanging, even with no
timeout; a peer that closed cleanly gives :class:`PeerClosed`. The kernel itself
wakes the sleeper when the peer's process dies: each process that holds ring ends
runs one small native "keeper" thread whose robust-futex list holds them (it
only sleeps; see ``native/ring.c``, LIVENESS). Where that is unavailable the
sleep falls back to slices of ``slice_ms``, re-checking the peer's pid and start
time after each. The lock-free invariants, the no-lost-wake-up argument and the
liveness protocol are written once, at the top of ``native/ring.c``.

Fan-in: per-client SPSC rings plus a doorbell
---------------------------------------------
The server consumes from many clients. We give every client (every direction of
every connector, transfer worker, IO worker) its own SPSC ring and let the
server sleep on one :class:`Doorbell`, a futex word the server's rings are bound
to. Why not one multi-producer ring?

* SPSC needs no read-modify-write on the hot path: each side owns one counter
  and publishes it with a release store. An MPSC ring needs a CAS or fetch-add
  on a shared tail by every producer, and a slot-ready flag per descriptor, so
  a producer that dies between claiming and filling a slot blocks everyone
  behind it. With per-client rings a dead client loses only its own ring, and
  liveness is per ring (one pid per end).
* No producer contends with another; there is no cache line every client writes.
* Producers ring the doorbell only when the server announced it is sleeping
  (one load otherwise), with the same Dekker fence pairing as a ring, so an
  awake or spinning server costs them nothing and a sleeping one is never
  missed. :meth:`Doorbell.wait` re-checks every bound ring after announcing,
  so it needs no per-push counter.
* The cost is a scan of the bound rings per wake-up, a handful of loads each,
  which is negligible for the tens of clients a node has.

The doorbell's name is recorded in each ring's header, so a producer that
attaches later binds it by itself. A ring or doorbell file is created under a
temporary name with O_EXCL and mode 0600, fallocated, mapped with MAP_POPULATE,
formatted and only then renamed into place; its creator removes it on close.
A file left by a killed creator is replaced by the next ``create``; one whose
creator is alive raises :class:`RingExists` naming the pid.

Limits: both ends must be in the same pid namespace (liveness reads
``/proc/<pid>/stat``) and run as the same user (files are 0600). A ring handle is
used by one thread at a time. A process that holds ring ends has one more thread
(the keeper), so on Python >= 3.12 an ``os.fork()`` after attaching a ring warns
that the process is multi-threaded; the forked child starts its own keeper when
it attaches an end.
"""

from hpkv.ring.desc import DESC_DTYPE, Desc, Kind, new_descs
from hpkv.ring.errors import (
    PeerClosed,
    PeerDead,
    RingBusy,
    RingClosed,
    RingError,
    RingExists,
    RingNotFound,
    RingTimeout,
)
from hpkv.ring.ring import DEFAULT_SLICE_MS, DEFAULT_SPIN_US, Doorbell, PeerInfo, Ring, set_death_notices

__all__ = [
    "Ring",
    "Doorbell",
    "Desc",
    "Kind",
    "DESC_DTYPE",
    "new_descs",
    "PeerInfo",
    "RingError",
    "PeerDead",
    "PeerClosed",
    "RingTimeout",
    "RingExists",
    "RingNotFound",
    "RingBusy",
    "RingClosed",
    "DEFAULT_SPIN_US",
    "DEFAULT_SLICE_MS",
    "set_death_notices",
]

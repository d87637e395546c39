"""Ring and Doorbell: the Python side of native/ring.c.

The single-descriptor calls (push, try_push, pop, try_pop) are methods of the
CPython base type ``hpkv._ringcall.RingCall`` (native/python/ringcall.c): through
cffi a round trip cost ≈ 1.5 µs of argument tuples, conversions and namedtuple
building, several times the busy-polled round trip itself. Everything else is
one cffi call into the native core with pre-built pointer cdata and functions
bound once per object; nothing here loops per descriptor. A handle is used by
one thread at a time: a ring end belongs to one thread of one process, like the
SPSC contract it implements.
"""

from __future__ import annotations

import errno
import os
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from hpkv.common.native import ffi, lib, ringcall
from hpkv.ring.desc import DESC_DTYPE, Desc
from hpkv.ring.errors import PeerClosed, PeerDead, RingBusy, RingClosed, RingError, RingTimeout
from hpkv.ring.shmfile import FileId, check_name, create_file, describe_error, open_existing, unlink_if_ours

__all__ = ["Ring", "Doorbell", "PeerInfo", "DEFAULT_SPIN_US", "DEFAULT_SLICE_MS", "set_death_notices"]

#: Busy-poll time before sleeping. A cross-vCPU wake-up costs ≈ 50 µs here, so
#: spinning up to that long never costs more than twice the best choice.
DEFAULT_SPIN_US = 50.0
#: Longest single futex sleep when the peer's death cannot be notified by the kernel
#: (see hpkv.ring); its liveness is re-checked after each.
DEFAULT_SLICE_MS = 50.0

_ROLES = {"producer": lib.HPKV_RING_PRODUCER, "consumer": lib.HPKV_RING_CONSUMER}
_ROLE_NAMES = {v: k for k, v in _ROLES.items()}
_STATES = {lib.HPKV_END_NONE: "none", lib.HPKV_END_ATTACHED: "attached", lib.HPKV_END_CLOSED: "closed"}
_EINTR = -errno.EINTR
# Native timeouts are float seconds: inf means no limit, nan continues the previous
# wait's deadline (the retry after a signal), negative means do not wait.
_FOREVER = float("inf")
_RESUME = float("nan")

ringcall.bind(int(ffi.cast("uintptr_t", lib.hpkv_ring_call_table())), Desc)


class PeerInfo(NamedTuple):
    """One end's identity as recorded in the file header."""

    role: str
    pid: int
    start_time: int  # clock ticks since boot (/proc/<pid>/stat field 22)
    generation: int  # +2 each time the end is taken or released
    state: str  # "none" (never attached), "attached", "closed"


def _role_id(role: str) -> int:
    try:
        return _ROLES[role]
    except KeyError:
        raise ValueError(f"role must be 'producer' or 'consumer', not {role!r}") from None


def _native_timeout(timeout: float | None) -> float:
    return _FOREVER if timeout is None else timeout


def _check_wait(spin_us: float, slice_ms: float) -> None:
    if not (0 <= spin_us <= 1e9 and 1 <= slice_ms <= 1e9):
        raise ValueError(f"spin_us must be in [0, 1e9] and slice_ms in [1, 1e9] (got {spin_us}, {slice_ms})")


def _set_wait(setter: Any, handle: Any, spin_us: float, slice_ms: float) -> None:
    _check_wait(spin_us, slice_ms)
    setter(handle, int(spin_us * 1e3), int(slice_ms * 1e6))


def set_death_notices(enabled: bool) -> None:
    """Process-wide switch (default on): ends this process claims from now on are registered
    for the kernel's death notice (see :mod:`hpkv.ring`). Off, a peer waiting on them
    sleeps in slices of ``slice_ms`` and reads /proc after each, as on kernels without
    robust futexes. For tests of that path, and as a way out should a kernel misbehave."""
    lib.hpkv_ring_set_death_notices(1 if enabled else 0)


class _BellState:
    """A doorbell handle and the rings bound to it in this process (shared with finalizers)."""

    __slots__ = ("handle", "producers", "consumers", "unwatched", "array")

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.producers: dict[int, Any] = {}  # id -> ring handle whose pushes ring this doorbell
        self.consumers: dict[int, Any] = {}  # id -> ring handle bound to this doorbell
        self.unwatched: set[int] = set()  # ids of consumers that wait() ignores for now
        self.array = ffi.new("hpkv_ring *[]", 0)

    def rebuild(self) -> None:
        watched = [h for k, h in self.consumers.items() if k not in self.unwatched]
        self.array = ffi.new("hpkv_ring *[]", watched)

    def release(self) -> None:
        if self.handle is None:
            return
        for h in self.producers.values():
            lib.hpkv_ring_bind_doorbell(h, ffi.NULL)  # a push must never touch an unmapped doorbell
        self.producers.clear()
        self.consumers.clear()
        self.array = ffi.new("hpkv_ring *[]", 0)
        lib.hpkv_doorbell_unmap(self.handle)
        self.handle = None


def _release_ring(
    handle: Any, key: int, bell: _BellState | None, path: str, ident: FileId, unlink_pid: int
) -> None:
    """Finalizer and close(): unlink (creator only, in its own process), release the end, unmap."""
    if unlink_pid == os.getpid():
        unlink_if_ours(path, ident)
    if bell is not None:
        bell.producers.pop(key, None)
        bell.unwatched.discard(key)
        if bell.consumers.pop(key, None) is not None:
            bell.rebuild()
    lib.hpkv_ring_unmap(handle)  # the native side closes our end only if it is still ours (fork-safe)


def _closed(*_args: Any) -> Any:
    raise RingClosed("the ring was closed in this process; attach it again to use it")


class Ring(ringcall.RingCall):
    """One end (producer or consumer) of a single-producer/single-consumer ring of
    64-byte descriptors (:class:`~hpkv.ring.desc.Desc`, ``DESC_DTYPE``) in shared memory.

    Create it in one process with :meth:`create`, attach the other end from any
    process of the same user with :meth:`attach`. ``try_*`` never block; ``push``
    / ``pop`` spin for ``spin_us`` then sleep on a futex until woken by the peer, by
    its close or by the kernel's notice of its death (or, where that is unavailable,
    in slices of ``slice_ms`` re-checking the peer) and raise :class:`PeerDead` when
    the other process died.

    Single descriptors (methods of the native base type, signatures as written):
    ``push(kind, seq, a0=0, ..., a5=0, *, status=0, flags=0, timeout=None)`` waits
    for room up to ``timeout`` s (None: no limit) and raises :class:`RingTimeout`,
    :class:`PeerDead` / :class:`PeerClosed`; ``try_push(...)`` (same arguments, no
    timeout) returns False when the ring is full; ``pop(timeout=None)`` returns a
    :class:`Desc`, waiting up to ``timeout`` s, and raises :class:`RingTimeout`, or
    :class:`PeerDead` / :class:`PeerClosed` once the ring is empty and the producer
    is gone; ``try_pop()`` returns a :class:`Desc` or None when the ring is empty.
    """

    __slots__ = (
        "name",
        "path",
        "role",
        "capacity",
        "_r",
        "_key",
        "_bell",
        "_own_bell",
        "_fin",
        "_push",
        "_push_wait",
        "_pop",
        "_pop_wait",
        "_last_error",
        "_arr",
        "_arr_ptr",
        "__weakref__",
    )

    if TYPE_CHECKING:  # implemented in native/python/ringcall.c

        def push(
            self,
            kind: int,
            seq: int,
            a0: int = 0,
            a1: int = 0,
            a2: int = 0,
            a3: int = 0,
            a4: int = 0,
            a5: int = 0,
            *,
            status: int = 0,
            flags: int = 0,
            timeout: float | None = None,
        ) -> None: ...

        def try_push(
            self,
            kind: int,
            seq: int,
            a0: int = 0,
            a1: int = 0,
            a2: int = 0,
            a3: int = 0,
            a4: int = 0,
            a5: int = 0,
            *,
            status: int = 0,
            flags: int = 0,
        ) -> bool: ...

        def pop(self, timeout: float | None = None) -> Desc: ...

        def try_pop(self) -> Desc | None: ...

    def __init__(self, handle: Any, name: str, path: str, role: str, ident: FileId, creator: bool) -> None:
        """Private: use :meth:`create` or :meth:`attach`."""
        self.name = name
        self.path = path
        self.role = role
        self.capacity: int = lib.hpkv_ring_capacity(handle)
        self._r = handle
        self._key = id(self)
        self._bell: _BellState | None = None
        self._own_bell: Doorbell | None = None
        self._arr: np.ndarray | None = None
        self._arr_ptr: Any = None
        self._last_error = lib.hpkv_ring_last_error
        wrong = _wrong_role(name, role)
        producer = role == "producer"
        self._set_handle(int(ffi.cast("uintptr_t", handle)), _ROLES[role])
        self._push = lib.hpkv_ring_try_push if producer else wrong
        self._push_wait = lib.hpkv_ring_push_wait if producer else wrong
        self._pop = wrong if producer else lib.hpkv_ring_try_pop
        self._pop_wait = wrong if producer else lib.hpkv_ring_pop_wait
        self._fin = weakref.finalize(
            self, _release_ring, handle, self._key, None, path, ident, os.getpid() if creator else -1
        )

    # ------------------------------------------------------------------ life cycle

    @classmethod
    def create(
        cls,
        directory: str | os.PathLike[str],
        name: str,
        capacity: int = 4096,
        *,
        role: str = "producer",
        doorbell: Doorbell | None = None,
        replace_stale: bool = True,
        spin_us: float = DEFAULT_SPIN_US,
        slice_ms: float = DEFAULT_SLICE_MS,
    ) -> Ring:
        """Creates ring file ``directory/name.ring`` (mode 0600) and holds its ``role`` end.

        ``capacity`` is a power of two (descriptors). A file left by a dead creator is
        replaced (unless ``replace_stale=False``); one whose creator is alive raises
        :class:`RingExists` naming its pid. With ``doorbell``, the doorbell's name is
        recorded in the ring so the producer rings it after each push (a producer that
        attaches later finds it by itself). The creator unlinks the file on close.
        """
        check_name(name, "ring")
        role_id = _role_id(role)
        _check_wait(spin_us, slice_ms)
        if not isinstance(capacity, int) or capacity < 2 or capacity > 1 << 24 or capacity & (capacity - 1):
            raise ValueError(f"capacity must be a power of two between 2 and 2**24, not {capacity!r}")
        directory = os.fspath(directory)
        err = ffi.new("int *")
        path = os.path.join(directory, name + ".ring")

        def map_fn(fd: int) -> Any:
            h = lib.hpkv_ring_map(fd, role_id, 1, capacity, err)
            if h == ffi.NULL:
                raise _map_error(err[0], path, role, None)
            if doorbell is not None:
                lib.hpkv_ring_set_doorbell_name(h, doorbell.name.encode())  # before anyone can attach
            return h

        handle, path, ident = create_file(
            directory, name + ".ring", "ring", replace_stale, map_fn, lib.hpkv_ring_unmap
        )
        ring = cls(handle, name, path, role, ident, creator=True)
        try:
            ring.set_wait(spin_us, slice_ms)
            if doorbell is not None:
                ring._bind(doorbell, owned=False)
        except BaseException:
            ring.close()  # removes the file it just published
            raise
        return ring

    @classmethod
    def attach(
        cls,
        directory: str | os.PathLike[str],
        name: str,
        *,
        role: str = "consumer",
        doorbell: Doorbell | None = None,
        wait: float = 0.0,
        spin_us: float = DEFAULT_SPIN_US,
        slice_ms: float = DEFAULT_SLICE_MS,
    ) -> Ring:
        """Attaches the ``role`` end of an existing ring (waiting up to ``wait`` s for the file).

        Raises :class:`RingBusy` if a live process holds that end; an end whose holder
        died is taken over (the counters continue where it stopped). A producer binds
        the ring's doorbell by itself; a consumer that wants :meth:`Doorbell.wait` to
        watch this ring passes the (owned) ``doorbell``.
        """
        check_name(name, "ring")
        role_id = _role_id(role)
        _check_wait(spin_us, slice_ms)
        directory = os.fspath(directory)
        fd, path = open_existing(directory, name + ".ring", "ring", wait)
        err = ffi.new("int *")
        try:
            handle = lib.hpkv_ring_map(fd, role_id, 0, 0, err)
            if handle == ffi.NULL:
                raise _map_error(err[0], path, role, fd)
            st = os.fstat(fd)
        finally:
            os.close(fd)
        ring = cls(handle, name, path, role, (st.st_dev, st.st_ino), creator=False)
        try:
            ring.set_wait(spin_us, slice_ms)
            recorded = ring.doorbell_name
            if doorbell is not None:
                if recorded != doorbell.name:
                    raise RingError(
                        f"ring {path} was created with doorbell {recorded or 'none'!r}, not "
                        f"{doorbell.name!r}: pass doorbell= to Ring.create so both ends agree"
                    )
                ring._bind(doorbell, owned=False)
            elif recorded and role == "producer":
                ring._bind(Doorbell.attach(directory, recorded), owned=True)
        except BaseException:
            ring.close()
            raise
        return ring

    def _bind(self, doorbell: Doorbell, owned: bool) -> None:
        state = doorbell._state
        if state.handle is None:
            raise RingClosed(f"doorbell {doorbell.path} is closed")
        if self.role == "producer":
            lib.hpkv_ring_bind_doorbell(self._r, state.handle)
            state.producers[self._key] = self._r
        else:
            if not doorbell.owner_end:
                raise RingError(f"only the doorbell's creator waits on it; {doorbell.path} was attached")
            state.consumers[self._key] = self._r
            state.rebuild()
        self._bell = state
        if owned:
            self._own_bell = doorbell
        # The finalizer must unbind us from this doorbell: re-create it with the state.
        args = self._fin.detach()
        if args is not None:
            _, _, fargs, _ = args
            self._fin = weakref.finalize(self, _release_ring, fargs[0], fargs[1], state, *fargs[3:])

    def watch(self, on: bool) -> None:
        """A consumer bound to a doorbell: whether the doorbell's :meth:`Doorbell.wait` returns
        when this ring has work. A consumer that will not pop this ring for a while (its peer's
        last call is still being answered) unwatches it, so the peer's pushes cannot keep the
        waiter spinning; it rings the doorbell when it watches again."""
        state = self._bell
        if self.role != "consumer" or state is None or self._key not in state.consumers:
            raise RingError(f"ring {self.path}: only a consumer bound to a doorbell is watched")
        if on == (self._key not in state.unwatched):
            return
        if on:
            state.unwatched.discard(self._key)
        else:
            state.unwatched.add(self._key)
        state.rebuild()

    def close(self, unlink: bool | None = None) -> None:
        """Releases this end (the peer's waits then raise :class:`PeerClosed`) and unmaps.

        The creator also removes the file (``unlink=None`` means: if we created it).
        Safe to call twice.
        """
        if self._r is None:
            return
        self._set_handle(
            0, _ROLES[self.role]
        )  # first: the native calls must see "closed", not an unmapped ring
        args = self._fin.detach()
        if args is not None:
            _, _, (handle, key, bell, path, ident, unlink_pid), _ = args
            if unlink is not None:
                unlink_pid = os.getpid() if unlink else -1
            _release_ring(handle, key, bell, path, ident, unlink_pid)
        self._r = None
        for attr in ("_push", "_push_wait", "_pop", "_pop_wait"):
            setattr(self, attr, _closed)
        self._arr = self._arr_ptr = None
        if self._own_bell is not None:
            self._own_bell.close()
            self._own_bell = None

    def unlink(self) -> bool:
        """Removes the ring's file name now (attached processes keep their mapping)."""
        args = self._fin.peek()
        if args is None:
            return False
        _, _, (_, _, _, path, ident, _), _ = args
        return unlink_if_ours(path, ident)

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._r is None else f"depth={self.depth}/{self.capacity}"
        return f"<Ring {self.name!r} {self.role} {state}>"

    # ------------------------------------------------------------------ batches (single descriptors: RingCall)

    def push_batch(self, descs: np.ndarray, count: int | None = None, timeout: float | None = 0.0) -> int:
        """Pushes ``descs[:count]`` (a ``DESC_DTYPE`` array) in order; returns how many went in.

        ``timeout=0`` pushes what fits now; otherwise waits for room up to ``timeout``
        s (None: until all are in). Raises :class:`PeerDead` if the consumer died
        while we waited (``exc.done`` says how many had been pushed).
        """
        ptr, n = self._batch_ptr(descs, count, writable=False)
        r = self._r
        done = self._push(r, ptr, n)
        if done == n or timeout == 0:
            return done
        t = _native_timeout(timeout)
        while done < n:
            done += self._push_wait(r, ptr + done, n - done, t)
            t = _RESUME
            if done < n:
                rc = self._last_error(r)
                if rc == 0:
                    break  # timeout: report the partial count
                try:
                    self._wait_failed(rc, timeout, "room")
                except PeerDead as exc:
                    exc.done = done  # type: ignore[attr-defined]
                    raise
        return done

    def pop_batch(self, out: np.ndarray, max_n: int | None = None, timeout: float | None = 0.0) -> int:
        """Pops up to ``max_n`` (default ``len(out)``) descriptors into ``out[:n]``; returns n.

        ``timeout=0`` takes what is there now; otherwise waits up to ``timeout`` s (None:
        no limit) for at least one and returns 0 on timeout. Raises :class:`PeerDead` /
        :class:`PeerClosed` once the ring is empty and the producer is gone.
        """
        ptr, n = self._batch_ptr(out, max_n, writable=True)
        r = self._r
        if timeout == 0:
            return self._pop(r, ptr, n)
        got = self._pop_wait(r, ptr, n, _native_timeout(timeout))
        while got < 0:
            self._wait_failed(got, timeout, "a descriptor")
            got = self._pop_wait(r, ptr, n, _RESUME)
        return got

    # ------------------------------------------------------------------ state

    @property
    def depth(self) -> int:
        """Descriptors in the ring now (a snapshot)."""
        return lib.hpkv_ring_depth(self._handle())

    @property
    def closed(self) -> bool:
        return self._r is None

    @property
    def doorbell_name(self) -> str:
        """The doorbell recorded in the ring's header ('' for none)."""
        buf = ffi.new("char[]", 64)
        n = lib.hpkv_ring_get_doorbell_name(self._handle(), buf, 64)
        return ffi.string(buf).decode() if n > 0 else ""

    def end(self, role: str) -> PeerInfo:
        """The identity recorded for one end (``'producer'`` or ``'consumer'``)."""
        pid, start, gen, state = (
            ffi.new("int32_t *"),
            ffi.new("uint64_t *"),
            ffi.new("uint32_t *"),
            ffi.new("uint32_t *"),
        )
        lib.hpkv_ring_end_info(self._handle(), _role_id(role), pid, start, gen, state)
        return PeerInfo(role, pid[0], start[0], gen[0], _STATES.get(state[0], str(state[0])))

    @property
    def peer(self) -> PeerInfo:
        """The other end's identity (pid, start time, generation, state)."""
        return self.end("consumer" if self.role == "producer" else "producer")

    def check_peer(self) -> None:
        """Raises :class:`PeerDead` / :class:`PeerClosed` if the other end is gone (reads /proc)."""
        rc = lib.hpkv_ring_peer_status(self._handle())
        if rc:
            self._wait_failed(rc, None, "")

    @property
    def peer_alive(self) -> bool:
        """True if the other end is attached and running, or has not attached yet."""
        return lib.hpkv_ring_peer_status(self._handle()) == 0

    def set_wait(self, spin_us: float = DEFAULT_SPIN_US, slice_ms: float = DEFAULT_SLICE_MS) -> None:
        """Tunes blocking waits: busy-poll ``spin_us`` µs, then sleep (in slices of at most
        ``slice_ms`` when the peer's death cannot be notified)."""
        _set_wait(lib.hpkv_ring_set_wait, self._handle(), spin_us, slice_ms)

    def stats(self) -> dict[str, int]:
        """This handle's wait counters: futex sleeps entered, futex wakes sent."""
        sleeps, wakes = ffi.new("uint64_t *"), ffi.new("uint64_t *")
        lib.hpkv_ring_stats(self._handle(), sleeps, wakes)
        return {"sleeps": sleeps[0], "wakes": wakes[0], "depth": self.depth}

    # ------------------------------------------------------------------ helpers

    def _handle(self) -> Any:
        if self._r is None:
            _closed()
        return self._r

    def _batch_ptr(self, arr: np.ndarray, count: int | None, writable: bool) -> tuple[Any, int]:
        if arr is self._arr:  # same array as last call: reuse its pointer (from_buffer costs ≈ 0.3 µs)
            ptr = self._arr_ptr
        else:
            if (
                not isinstance(arr, np.ndarray)
                or arr.dtype != DESC_DTYPE
                or arr.ndim != 1
                or not arr.flags.c_contiguous
            ):
                raise TypeError(
                    "expected a 1-D C-contiguous numpy array of hpkv.ring.DESC_DTYPE "
                    "(make one with hpkv.ring.new_descs(n))"
                )
            if writable and not arr.flags.writeable:
                raise ValueError("pop_batch needs a writable array")
            ptr = ffi.from_buffer("hpkv_desc[]", arr, require_writable=writable)
            if self._r is not None:
                self._arr, self._arr_ptr = arr, ptr
        n = len(arr)
        if count is not None:
            if count < 0 or count > n:
                raise ValueError(f"count {count} outside the array's 0..{n}")
            n = count
        return ptr, n

    def _misuse(self, verb: str) -> None:
        """Called by the native calls on the wrong end (``verb``: 'push to' / 'pop from')."""
        raise _role_error(self.name, self.role, verb)

    def _wait_failed(self, rc: int, timeout: float | None, what: str) -> None:
        """Turns a failed wait into an exception; returns only for a signal (caller retries)."""
        if rc == _EINTR:
            return  # Python runs signal handlers when we return; the caller waits again
        peer = self.peer
        who = f"the {peer.role} (pid {peer.pid})"
        if rc == lib.HPKV_RING_EPEER_DEAD:
            raise PeerDead(
                f"ring {self.path}: {who} died without closing its end; "
                "its side of the work is lost: recreate or re-attach the ring"
            )
        if rc == lib.HPKV_RING_EPEER_CLOSED:
            raise PeerClosed(f"ring {self.path}: {who} closed its end")
        if rc == 0:
            raise RingTimeout(
                f"ring {self.path}: waited {timeout} s for {what} "
                f"(depth {self.depth}/{self.capacity}; {who} is alive)"
            )
        raise RingError(describe_error(rc, self.path))


def _role_error(name: str, role: str, verb: str) -> RingError:
    return RingError(f"ring {name!r}: this is the {role} end, it cannot {verb} the ring")


def _wrong_role(name: str, role: str) -> Any:
    def wrong(*_args: Any) -> Any:
        raise _role_error(name, role, "pop from" if role == "producer" else "push to")

    return wrong


def _map_error(rc: int, path: str, role: str, fd: int | None) -> Exception:
    if rc == lib.HPKV_RING_EBUSY:
        holder = "another live process"
        if fd is not None:
            data = os.pread(fd, 4096, 0)
            pid = lib.hpkv_shm_end_pid(ffi.from_buffer(data), len(data), _role_id(role))
            holder = f"live pid {pid}"
        return RingBusy(
            f"ring {path}: the {role} end is held by {holder}; a ring has one producer "
            "and one consumer: close it there first, or use another ring"
        )
    if rc == lib.HPKV_RING_ECAPACITY:
        return ValueError(describe_error(rc, path))
    if rc < 0 and -rc < 1000:
        return OSError(-rc, f"cannot map ring {path}: {os.strerror(-rc)}")
    return RingError(describe_error(rc, path))


class Doorbell:
    """A futex word in shared memory that one consumer of many rings sleeps on.

    The consumer creates it (:meth:`create`) and passes it to the rings it consumes;
    producers ring it after a push only when the consumer announced it is sleeping,
    so an awake consumer costs producers one load. :meth:`wait` returns as soon as
    one of this process's bound rings is non-empty or the doorbell was rung.
    """

    __slots__ = ("name", "path", "owner_end", "_state", "_fin", "__weakref__")

    def __init__(self, handle: Any, name: str, path: str, ident: FileId, owner: bool) -> None:
        """Private: use :meth:`create` or :meth:`attach`."""
        self.name = name
        self.path = path
        self.owner_end = owner
        self._state = _BellState(handle)
        self._fin = weakref.finalize(
            self, _release_bell, self._state, path, ident, os.getpid() if owner else -1
        )

    @classmethod
    def create(
        cls,
        directory: str | os.PathLike[str],
        name: str,
        *,
        replace_stale: bool = True,
        spin_us: float = DEFAULT_SPIN_US,
    ) -> Doorbell:
        """Creates ``directory/name.bell`` (mode 0600); the creator is the one that waits."""
        check_name(name, "doorbell")
        _check_wait(spin_us, DEFAULT_SLICE_MS)
        directory = os.fspath(directory)
        err = ffi.new("int *")
        path = os.path.join(directory, name + ".bell")

        def map_fn(fd: int) -> Any:
            h = lib.hpkv_doorbell_map(fd, 1, err)
            if h == ffi.NULL:
                raise RingError(describe_error(err[0], path))
            return h

        handle, path, ident = create_file(
            directory, name + ".bell", "doorbell", replace_stale, map_fn, lib.hpkv_doorbell_unmap
        )
        bell = cls(handle, name, path, ident, owner=True)
        bell.set_spin(spin_us)
        return bell

    @classmethod
    def attach(cls, directory: str | os.PathLike[str], name: str, *, wait: float = 0.0) -> Doorbell:
        """Attaches an existing doorbell to ring it (producers)."""
        check_name(name, "doorbell")
        fd, path = open_existing(os.fspath(directory), name + ".bell", "doorbell", wait)
        err = ffi.new("int *")
        try:
            handle = lib.hpkv_doorbell_map(fd, 0, err)
            if handle == ffi.NULL:
                raise RingError(describe_error(err[0], path))
            st = os.fstat(fd)
        finally:
            os.close(fd)
        return cls(handle, name, path, (st.st_dev, st.st_ino), owner=False)

    def ring(self) -> None:
        """Wakes the waiter; if it is not waiting, its next :meth:`wait` returns at once."""
        lib.hpkv_doorbell_ring(self._handle())

    def wait(self, timeout: float | None = None) -> bool:
        """Sleeps until a bound ring is non-empty or the doorbell is rung: True, or False on timeout.

        Spins ``spin_us`` first. Only the creator waits. Does not report dead producers:
        after a wake-up with nothing to pop, ask the rings (:meth:`Ring.check_peer`).
        """
        if not self.owner_end:
            raise RingError(f"doorbell {self.path}: only its creator waits on it")
        state = self._state
        t = _native_timeout(timeout)
        while True:
            if state.handle is None:
                _closed()
            rc = lib.hpkv_doorbell_wait(state.handle, state.array, len(state.array), t)
            if rc >= 0:
                return rc > 0
            if rc != _EINTR:
                raise RingError(describe_error(rc, self.path))
            t = _RESUME  # after a signal: same deadline

    def set_spin(self, spin_us: float = DEFAULT_SPIN_US) -> None:
        """Busy-poll ``spin_us`` µs in :meth:`wait` before sleeping."""
        _check_wait(spin_us, DEFAULT_SLICE_MS)
        lib.hpkv_doorbell_set_spin(self._handle(), int(spin_us * 1e3))

    @property
    def owner(self) -> PeerInfo:
        """The waiting process's identity as recorded in the doorbell."""
        pid, start, gen, state = (
            ffi.new("int32_t *"),
            ffi.new("uint64_t *"),
            ffi.new("uint32_t *"),
            ffi.new("uint32_t *"),
        )
        lib.hpkv_doorbell_owner_info(self._handle(), pid, start, gen, state)
        return PeerInfo("consumer", pid[0], start[0], gen[0], _STATES.get(state[0], str(state[0])))

    def stats(self) -> dict[str, int]:
        sleeps, wakes = ffi.new("uint64_t *"), ffi.new("uint64_t *")
        lib.hpkv_doorbell_stats(self._handle(), sleeps, wakes)
        return {"sleeps": sleeps[0], "wakes": wakes[0], "rings": len(self._state.consumers)}

    def close(self, unlink: bool | None = None) -> None:
        """Unbinds the rings of this process, unmaps; the creator also removes the file."""
        args = self._fin.detach()
        if args is None:
            return
        _, _, (state, path, ident, unlink_pid), _ = args
        if unlink is not None:
            unlink_pid = os.getpid() if unlink else -1
        _release_bell(state, path, ident, unlink_pid)

    def unlink(self) -> bool:
        """Removes the doorbell's file name now."""
        args = self._fin.peek()
        if args is None:
            return False
        _, _, (_, path, ident, _), _ = args
        return unlink_if_ours(path, ident)

    def _handle(self) -> Any:
        if self._state.handle is None:
            _closed()
        return self._state.handle

    def __enter__(self) -> Doorbell:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Doorbell {self.name!r} {'owner' if self.owner_end else 'ringer'}>"


def _release_bell(state: _BellState, path: str, ident: FileId, unlink_pid: int) -> None:
    if unlink_pid == os.getpid():
        unlink_if_ours(path, ident)
    state.release()

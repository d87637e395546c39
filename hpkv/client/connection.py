"""Client library of the hpkv server, used by the connectors, the CLI and the tests.

``connect(cfg)`` attaches to the server of the configured pool directory, or
starts one (``hpkv serve --auto``, detached into its own process group) and waits for it
with a bound. Every call is bounded too: a slow or dead server raises
:class:`HpkvUnavailable`, and the caller (the connector) falls back to recomputing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpkv.client.spawn import open_in_pool_dir, spawn_server
from hpkv.common import shm
from hpkv.common.proc import pid_alive
from hpkv.common.security import peer_credentials
from hpkv.config import Config, load_config
from hpkv.protocol import wire as P
from hpkv.protocol.errors import HpkvError, HpkvUnavailable, error_for, raise_refusal
from hpkv.protocol.keys import KEY_BYTES
from hpkv.ring import PeerDead, Ring, RingError, RingTimeout

log = logging.getLogger("hpkv.client")

_CALL_NAMES = {
    P.LOOKUP: "lookup",
    P.RESERVE: "reserve",
    P.COMMIT: "commit",
    P.PIN: "pin",
    P.UNPIN: "unpin",
    P.PROMOTE: "promote",
}

HOT_CALL_SPIN_US = 300.0
PROMOTE_GRACE_S = 2.0  # beyond a promote's timeout, for the server's answer to arrive


def promote_timeout(nbytes: int) -> float:
    """How long a promote of ``nbytes`` may take: generous, ≥ 5 s at 200 MB/s."""
    return max(5.0, nbytes / 200e6)


def _map_array(path: str) -> np.ndarray:
    return np.frombuffer(shm.map_file(path), dtype=np.uint8)


@dataclass(frozen=True)
class NamespaceHandle:
    ns_id: int
    slot_bytes: int
    world_size: int


class HpkvClient:
    def __init__(self, directory: str, sock: socket.socket, hello: dict[str, Any], call_timeout: float):
        self.dir = directory
        self._sock = sock
        self._sock_file = sock.makefile("rb")
        self._ctl_lock = threading.Lock()
        self._hot_lock = threading.Lock()
        self.client_id = hello["client_id"]
        self.server_pid = hello["server_pid"]
        self.pool_path = hello["pool"]
        self.pool_size = hello["pool_size"]
        self.storage = hello.get("storage")
        self.call_timeout = call_timeout
        self._req = Ring.attach(directory, hello["req"], role="producer")
        # A hot call's answer takes tens of µs; sleeping would add a ≈50 µs
        # cross-vCPU wake-up on these VMs (`hpkv bench ring`), so spin a little longer.
        self._resp = Ring.attach(directory, hello["resp"], role="consumer", spin_us=HOT_CALL_SPIN_US)
        self._mbox = _map_array(hello["mailbox"])
        self._seq = 0
        self._namespaces: dict[int, NamespaceHandle] = {}
        self._broken: str | None = None
        self.devices: list[DeviceHandle] = []

    # ---------------------------------------------------------------- control calls (socket)
    def call(self, op: str, **kwargs: Any) -> dict[str, Any]:
        with self._ctl_lock:
            try:
                self._sock.settimeout(max(self.call_timeout, 30.0))
                self._sock.sendall(json.dumps({"op": op, **kwargs}).encode() + b"\n")
                line = self._sock_file.readline()
            except OSError as exc:
                raise HpkvUnavailable(f"hpkv server connection failed during {op!r}: {exc}") from None
        if not line:
            raise HpkvUnavailable(f"the hpkv server closed the connection during {op!r}")
        reply = json.loads(line)
        raise_refusal(reply, f"hpkv {op!r}")
        return reply

    def attach_namespace(
        self,
        fingerprint: str,
        world_size: int,
        shard_bytes: int,
        name: str = "",
        rank: int | None = None,
        block_tokens: int = 0,
    ) -> NamespaceHandle:
        """Register a namespace (idempotent); ``rank`` says which shard this client writes."""
        extra = {} if rank is None else {"rank": rank}
        r = self.call(
            "namespace",
            fingerprint=fingerprint,
            world_size=world_size,
            shard_bytes=shard_bytes,
            name=name,
            block_tokens=block_tokens,
            **extra,
        )
        handle = NamespaceHandle(r["ns_id"], r["slot_bytes"], world_size)
        self._namespaces[handle.ns_id] = handle
        return handle

    def clear(self, ns_id: int) -> int:
        return self.call("clear", ns_id=ns_id)["dropped"]

    def stats(self) -> dict[str, Any]:
        return self.call("stats")["stats"]

    def shutdown_server(self) -> None:
        self.call("shutdown", pid=os.getpid())

    # ---------------------------------------------------------------- hot calls (rings)
    def _rpc(
        self,
        kind: int,
        ns_id: int,
        keys: Sequence[bytes],
        a2: int = 0,
        flags: int = 0,
        timeout: float | None = None,
    ) -> tuple[int, int]:
        n = len(keys)
        if n > P.MAX_KEYS_PER_CALL:
            raise HpkvError(f"{n} keys in one call; at most {P.MAX_KEYS_PER_CALL}")
        if self._broken:
            raise HpkvUnavailable(self._broken)
        if n:
            self._mbox[: n * KEY_BYTES] = np.frombuffer(b"".join(keys), np.uint8)
        self._seq += 1
        seq = self._seq
        limit = self.call_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        try:
            self._req.push(kind, seq, ns_id, n, a2, flags=flags, timeout=limit)
            while True:
                d = self._resp.pop(timeout=max(deadline - time.monotonic(), 0.0))
                if d.seq == seq:
                    break
        except RingTimeout:
            self._broken = f"the hpkv server (pid {self.server_pid}) did not answer within {limit:g}s"
            raise HpkvUnavailable(self._broken) from None
        except RingError as exc:
            self._broken = f"the hpkv server (pid {self.server_pid}) is gone: {exc}"
            raise HpkvUnavailable(self._broken) from None
        if d.status < 0:
            raise error_for(d.status, f"hpkv {_CALL_NAMES.get(kind, kind)} call")
        return d.a0, d.a1

    def lookup(self, ns_id: int, keys: Sequence[bytes]) -> tuple[int, list[int]]:
        """(number of leading keys present, tier of each: 1 DRAM, 2 storage)."""
        with self._hot_lock:
            hit, _ = self._rpc(P.LOOKUP, ns_id, keys)
            return hit, self._mbox[P.MAILBOX_HALF : P.MAILBOX_HALF + hit].tolist()

    def _batches(self, ns_id: int, keys: Sequence[bytes]) -> list[Sequence[bytes]]:
        """Split a reserve/pin/promote whose answer (8 bytes per rank per key) would not fit
        the mailbox: at world sizes above 16 fewer than MAX_KEYS_PER_CALL keys fit."""
        ns = self._namespaces.get(ns_id)
        per = P.max_keys_per_call(ns.world_size) if ns else P.MAX_KEYS_PER_CALL
        if len(keys) <= per:
            return [keys]
        return [keys[i : i + per] for i in range(0, len(keys), per)]

    def _rows(
        self, kind: int, ns_id: int, keys: Sequence[bytes], a2: int = 0, timeout: float | None = None
    ) -> np.ndarray:
        out = []
        world = 1
        for batch in self._batches(ns_id, keys):
            world, _ = self._rpc(kind, ns_id, batch, a2, timeout=timeout)
            out.append(self._answer(len(batch), world))
        return np.concatenate(out) if len(out) > 1 else (out[0] if out else np.empty((0, world), np.int64))

    def reserve(self, ns_id: int, keys: Sequence[bytes]) -> np.ndarray:
        """Slot values ``[len(keys), world]``: the pool byte offset with the slot's generation
        above it (:func:`hpkv.protocol.wire.slot_offset` strips it; a save job passes the value
        as it is); -1 = already there, -2 = pool full or another namespace's key."""
        with self._hot_lock:
            return self._rows(P.RESERVE, ns_id, keys)

    def commit(self, ns_id: int, keys: Sequence[bytes], rank: int = 0) -> int:
        with self._hot_lock:
            return self._rpc(P.COMMIT, ns_id, keys, rank)[0]

    def abort(self, ns_id: int, keys: Sequence[bytes]) -> None:
        """The shards of these reserved keys could not be written: free their slots."""
        with self._hot_lock:
            self._rpc(P.COMMIT, ns_id, keys, flags=P.FLAG_ABORT)

    def pin(self, ns_id: int, keys: Sequence[bytes]) -> np.ndarray:
        """Pin keys; pool offsets ``[len(keys), world]`` (-1 where not in DRAM)."""
        with self._hot_lock:
            return self._rows(P.PIN, ns_id, keys)

    def promote(self, ns_id: int, keys: Sequence[bytes], timeout: float | None = None) -> np.ndarray:
        """Load blocks into the pool and pin them, like :meth:`pin`: pool offsets ``[len(keys), world]``.

        Blocks already in DRAM are pinned at once; storage-resident ones (lookup tier 2)
        are read by the IO workers first. A row is -1 where the block could not be
        loaded (no file, corrupt file — quarantined —, IO error, pool full, or not
        read within ``timeout``); recompute those. Unpin the keys whose row is not -1
        once copied. ``timeout`` defaults to ``max(5 s, bytes / 200 MB/s)``; the
        server answers by then with what it has, so a slow disk never blocks the caller
        longer.
        """
        if timeout is None:
            ns = self._namespaces.get(ns_id)
            timeout = promote_timeout(len(keys) * ns.slot_bytes * ns.world_size) if ns else 30.0
        with self._hot_lock:
            return self._rows(
                P.PROMOTE, ns_id, keys, max(1, int(timeout * 1000)), timeout=timeout + PROMOTE_GRACE_S
            )

    def unpin(self, ns_id: int, keys: Sequence[bytes]) -> None:
        with self._hot_lock:
            self._rpc(P.UNPIN, ns_id, keys)

    def _answer(self, n: int, world: int) -> np.ndarray:
        nbytes = n * world * 8
        return self._mbox[P.MAILBOX_HALF : P.MAILBOX_HALF + nbytes].view(np.int64).reshape(n, world).copy()

    # ---------------------------------------------------------------- devices
    def register_device(
        self,
        ns_id: int,
        *,
        rank: int,
        regions: list[dict[str, Any]],
        layer_bases: list[tuple[int, int]],
        block_stride: int,
        page_bytes: int,
        num_blocks: int,
        device: str = "cpu",
        numa_node: int | None = None,
        cuda: dict[str, Any] | None = None,
    ) -> DeviceHandle:
        """Export a device's KV memory to new transfer workers: shared-memory files (CPU), or a
        GPU allocation over CUDA IPC with the engine's events (``cuda``, see hpkv.transfer_workers.cuda)."""
        extra = {} if cuda is None else {"cuda": cuda}
        r = self.call(
            "register_device",
            **extra,
            ns_id=ns_id,
            rank=rank,
            regions=regions,
            layer_bases=[list(x) for x in layer_bases],
            block_stride=block_stride,
            page_bytes=page_bytes,
            num_blocks=num_blocks,
            device=device,
            numa_node=numa_node,
        )
        dev = DeviceHandle(self.dir, r["device_id"], r["workers"], self.call_timeout, self.server_pid)
        self.devices.append(dev)
        return dev

    def close(self) -> None:
        for dev in self.devices:
            dev.close()
        for ring in (self._req, self._resp):
            ring.close()  # never raises; safe twice
        try:
            self._sock_file.close()
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> HpkvClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _WorkerLink:
    def __init__(self, directory: str, info: dict[str, Any]):
        self.req = Ring.attach(directory, info["req"], role="producer", wait=5.0)
        self.resp = Ring.attach(directory, info["resp"], role="consumer", wait=5.0)
        self.jobs = _map_array(info["jobs"]).view(np.int64).reshape(P.JOB_SLOTS, -1)
        self.seq = 0
        self.inflight: set[int] = set()
        self.done: dict[int, int] = {}  # seq -> status, received but not yet claimed


class DeviceHandle:
    """Copy jobs to the device's transfer workers; each batch is one native copy in a worker."""

    def __init__(
        self, directory: str, dev_id: int, workers: list[dict[str, Any]], timeout: float, server_pid: int = 0
    ):
        self.dev_id = dev_id
        self.server_pid = server_pid
        self.timeout = timeout
        self.links = [_WorkerLink(directory, w) for w in workers]
        self._lock = threading.Lock()
        self._rr = 0

    def submit(
        self, kind: int, blocks: np.ndarray, offsets: np.ndarray, event: int = -1
    ) -> list[tuple[int, int]]:
        """Post a batch (split across workers); returns (worker, seq) tickets. On a CUDA device,
        ``event`` >= 0 makes the copies wait for the engine's event of that index."""
        blocks = np.ascontiguousarray(blocks, np.int64)
        offsets = np.ascontiguousarray(offsets, np.int64)
        tickets = []
        n = len(blocks)
        per = -(-n // len(self.links)) if n else 0
        per = min(max(per, 1), P.MAX_PAIRS_PER_JOB)
        with self._lock:
            for start in range(0, n, per):
                w = self._rr % len(self.links)
                self._rr += 1
                link = self.links[w]
                while len(link.inflight) >= P.JOB_SLOTS:
                    if not self._collect(link, time.monotonic() + self.timeout):
                        raise HpkvUnavailable(f"transfer worker {w} answered nothing for {self.timeout:g}s")
                link.seq += 1
                seq = link.seq
                m = min(per, n - start)
                job = link.jobs[seq % P.JOB_SLOTS]
                job[:m] = blocks[start : start + m]
                job[m : 2 * m] = offsets[start : start + m]
                link.req.push(kind, seq, m, event + 1, timeout=self.timeout)
                link.inflight.add(seq)
                tickets.append((w, seq))
        return tickets

    def wait(
        self, tickets: list[tuple[int, int]], timeout: float | None = None
    ) -> dict[tuple[int, int], int]:
        """Status per ticket (0 ok, <0 failed); a ticket not answered in time counts as failed."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        results: dict[tuple[int, int], int] = {}
        with self._lock:
            for w, seq in tickets:
                link = self.links[w]
                while seq not in link.done and seq in link.inflight:
                    if not self._collect(link, deadline):
                        break
                results[(w, seq)] = link.done.pop(seq, -errno.ETIMEDOUT)
        return results

    def poll(self, tickets: list[tuple[int, int]]) -> dict[tuple[int, int], int]:
        """The status of each ticket that has completed by now (never waits)."""
        out: dict[tuple[int, int], int] = {}
        with self._lock:
            for link in self.links:
                while link.inflight and self._collect(link, 0.0):
                    pass
            for w, seq in tickets:
                link = self.links[w]
                if seq in link.done:
                    out[(w, seq)] = link.done.pop(seq)
                elif seq not in link.inflight:
                    out[(w, seq)] = -errno.ETIMEDOUT  # dropped: never answered
        return out

    def _collect(self, link: _WorkerLink, deadline: float) -> bool:
        """Receive one completion of ``link``; False when the deadline passed."""
        try:
            d = link.resp.pop(timeout=max(deadline - time.monotonic(), 0.0))
        except RingTimeout:
            return False
        except PeerDead:
            # The worker died; the server answers its jobs with errors: keep waiting for
            # that, unless the server is gone too.
            if self.server_pid and not pid_alive(self.server_pid):
                return False
            time.sleep(0.01)
            return time.monotonic() < deadline
        if d.seq in link.inflight:
            link.inflight.discard(d.seq)
            link.done[d.seq] = d.status
        return True

    def save(self, blocks: np.ndarray, offsets: np.ndarray) -> bool:
        """Device blocks → pool offsets; True when every batch succeeded."""
        res = self.wait(self.submit(P.COPY_SAVE, blocks, offsets))
        return all(s == 0 for s in res.values())

    def load(self, blocks: np.ndarray, offsets: np.ndarray) -> bool:
        res = self.wait(self.submit(P.COPY_LOAD, blocks, offsets))
        return all(s == 0 for s in res.values())

    def close(self) -> None:
        for link in self.links:
            for ring in (link.req, link.resp):
                ring.close()  # never raises; safe twice


# -------------------------------------------------------------------- connect / auto-spawn
def _try_connect(sock_path: str, timeout: float) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(sock_path)
    except (TimeoutError, FileNotFoundError, ConnectionRefusedError):
        s.close()
        return None
    except BlockingIOError:  # a Unix socket's full backlog: EAGAIN at once, not a timeout
        s.close()
        raise HpkvUnavailable(
            f"the hpkv server at {sock_path} takes no more connections (its backlog is full: "
            "it is overloaded or out of file descriptors, see its server.log); try again later"
        ) from None
    try:
        _check_server(s, os.path.dirname(sock_path))
    except BaseException:
        s.close()
        raise
    return s


def _check_server(sock: socket.socket, directory: str) -> None:
    """Talk only to a server in a directory nobody else can write, run by that directory's
    owner: the owner is us, or (HPKV_ALLOW_GROUP on the server) its group is one of ours.
    Another local user's look-alike socket would otherwise receive our hello and keys."""
    import stat as _stat

    st = os.lstat(directory)
    _, server_uid, _ = peer_credentials(sock)
    me = os.geteuid()
    problem = None
    if not _stat.S_ISDIR(st.st_mode) or st.st_mode & 0o022:
        problem = f"it is not a directory closed to other writers (mode {_stat.filemode(st.st_mode)})"
    elif st.st_uid != server_uid:
        problem = f"the server runs as uid {server_uid} but the directory belongs to uid {st.st_uid}"
    elif st.st_uid != me and st.st_gid not in (*os.getgroups(), os.getegid()):
        problem = f"it belongs to uid {st.st_uid}, not to us (uid {me}) nor shared with our groups"
    if problem:
        raise HpkvError(
            f"refusing the hpkv server in {directory}: {problem}. Another user may have "
            f"made it; remove it (as its owner or root) or set HPKV_SHARE_MEM_FILE_PATH "
            f"to a directory of your own"
        )


class _ServerLeaving(HpkvUnavailable):
    """The server we reached is stopping: it refused us, or closed or reset the connection at once."""


def _handshake(sock: socket.socket, msg: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    """Send the first call of a connection and return its reply, within ``timeout``."""
    sock.settimeout(timeout)
    reset: OSError | None = None
    try:
        sock.sendall(json.dumps(msg).encode() + b"\n")
    except (ConnectionResetError, BrokenPipeError) as exc:
        reset = exc  # a server that refused us at once has closed: its reason may still be queued
    except TimeoutError:
        raise HpkvUnavailable(f"the hpkv server did not take {msg['op']!r} within {timeout:g}s") from None
    except OSError as exc:
        raise HpkvUnavailable(f"hpkv {msg['op']!r} failed: {exc}") from None
    try:
        with sock.makefile("rb") as f:
            line = f.readline()
    except TimeoutError:
        raise HpkvUnavailable(f"the hpkv server did not answer {msg['op']!r} within {timeout:g}s") from None
    except (ConnectionResetError, BrokenPipeError) as exc:
        line, reset = b"", reset or exc
    except OSError as exc:
        raise HpkvUnavailable(f"hpkv {msg['op']!r} failed: {exc}") from None
    if not line and reset is not None:
        raise _ServerLeaving(f"the hpkv server reset the connection during {msg['op']!r} ({reset})")
    if not line:
        raise _ServerLeaving(f"the hpkv server closed the connection during {msg['op']!r}")
    reply = json.loads(line)
    if not reply.get("ok") and reply.get("status") == -errno.ESHUTDOWN:
        raise _ServerLeaving(str(reply.get("error")))
    raise_refusal(reply, f"hpkv {msg['op']!r}")
    return reply


def _reach(
    cfg: Config, env: Mapping[str, str] | None, timeout: float, spawn: bool, msg: dict[str, Any]
) -> tuple[socket.socket, dict[str, Any]]:
    """A connection to the pool directory's server that has answered ``msg``, starting a
    server if none runs. A server that is stopping (an idle exit, ``hpkv stop``) when we
    reach it is waited out and replaced, within ``timeout``."""
    sock_path = os.path.join(cfg.pool_dir, P.SOCKET_FILE)
    deadline = time.monotonic() + timeout
    while True:
        sock = _try_connect(sock_path, min(5.0, max(deadline - time.monotonic(), 0.01)))
        if sock is None:
            if not spawn:
                raise HpkvUnavailable(f"no hpkv server is running for {cfg.pool_dir}")
            sock = _spawn_and_reach(cfg, env, max(deadline - time.monotonic(), 1.0))
        try:
            # The whole connect honours ``timeout``: a server that accepts but never answers
            # (hung, or its control thread stuck) costs the caller no more than that.
            return sock, _handshake(sock, msg, max(deadline - time.monotonic(), 0.01))
        except _ServerLeaving as exc:
            sock.close()
            if not spawn:
                raise
            leaving = P.live_server_pid(cfg.pool_dir)
            log.info("%s; waiting for server %s to exit, then starting a new one", exc, leaving)
            while leaving is not None and P.live_server_pid(cfg.pool_dir) == leaving:
                if time.monotonic() > deadline:
                    raise HpkvUnavailable(
                        f"the hpkv server (pid {leaving}) for {cfg.pool_dir} was still stopping "
                        f"after {timeout:g}s (it writes pending spills first, for at most "
                        f"HPKV_STOP_DRAIN_TIMEOUT): connect again once it has exited"
                    ) from None
                time.sleep(0.05)
        except BaseException:
            sock.close()
            raise


def connect(
    cfg: Config | None = None,
    *,
    spawn: bool = True,
    timeout: float = 60.0,
    call_timeout: float = 5.0,
    name: str = "",
    env: Mapping[str, str] | None = None,
) -> HpkvClient:
    """Attach to the pool directory's server, starting one if needed (at most one ever runs)."""
    cfg = cfg or load_config(env)
    sock, reply = _reach(cfg, env, timeout, spawn, {"op": "hello", "pid": os.getpid(), "name": name})
    return HpkvClient(cfg.pool_dir, sock, reply, call_timeout)


def ensure_server(
    cfg: Config, *, timeout: float = 60.0, env: Mapping[str, str] | None = None, hold: str = ""
) -> socket.socket | None:
    """Start the pool directory's server if none runs, without attaching to it: an engine
    calls this early in its start-up so the pool's memory is ready by its first request.

    With ``hold`` (a name for the server's log), the returned connection keeps an
    auto-spawned server from its idle exit until it is closed (or this process exits): an
    engine's start-up can take longer than HPKV_SERVER_IDLE_EXIT before it attaches."""
    if not hold:
        sock = _try_connect(os.path.join(cfg.pool_dir, P.SOCKET_FILE), 5.0) or _spawn_and_reach(
            cfg, env, timeout
        )
        sock.close()
        return None
    sock, _ = _reach(cfg, env, timeout, True, {"op": "hold", "pid": os.getpid(), "name": hold})
    return sock


def _spawn_and_reach(cfg: Config, env: Mapping[str, str] | None, timeout: float) -> socket.socket:
    """Spawn a server unless another spawner does; a socket connected to it."""
    sock_path = os.path.join(cfg.pool_dir, P.SOCKET_FILE)
    deadline = time.monotonic() + timeout
    lock_fd = open_in_pool_dir(cfg, P.SPAWN_LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        while True:  # one spawner at a time; the others find its server
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise HpkvUnavailable(
                        f"timed out waiting for another process to start the hpkv server for {cfg.pool_dir}"
                    ) from None
                time.sleep(0.05)
        sock = _try_connect(sock_path, 5.0)
        if sock is None:
            try:
                pid = spawn_server(cfg, env, timeout=max(deadline - time.monotonic(), 1.0))
            except HpkvUnavailable:
                # No server runs, so nothing else uses the directory: leave only server.log
                # (a spawner waiting on this lock meanwhile just spawns once more).
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(cfg.pool_dir, P.SPAWN_LOCK_FILE))
                raise
            if pid:
                log.info("started hpkv server pid %d for %s", pid, cfg.pool_dir)
            while sock is None:  # ready (or served by another server): its socket accepts
                if time.monotonic() > deadline:
                    raise HpkvUnavailable(
                        f"the hpkv server for {cfg.pool_dir} did not accept connections "
                        f"within {timeout:g}s; see {os.path.join(cfg.pool_dir, P.LOG_FILE)}"
                    )
                time.sleep(0.02)
                sock = _try_connect(sock_path, 5.0)
    finally:
        os.close(lock_fd)
    return sock

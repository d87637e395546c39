"""The client of the hpkv server: control calls over its socket, hot calls over its rings.

:func:`hpkv.client.reach.connect` makes one; :meth:`HpkvClient.register_device` hands out
the :class:`~hpkv.client.device.DeviceHandle` of a device's transfer workers.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpkv.client.contract import Events, Probe
from hpkv.client.device import DeviceHandle
from hpkv.common import shm
from hpkv.protocol import wire as P
from hpkv.protocol.errors import HpkvError, HpkvUnavailable, error_for, raise_refusal
from hpkv.protocol.events import decode
from hpkv.protocol.keys import KEY_BYTES
from hpkv.ring import Ring, RingError, RingTimeout

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
RECHECK_S = 0.002  # between the lookups of settled_lookup


def promote_timeout(nbytes: int) -> float:
    """How long a promote of ``nbytes`` may take: generous, ≥ 5 s at 200 MB/s."""
    return max(5.0, nbytes / 200e6)


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
        self._mbox = np.frombuffer(shm.map_file(hello["mailbox"]), dtype=np.uint8)
        self._seq = 0
        self._namespaces: dict[int, NamespaceHandle] = {}
        self._broken: str | None = None
        self.devices: list[DeviceHandle] = []

    # ---------------------------------------------------------------- control calls (socket)
    def call(self, op: str, **kwargs: Any) -> dict[str, Any]:
        return self._control(op, kwargs, max(self.call_timeout, 30.0))

    def _control(self, op: str, kwargs: dict[str, Any], timeout: float) -> dict[str, Any]:
        with self._ctl_lock:
            try:
                self._sock.settimeout(timeout)
                self._sock.sendall(json.dumps({"op": op, **kwargs}).encode() + b"\n")
                line = self._sock_file.readline()
            except OSError as exc:
                # A late answer would be read as the next call's: the connection is done for,
                # and the hot calls say so too (the owner's thread then reconnects).
                self._broken = f"hpkv server connection failed during {op!r}: {exc}"
                raise HpkvUnavailable(self._broken) from None
        if not line:
            self._broken = f"the hpkv server closed the connection during {op!r}"
            raise HpkvUnavailable(self._broken)
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

    def report_time_saved(self, ns_id: int, tiers: dict[str, tuple[int, int, int]]) -> None:
        """Add ``{tier: (tokens loaded, prefill µs they saved, µs their loads took)}`` to the
        namespace's time-saved counters. Within the hot calls' timeout, not the control calls'
        30 s: an engine's connector makes it; a late answer breaks the connection (reconnected)."""
        self._control(
            "time_saved", {"ns_id": ns_id, **{t: list(v) for t, v in tiers.items()}}, self.call_timeout
        )

    def stats(self) -> dict[str, Any]:
        return self.call("stats")["stats"]

    def events(self, ns_id: int, since: int, limit: int = 8192) -> Events:
        r = self.call("events", ns_id=ns_id, since=since, limit=limit)
        return Events(decode(base64.b64decode(r["records"])), r["seq"], r["lost"], r["more"])

    def shutdown_server(self) -> None:
        self.call("shutdown", pid=os.getpid())

    # Operator calls (`hpkv evict`, `prefetch`, `pin`, `unpin`): only the server's own uid may
    # make them. ``namespace`` is an id, a fingerprint prefix or a name, as `hpkv status` shows.
    def evict(
        self, namespace: str, tier: str = "dram", older_than_s: float | None = None, dry_run: bool = False
    ) -> dict[str, Any]:
        return self.call("evict", namespace=namespace, tier=tier, older_than_s=older_than_s, dry_run=dry_run)

    def prefetch(
        self,
        namespace: str,
        max_bytes: int | None = None,
        newest: int | None = None,
        timeout_s: float = 30.0,
    ) -> dict[str, Any]:
        return self._control(
            "prefetch",
            {"namespace": namespace, "max_bytes": max_bytes, "newest": newest, "timeout_s": timeout_s},
            timeout_s + 30.0,
        )

    def operator_pin(self, namespace: str, keys: Sequence[bytes] | None = None) -> dict[str, Any]:
        """Pin ``keys`` (all the namespace's DRAM blocks: None) until :meth:`operator_unpin`."""
        sel = {"all": True} if keys is None else {"keys": [k.hex() for k in keys]}
        return self.call("pin", namespace=namespace, **sel)

    def operator_unpin(self, namespace: str, keys: Sequence[bytes] | None = None) -> dict[str, Any]:
        sel = {"all": True} if keys is None else {"keys": [k.hex() for k in keys]}
        return self.call("unpin", namespace=namespace, **sel)

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
        """(number of leading keys present, tier of each: 1 DRAM, 2 storage, 3 remote store)."""
        hit, tiers, _ = self.probe(ns_id, keys)
        return hit, tiers

    def probe(self, ns_id: int, keys: Sequence[bytes]) -> Probe:
        """A lookup that also says whether the key after the prefix is still being checked
        on storage (the lookup's bound, ``HPKV_STORAGE_LOOKUP_WAIT_MS``, ended first): an
        engine that can wait asks again later rather than recomputing what may be there."""
        with self._hot_lock:
            hit, unconfirmed = self._rpc(P.LOOKUP, ns_id, keys)
            return Probe(hit, self._mbox[P.MAILBOX_HALF : P.MAILBOX_HALF + hit].tolist(), bool(unconfirmed))

    def probe_each(self, ns_id: int, keys: Sequence[bytes]) -> Probe:
        """A lookup that answers every key (one call): ``tiers[i]`` is key ``i``'s tier, 0 where
        it is missing; ``hit`` the leading keys present; ``unconfirmed`` whether some key is
        still being checked on storage. A sliding-window model's hit needs blocks after ones
        it does not need."""
        with self._hot_lock:
            hit, unconfirmed = self._rpc(P.LOOKUP, ns_id, keys, flags=P.FLAG_EACH)
            n = len(keys)
            return Probe(hit, self._mbox[P.MAILBOX_HALF : P.MAILBOX_HALF + n].tolist(), bool(unconfirmed))

    def settled_lookup(
        self, ns_id: int, keys: Sequence[bytes], patience_s: float, *, each: bool = False
    ) -> tuple[int, list[int]]:
        """A lookup asked again (every RECHECK_S) while a key it needs is still being checked
        on storage, for at most ``patience_s``: for callers that may wait (not a scheduler
        loop), such as SGLang's prefetch thread and the benches. ``each``: answer every key
        (:meth:`probe_each`), not only the leading ones present."""
        probe = self.probe_each if each else self.probe
        give_up = time.monotonic() + patience_s
        hit, tiers, unconfirmed = probe(ns_id, keys)
        while unconfirmed and time.monotonic() < give_up:
            time.sleep(RECHECK_S)
            hit, tiers, unconfirmed = probe(ns_id, keys)
        return hit, tiers

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

    def _each_call(self, kind: int, ns_id: int, keys: Sequence[bytes], a2: int = 0, flags: int = 0) -> int:
        """A call whose answer is a count, in as many calls of at most MAX_KEYS_PER_CALL keys
        as ``keys`` needs (an engine step may finish more blocks than one call takes); the
        counts summed."""
        per = P.MAX_KEYS_PER_CALL
        with self._hot_lock:
            if len(keys) <= per:
                return self._rpc(kind, ns_id, keys, a2, flags)[0]
            return sum(
                self._rpc(kind, ns_id, keys[i : i + per], a2, flags)[0] for i in range(0, len(keys), per)
            )

    def commit(self, ns_id: int, keys: Sequence[bytes], rank: int = 0) -> int:
        return self._each_call(P.COMMIT, ns_id, keys, rank)

    def abort(self, ns_id: int, keys: Sequence[bytes]) -> None:
        """The shards of these reserved keys could not be written: free their slots."""
        self._each_call(P.COMMIT, ns_id, keys, flags=P.FLAG_ABORT)

    def pin(self, ns_id: int, keys: Sequence[bytes]) -> np.ndarray:
        """Pin keys; pool offsets ``[len(keys), world]`` (-1 where not in DRAM)."""
        with self._hot_lock:
            return self._rows(P.PIN, ns_id, keys)

    def promote(self, ns_id: int, keys: Sequence[bytes], timeout: float | None = None) -> np.ndarray:
        """Load blocks into the pool and pin them, like :meth:`pin`: pool offsets ``[len(keys), world]``.

        Blocks already in DRAM are pinned at once; storage-resident ones (lookup tier 2, or 3: remote)
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
        self._each_call(P.UNPIN, ns_id, keys)

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

"""The worker side of the connector (one per rank): exports the rank's KV cache to hpkv and
has the rank's transfer worker copy blocks pool → KV cache before the forward (loads) and
KV cache → pool after it (saves), then commits the saved shards.

On the CPU backend the KV cache is allocated in a shared-memory file the transfer worker
maps (:meth:`WorkerSide.shared_kv_allocation`). Saves are submitted at the end of the step
and not waited for: the transfer worker copies while vLLM samples and runs its next step, the
keys are committed when the copy completes, and vLLM frees a finished request's blocks only
once none of its saves is in flight (:class:`SaveTracker`). A DRAM hit is copied before the forward, or
in the background (vLLM's async load) while other requests run (``HPKV_ASYNC_DRAM_LOADS``); a
storage hit loads in the background, promoted into the pool by the IO workers part by part,
each part copied while the next one is read.
Blocks that cannot be delivered are reported, and vLLM recomputes them.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from hpkv.client.client import promote_timeout as default_promote_timeout
from hpkv.client.contract import BlockMover, KvStore
from hpkv.common import shm
from hpkv.connectors.promote import load_in_parts
from hpkv.connectors.reconnect import Reconnecting
from hpkv.connectors.vllm.layout import Layout, describe_kv
from hpkv.connectors.vllm.metadata import NULL_BLOCK_ID, HpkvConnectorStats, HpkvMetadata, LoadOp
from hpkv.protocol import wire as P
from hpkv.protocol.wire import POOL_FILE, device_file_name, device_file_pid

log = logging.getLogger("vllm.hpkv")

LOAD_CONNECT_TIMEOUT_S = 10.0  # a background load waits this long for an hpkv connection
IDLE_STEP_WAIT_S = 0.02  # an empty step waits this long for a background load (or a save) to finish
SAVE_TIMEOUT_S = 30.0  # a save unanswered this long is aborted and its blocks released
# A background load's disk read may take longer than a step's (the request waits, the others
# run); on a loaded machine a few blocks took over 5 s. Still bounded: it then recomputes.
BACKGROUND_PROMOTE_TIMEOUT_S = 30.0
# A background load is copied in batches of about this size: the step thread's saves go to the
# same transfer worker, through the same device handle, and wait for the batch before them,
# never for a whole 448 MiB hit (40-150 ms on a busy 2-CPU machine).
BACKGROUND_COPY_BATCH_BYTES = 16 << 20

#: (store, namespace id, block mover) of a connected worker.
Opened = tuple[KvStore, int, BlockMover]


class TicketMover(Protocol):
    """Copies submitted now and answered later (:class:`hpkv.client.device.DeviceHandle`)."""

    def submit(
        self, kind: int, blocks: np.ndarray, offsets: np.ndarray, event: int = -1
    ) -> list[tuple[int, int]]: ...

    def poll(self, tickets: list[tuple[int, int]]) -> dict[tuple[int, int], int]: ...

    def wait(
        self, tickets: list[tuple[int, int]], timeout: float | None = None
    ) -> dict[tuple[int, int], int]: ...


class SaveTracker:
    """Which finished requests vLLM may free: the same rule on both sides of the connector.

    The scheduler delays the free of every request that appeared in a save op (it sees the ops
    it builds); every worker sees the same ops and reports such a request in ``finished_sending``
    once vLLM told it the request finished and none of its saves is in flight. A worker that is
    disabled still reports, so vLLM never waits for blocks forever."""

    def __init__(self) -> None:
        self.saved: set[str] = set()
        self.inflight: dict[str, int] = {}
        self.awaiting: set[str] = set()

    def scheduled(self, meta: HpkvMetadata) -> None:
        self.saved.update(op.req_id for op in meta.saves)

    def started(self, req_ids: list[str]) -> None:
        for r in req_ids:
            self.inflight[r] = self.inflight.get(r, 0) + 1

    def ended(self, req_ids: list[str]) -> None:
        for r in req_ids:
            n = self.inflight.get(r, 0) - 1
            if n > 0:
                self.inflight[r] = n
            else:
                self.inflight.pop(r, None)

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        self.awaiting |= finished_req_ids & self.saved
        ready = {r for r in self.awaiting if r not in self.inflight}
        self.awaiting -= ready
        self.saved -= ready
        return ready


@dataclass
class PendingSave:
    tickets: list[tuple[int, int]]
    keys: list[bytes]
    req_ids: list[str]
    event: int  # CUDA: the engine event the copy waits for; -1 on the CPU
    started: float
    mover: TicketMover  # what it was submitted to (a reconnect brings another)
    results: dict[tuple[int, int], int] = field(default_factory=dict)  # ticket -> status, as answered


class WorkerSide:
    """``open_store(device_spec)`` connects, attaches the namespace and registers the KV cache."""

    def __init__(
        self,
        layout: Layout,
        rank: int,
        pool_dir: str,
        device_type: str,
        open_store: Callable[[dict[str, Any]], Opened],
        open_load_store: Callable[[], tuple[KvStore, int]] | None = None,
    ):
        self.layout = layout
        self.rank = rank
        self.enabled = True
        self.disabled_reason = ""  # why hpkv is off on this worker, for the per-request warning
        self.ns_id = -1
        self.stats = HpkvConnectorStats()
        self.promote_part_bytes = 0  # one part; the connector sets HPKV_PROMOTE_PART_SIZE
        self._pool_dir = pool_dir
        self._device_type = device_type
        self._open_store = open_store
        self._device: BlockMover | None = None
        self._load_errors: set[int] = set()
        # A hybrid model's (several KV cache groups) failed loads are reported by request: vLLM
        # cannot map block ids back to requests there (Scheduler._handle_invalid_blocks raises).
        self._fail_by_request = len(getattr(layout, "groups", ())) > 1  # (a test places KV with no layout)
        self._failed_requests: set[str] = set()
        self._lock = threading.Lock()  # errors and stats: the step thread and the background loads
        self._kv_file: str | None = None
        self._kv_mmap: mmap.mmap | None = None
        self._kv_base = 0
        self._device_spec: dict[str, Any] = {}
        self.hpkv: Reconnecting[KvStore] = Reconnecting(f"worker rank {rank}", self._connect, log)
        self._background = BackgroundLoads(self, open_load_store)
        self.tracker = SaveTracker()
        self._pending: list[PendingSave] = []

    def _connect(self) -> KvStore:
        store, self.ns_id, self._device = self._open_store(self._device_spec)
        return store

    # ---------------------------------------------------------------- KV cache placement
    def mem_pool_context(self) -> contextlib.AbstractContextManager[None] | None:
        """Allocate the KV cache in a shared-memory file the transfer worker maps (CPU backend)."""
        if not self.enabled or self._device_type != "cpu":
            return None
        return self.shared_kv_allocation()

    @contextlib.contextmanager
    def shared_kv_allocation(self) -> Iterator[None]:
        # vLLM allocates the whole KV cache as one torch.zeros(int8) buffer inside this
        # context (vllm/v1/worker/utils.py: allocate_kv_cache). The CPU has no memory-pool
        # API, so for that one call we hand out a tensor backed by a file in the pool
        # directory, which the transfer worker maps too. torch.zeros is patched only here.
        real_zeros = torch.zeros

        def zeros(
            *size: Any, dtype: torch.dtype | None = None, device: Any = None, **kwargs: Any
        ) -> torch.Tensor:
            if (
                self._kv_file is None
                and dtype == torch.int8
                and len(size) == 1
                and isinstance(size[0], int)
                and (device is None or torch.device(device).type == "cpu")
            ):
                t = self._alloc_shared_kv(size[0])
                if t is not None:
                    return t
            return real_zeros(*size, dtype=dtype, device=device, **kwargs)

        torch.zeros = zeros
        try:
            yield
        finally:
            torch.zeros = real_zeros

    def _alloc_shared_kv(self, nbytes: int) -> torch.Tensor | None:
        path = os.path.join(self._pool_dir, device_file_name(os.getpid(), self.rank))
        try:
            os.makedirs(self._pool_dir, mode=0o700, exist_ok=True)
            mm = shm.create(path, nbytes, exclusive=False)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(path)
            usage = pool_dir_usage(self._pool_dir)
            log.error(
                "hpkv: cannot place the %d-byte KV cache in shared memory at %s (%s): %s. hpkv is "
                "disabled on this worker and every request recomputes: free space in %s (or "
                "enlarge it), lower HPKV_KV_MEM_POOL_SIZE, or lower VLLM_CPU_KVCACHE_SPACE",
                nbytes,
                path,
                exc.strerror,
                usage,
                self._pool_dir,
            )
            self.enabled = False
            self.disabled_reason = (
                f"hpkv is disabled on this worker: its {nbytes}-byte KV cache did not fit in "
                f"{self._pool_dir} ({exc.strerror}; {usage})"
            )
            return None
        self._kv_file, self._kv_mmap = path, mm
        t = torch.frombuffer(mm, dtype=torch.int8)
        self._kv_base = t.data_ptr()
        log.info("hpkv: KV cache of rank %d (%d bytes) placed in %s", self.rank, nbytes, path)
        return t

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not self.enabled:
            return
        if self._kv_file is None or self._kv_mmap is None:
            log.error(
                "hpkv: the KV cache was not allocated through hpkv's shared-memory context "
                "(device %s): hpkv is disabled on this worker",
                self._device_type,
            )
            self.enabled = False
            return
        try:
            self._device_spec = describe_kv(
                self.layout, kv_caches, self._kv_file, self._kv_base, self._kv_mmap.size()
            )
        except ValueError as exc:
            log.error("hpkv disabled on this worker: %s", exc)
            self.enabled = False
            return
        self.hpkv.connect_now(timeout=120.0)

    # ---------------------------------------------------------------- copies
    def start_load_kv(self, meta: HpkvMetadata) -> None:
        now = [op for op in meta.loads if not op.background]
        if now:
            client = self.hpkv.get() if self.enabled else None
            if client is None:
                # The scheduler promised these blocks; if this worker cannot deliver them (hpkv
                # disabled here, or unreachable), vLLM must recompute them, never read garbage.
                self._fail_loads(now, self.unavailable_reason())
            else:
                self.load(client, self.ns_id, now, self.hpkv.lost)
        for op in meta.loads:
            if op.background:
                self._background.submit(op)

    def load(
        self,
        client: KvStore,
        ns_id: int,
        ops: list[LoadOp],
        lost: Callable[[BaseException], None],
        promote_timeout: float | None = None,
        copy_batch_bytes: int = 0,
        ahead: KvStore | None = None,
    ) -> None:
        """Load ``ops`` into the KV cache: promote what is not in DRAM, copy, unpin what was
        promoted for us. Blocks that could not be loaded are reported (vLLM recomputes them).

        A large storage load is promoted in parts, each copied into the KV cache while the
        next one is read from disk; the copies stay on this thread (:func:`load_in_parts`).
        ``copy_batch_bytes`` > 0 cuts each copy into batches of about that size (of this rank's
        shards), one after the other. ``ahead``: a second connection (same namespace id) that
        reads every other part, two parts at once."""
        nowhere = [op for op in ops if NULL_BLOCK_ID in op.block_ids]
        if nowhere:  # a hit's block vLLM did not allocate (a state group's): recompute the request
            self._fail_loads(nowhere, "vLLM allocated no block for part of the hit (the null block)")
            ops = [op for op in ops if NULL_BLOCK_ID not in op.block_ids]
            if not ops:
                return
        blocks = [b for op in ops for b in op.block_ids]
        device = self._device
        if device is None:
            self._fail_loads(ops, self.unavailable_reason())
            return
        t0 = time.perf_counter()
        keys = [k for op in ops for k in op.keys]
        offsets = np.concatenate([op.offsets[:, self.rank] for op in ops])
        missing = np.flatnonzero(offsets < 0)
        if promote_timeout is None:  # the client's bound for one promote of all of it
            promote_timeout = default_promote_timeout(
                len(missing) * self.layout.shard_bytes * self.layout.world_size
            )
        dst = np.asarray(blocks, np.int64)
        batch = max(1, copy_batch_bytes // self.layout.shard_bytes if copy_batch_bytes > 0 else len(dst))

        def copy(idx: np.ndarray, offs: np.ndarray) -> bool:
            return all(
                device.load(dst[idx[i : i + batch]], offs[i : i + batch]) for i in range(0, len(idx), batch)
            )

        try:
            ok = load_in_parts(
                client,
                ns_id,
                keys,
                offsets,
                self.rank,
                self.layout.shard_bytes,
                self.promote_part_bytes,
                promote_timeout,
                copy,
                ahead=ahead,
            )
        except Exception as exc:  # noqa: BLE001 - whatever failed, vLLM recomputes
            lost(exc)
            self._fail_loads(ops, str(exc))
            return
        if not ok.all():
            self._fail_loads(ops, "blocks missing or copy failed", ok)
        n_ok = int(ok.sum())
        from_storage = np.zeros(len(keys), bool)
        from_storage[missing] = True
        # Tokens per key: a hybrid model's hit loads several groups' keys per block (the
        # auto threshold compares these tokens with recomputing them).
        bs = self.layout.block_size
        per_key = np.concatenate(
            [
                np.full(len(op.keys), bs if op.tokens is None else op.tokens / max(len(op.keys), 1))
                for op in ops
            ]
        )
        with self._lock:
            s = self.stats.data
            s["loaded_tokens_dram"] += round(float(per_key[ok & ~from_storage].sum()))
            s["loaded_tokens_storage"] += round(float(per_key[ok & from_storage].sum()))
            s["loaded_bytes"] += n_ok * self.layout.shard_bytes
            elapsed = time.perf_counter() - t0
            s["load_time_s"] += elapsed
            s["load_time_storage_s" if len(missing) else "load_time_dram_s"] += elapsed

    def unavailable_reason(self) -> str:
        """Why this worker cannot load now: hpkv disabled here (and why), or no server."""
        if self.enabled:
            return "no hpkv server"
        return self.disabled_reason or "hpkv is disabled on this worker"

    def _fail_loads(self, ops: list[LoadOp], why: str, ok: np.ndarray | None = None) -> None:
        """Report the blocks of ``ops`` that did not load (``ok``: per block, in order; None:
        none loaded): by block id, or for a hybrid model by request."""
        failed: list[int] = []
        requests: set[str] = set()
        at = 0
        for op in ops:
            good = ok[at : at + len(op.block_ids)] if ok is not None else np.zeros(len(op.block_ids), bool)
            at += len(op.block_ids)
            lost = [b for b, g in zip(op.block_ids, good, strict=True) if not g]
            if lost:
                failed.extend(lost)
                requests.add(op.req_id)
        with self._lock:
            if self._fail_by_request:
                self._failed_requests.update(requests)
            else:
                self._load_errors.update(failed)
            self.stats.data["load_failed_blocks"] += len(failed)
        log.warning("hpkv: %d block(s) could not be loaded (%s); vLLM recomputes them", len(failed), why)

    # ---------------------------------------------------------------- saves
    def wait_for_save(self, meta: HpkvMetadata) -> None:
        """Submit the step's saves without waiting for them (the step's KV is final here: on the
        CPU the forward is synchronous, on CUDA the copy waits for an event recorded after it)."""
        self.tracker.scheduled(meta)  # even when disabled: vLLM is told when it may free the blocks
        self._reap()
        if not self.enabled or not meta.saves:
            return
        client, copier = self.hpkv.get(), self._save_copier()
        if client is None or copier is None:
            return
        keys = [k for op in meta.saves for k in op.keys]
        req_ids = [op.req_id for op in meta.saves]
        blocks = np.asarray([b for op in meta.saves for b in op.block_ids], np.int64)
        offsets = np.concatenate([op.offsets[:, self.rank] for op in meta.saves])
        try:
            event = self._save_event()
            tickets = copier.submit(P.COPY_SAVE, blocks, offsets, event=event)
        except Exception as exc:  # noqa: BLE001 - a lost save is a future miss
            with self._lock:
                self.stats.data["save_failed_blocks"] += len(keys)
            self.hpkv.lost(exc)
            return
        self._pending.append(PendingSave(tickets, keys, req_ids, event, time.monotonic(), copier))
        self.tracker.started(req_ids)

    def _save_copier(self) -> TicketMover | None:
        """What the saves are submitted to (None: saves are off on this worker)."""
        return self._device  # type: ignore[return-value]  # a DeviceHandle once connected

    def _save_event(self) -> int:
        """The engine event a save's copy must wait for; -1: none (on the CPU the forward is
        synchronous, the step's KV is final here)."""
        return -1

    def _reap(self, wait_for: list[PendingSave] | None = None) -> None:
        """Commit (or abort) every save whose completion arrived; with ``wait_for``, first wait
        (bounded by SAVE_TIMEOUT_S from each one's start) until those have completed."""
        copier = self._save_copier()
        for save in list(self._pending):
            if copier is None or save.mover is not copier:  # hpkv is off here, or was reconnected
                self._finish(save, ok=False)
                continue
            deadline = save.started + SAVE_TIMEOUT_S
            todo = [t for t in save.tickets if t not in save.results]
            try:
                if wait_for and save in wait_for:
                    got = copier.wait(todo, timeout=max(deadline - time.monotonic(), 0.0))
                else:
                    got = copier.poll(todo)
            except Exception as exc:  # noqa: BLE001 - hpkv trouble: the save is lost, vLLM goes on
                self.hpkv.lost(exc)
                self._finish(save, ok=False)
                continue
            save.results.update(got)  # (answered tickets are claimed: keep their statuses)
            if len(save.results) == len(save.tickets):
                self._finish(save, ok=all(st == 0 for st in save.results.values()))
            elif time.monotonic() > deadline:
                log.warning(
                    "hpkv: a save of %d blocks got no answer in %.0fs: aborted",
                    len(save.keys),
                    SAVE_TIMEOUT_S,
                )
                self._finish(save, ok=False)

    def _finish(self, save: PendingSave, ok: bool) -> None:
        self._pending.remove(save)
        self.tracker.ended(save.req_ids)
        client = self.hpkv.client
        committed = False
        try:
            if ok and client is not None:
                client.commit(self.ns_id, save.keys, rank=self.rank)
                committed = True
            elif client is not None:
                client.abort(self.ns_id, save.keys)
        except Exception as exc:  # noqa: BLE001 - a lost commit is a future miss
            self.hpkv.lost(exc)
        with self._lock:
            s = self.stats.data
            if committed:
                s["saved_tokens"] += len(save.keys) * self.layout.block_size
                s["saved_bytes"] += len(save.keys) * self.layout.shard_bytes
            else:
                s["save_failed_blocks"] += len(save.keys)
            s["save_time_s"] += time.monotonic() - save.started

    def finished_saves(self, finished_req_ids: set[str], idle_step: bool = False) -> set[str]:
        """Finished requests none of whose saves is in flight any more: vLLM may free their
        blocks. In a step without a forward pass, wait up to ``IDLE_STEP_WAIT_S`` for a save
        (an idle engine steps empty batches back to back while it waits for one)."""
        self._reap()
        if idle_step and self._pending:
            until = time.monotonic() + IDLE_STEP_WAIT_S
            oldest = self._pending[0]
            while oldest in self._pending and time.monotonic() < until:
                time.sleep(0.001)
                self._reap()
        return self.tracker.finished(finished_req_ids)

    def handle_preemptions(self, preempted: set[str]) -> None:
        """Preempted requests' blocks are reused without a request_finished: finish their saves first."""
        hit = [s for s in self._pending if preempted & set(s.req_ids)]
        if hit:
            self._reap(wait_for=hit)

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def take_finished_loads(self, idle_step: bool = False) -> set[str]:
        """Requests whose background load ended (loaded or failed: their errors were recorded
        first). In a step without a forward pass, wait up to ``IDLE_STEP_WAIT_S`` for one:
        while a request waits for its load and nothing else runs, vLLM steps empty batches
        back to back, and on a small CPU that spin starves the very processes doing the load."""
        return self._background.take_finished(IDLE_STEP_WAIT_S if idle_step else 0.0)

    def take_failed_loads(self, finished: set[str]) -> set[str]:
        """Of the requests whose load is reported ``finished`` now, those whose load failed
        (hybrid models; vLLM counts a failure only with its finish, so the others wait)."""
        with self._lock:
            failed = self._failed_requests & finished
            self._failed_requests -= failed
        return failed

    def take_stats(self) -> HpkvConnectorStats | None:
        with self._lock:
            if not self.enabled or self.stats.is_empty():
                return None
            stats, self.stats = self.stats, HpkvConnectorStats()
        return stats

    def shutdown(self) -> None:
        self._reap(wait_for=list(self._pending))
        self._background.close()
        self.hpkv.close()
        if self._kv_file:
            with contextlib.suppress(OSError):
                os.unlink(self._kv_file)  # the mapping stays valid while vLLM still uses it


def pool_dir_usage(pool_dir: str) -> str:
    """What fills the pool directory's file system, in words (for a failed KV-cache placement)."""
    try:
        st = os.statvfs(pool_dir)
    except OSError as exc:
        return f"its file system cannot be read: {exc.strerror}"
    parts = [f"{st.f_bavail * st.f_frsize} bytes free of {st.f_blocks * st.f_frsize}"]
    pool = engines = 0
    gone: list[str] = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(pool_dir):
            with contextlib.suppress(OSError):
                used = entry.stat(follow_symlinks=False).st_blocks * 512  # allocated, not apparent
                pid = device_file_pid(entry.name)
                if entry.name == POOL_FILE:
                    pool = used
                elif pid is not None and pid != os.getpid():
                    engines += used
                    try:
                        os.kill(pid, 0)
                    except ProcessLookupError:
                        gone.append(f"{entry.name} of exited process {pid}")
    parts.append(f"the hpkv pool holds {pool} bytes")
    parts.append(f"other engines' KV-cache files {engines} bytes")
    if gone:
        parts.append("left behind: " + ", ".join(gone[:4]))
    return ", ".join(parts)


class BackgroundLoads:
    """Loads run while the engine steps its other requests (vLLM's async KV load: those that
    need the disk, and DRAM hits the scheduler sends here): one thread, two hpkv connections
    of its own (a promote waits for the disk; the step thread's calls must not queue behind
    it; the second reads every other part of a load, :func:`load_in_parts`), the worker's
    device for the copy, in batches (``BACKGROUND_COPY_BATCH_BYTES``). Every load
    ends, loaded or failed, within the client's bounds; the request is then reported finished
    (after its failed blocks were reported) and vLLM recomputes what failed."""

    def __init__(self, side: WorkerSide, open_store: Callable[[], tuple[KvStore, int]] | None):
        self._side = side
        self._open_store = open_store
        self.ns_id = -1
        self.hpkv: Reconnecting[KvStore] = Reconnecting(f"worker rank {side.rank} loads", self._connect, log)
        self.ahead: Reconnecting[KvStore] = Reconnecting(
            f"worker rank {side.rank} loads ahead", self._connect_ahead, log
        )
        self._queue: queue.SimpleQueue[LoadOp | None] = queue.SimpleQueue()
        self._finished: set[str] = set()
        self._pending = 0  # submitted, not yet finished
        self._done = threading.Condition()
        self._thread: threading.Thread | None = None

    def _connect(self) -> KvStore:
        if self._open_store is None:
            raise RuntimeError("background loads are not configured")
        store, self.ns_id = self._open_store()
        return store

    def _connect_ahead(self) -> KvStore:
        if self._open_store is None:
            raise RuntimeError("background loads are not configured")
        store, ns_id = self._open_store()
        if ns_id != self.ns_id:  # (one server, one namespace: the same id; never expected)
            store.close()
            raise RuntimeError(f"the second load connection got namespace id {ns_id}, not {self.ns_id}")
        return store

    def _lost(self, exc: BaseException) -> None:
        """A load failed on either connection: both are connected anew (which one broke is
        not known here, and a server restart breaks both)."""
        self.hpkv.lost(exc)
        self.ahead.lost(exc)

    def submit(self, op: LoadOp) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"hpkv-loads-r{self._side.rank}", daemon=True
            )
            self._thread.start()
        with self._done:
            self._pending += 1
        self._queue.put(op)

    def _run(self) -> None:
        while (op := self._queue.get()) is not None:
            try:
                client = self.hpkv.get()
                if client is None:
                    self.hpkv.connect_now(timeout=LOAD_CONNECT_TIMEOUT_S)
                    client = self.hpkv.client
                    if client is not None and self.ahead.client is None:
                        self.ahead.connect_now(timeout=LOAD_CONNECT_TIMEOUT_S)
                if client is None or not self._side.enabled:
                    self._side._fail_loads([op], self._side.unavailable_reason())
                else:
                    self._side.load(
                        client,
                        self.ns_id,
                        [op],
                        self._lost,
                        BACKGROUND_PROMOTE_TIMEOUT_S,
                        BACKGROUND_COPY_BATCH_BYTES,
                        ahead=self.ahead.get(),  # None (not connected yet, or lost): one part at a time
                    )
            except Exception as exc:  # noqa: BLE001 - the request must end; vLLM recomputes
                self._side._fail_loads([op], f"background load failed: {exc}")
            with self._done:
                self._finished.add(op.req_id)
                self._pending -= 1
                self._done.notify_all()

    def take_finished(self, wait_s: float = 0.0) -> set[str]:
        with self._done:
            if wait_s > 0 and self._pending and not self._finished:
                self._done.wait(wait_s)
            done, self._finished = self._finished, set()
        return done

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=10.0)
        self.hpkv.close()
        self.ahead.close()

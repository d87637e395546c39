"""The server's ends of the IO workers: one request ring (server → worker, SPILL / PROMOTE)
and one completion ring bound to the server's doorbell per worker, the jobs each worker
holds, the queues of jobs not yet pushed, and the recovery of a dead worker's jobs.

A job is one rank's file of one block; an op (:class:`BlockOp`) is all ranks of one
block, one spill or one promote. Completions are returned as values
(:meth:`IoLinks.collect`); what they mean for the block is the tier's business.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hpkv.engine.workers import WorkerProcess
from hpkv.protocol import wire as P
from hpkv.protocol.errors import Status
from hpkv.protocol.stats import G, StatsSegment
from hpkv.ring import Doorbell, Ring, RingError

if TYPE_CHECKING:
    from hpkv.engine.index import Block
    from hpkv.engine.tiers import ParkedPromote

log = logging.getLogger("hpkv.storage")

# Jobs queued per worker. Promotes may queue deep, so a worker keeps reading while the
# server waits for a CPU; spills stay shallow, so a promote never waits behind many.
MAX_INFLIGHT_PER_WORKER = 16
MAX_SPILLS_PER_WORKER = 4


class BlockOp:
    """The jobs of all ranks of one block: one spill or one promote."""

    __slots__ = ("kind", "block", "remaining", "status", "written", "waiters")

    def __init__(self, kind: int, block: Block):
        self.kind = kind
        self.block = block
        self.remaining = block.ns.world_size
        self.status = 0  # first failure, 0 while all succeeded
        self.written: list[int] = []  # spill: ranks whose file we wrote
        self.waiters: list[tuple[ParkedPromote, int]] = []  # promote: (call, row)

    def jobs(self) -> list[Job]:
        return [Job(self, r) for r in range(self.block.ns.world_size)]


@dataclass
class Job:
    op: BlockOp
    rank: int
    sent: float = 0.0  # when it was pushed to a worker (monotonic)


@dataclass
class Completion:
    """A job's end: the worker's status, bytes moved and flags (P.IO_*); ``dead_pid`` is the
    pid of the worker that died holding it (its temporary file may be left)."""

    job: Job
    status: int
    nbytes: int = 0
    flags: int = 0
    dead_pid: int = 0


@dataclass
class _Link:
    """The server's ends of one IO worker's rings and the jobs it holds, in push order."""

    worker: WorkerProcess
    req: Ring
    resp: Ring
    inflight: OrderedDict[int, Job] = field(default_factory=OrderedDict)
    spills: int = 0  # of which spills; the rest are promotes
    dead: bool = False


class IoLinks:
    """The IO workers as the request loop sees them (under the server's lock)."""

    def __init__(self, stats: StatsSegment, doorbell: Doorbell):
        self.stats = stats
        self.g = stats.glob
        self.doorbell = doorbell
        self.links: list[_Link] = []
        self.spill_q: deque[Job] = deque()
        self.promote_q: deque[Job] = deque()
        self.read_inflight = 0  # bytes of promote reads spread over workers at once; 0: no limit
        self.restarted = False  # a dead worker was restarted (the tier's description changed)
        self._seq = 0

    def start(self, server_dir: str, slots: list[int], spec: dict) -> list[WorkerProcess]:
        """One IO worker per stats row in ``slots``, with its rings."""
        workers = []
        for i, slot in enumerate(slots):
            w, req, resp = WorkerProcess.start_io(server_dir, f"io{i}", slot, spec, self.stats, self.doorbell)
            self.links.append(_Link(w, req, resp))
            workers.append(w)
        return workers

    def close(self) -> None:
        for link in self.links:
            for ring in (link.req, link.resp):
                ring.close()  # never raises; safe twice

    def spills_pending(self) -> int:
        """Spill ops queued or held by a worker (a dead worker's are retried)."""
        ops = {id(job.op) for job in self.spill_q}
        ops.update(
            id(job.op) for link in self.links for job in link.inflight.values() if job.op.kind == P.SPILL
        )
        return len(ops)

    def take_queued_spills(self) -> list[Job]:
        """Take the spill jobs not yet pushed to a worker (spilling paused)."""
        queued = list(self.spill_q)
        self.spill_q.clear()
        return queued

    def spill_jobs(self) -> int:
        return len(self.spill_q) + sum(lk.spills for lk in self.links)

    def spill_queue_bytes(self) -> int:
        """Pool bytes of the spill jobs queued and not yet pushed to a worker."""
        return sum(job.op.block.ns.shard_bytes for job in self.spill_q)

    def oldest_job(self, now: float) -> float:
        """Seconds the oldest job held by a live worker has been running (0 when none)."""
        oldest = 0.0
        for link in self.links:
            if link.inflight and not link.dead:
                oldest = max(oldest, now - next(iter(link.inflight.values())).sent)
        return oldest

    def worker_died(self, w: WorkerProcess) -> bool:
        """Supervisor: an IO worker exited; the request loop recovers its jobs (:meth:`collect`)."""
        for link in self.links:
            if link.worker is w:
                if not link.dead:
                    link.dead = True
                    self.doorbell.ring()
                return True
        return False

    def collect(self) -> list[Completion]:
        """Every completion the workers posted, then the jobs dead workers had taken (failed
        with WORKER_DIED); dead workers are restarted on the same rings."""
        out: list[Completion] = []
        for link in self.links:
            while True:
                try:
                    d = link.resp.try_pop()
                except RingError:
                    break
                if d is None:
                    break
                job = link.inflight.pop(d.seq, None)
                if job is not None:
                    link.spills -= job.op.kind == P.SPILL
                    out.append(Completion(job, d.status, d.a0, d.flags))
            if link.dead:
                out.extend(self._recover(link))
        return out

    def _recover(self, link: _Link) -> list[Completion]:
        # Completions were drained just before: every job still listed was either taken by
        # the dead worker (lost) or is still in the request ring, the newest `depth` ones.
        queued = link.req.depth
        jobs = list(link.inflight.items())
        lost = jobs[: max(0, len(jobs) - queued)]
        dead_pid = (link.worker.proc.pid if link.worker.proc else 0) or 0
        out = []
        for seq, job in lost:
            del link.inflight[seq]
            link.spills -= job.op.kind == P.SPILL
            out.append(Completion(job, Status.WORKER_DIED, dead_pid=dead_pid))
        self.g[G.WORKER_RESTARTS] += 1
        self.restarted = True
        link.dead = False
        log.error(
            "IO worker %s died with %d job(s) taken: reported failed (spills are retried)",
            link.worker.base,
            len(lost),
        )
        link.worker.respawn()
        return out

    def dispatch(self, ns_raw: dict[int, bytes], spills: bool = True) -> None:
        """Push queued jobs to the least busy live workers, promotes first (spills only when
        ``spills``). ``ns_raw``: each namespace id's fingerprint as the job carries it."""
        live = [link for link in self.links if not link.dead]
        if not live:
            return
        queues = ((self.promote_q, False), (self.spill_q, True)) if spills else ((self.promote_q, False),)
        for q, spill in queues:
            while q:
                job = q[0]
                b = job.op.block
                room = [
                    lk
                    for lk in live
                    if len(lk.inflight) < MAX_INFLIGHT_PER_WORKER
                    and not (spill and lk.spills >= MAX_SPILLS_PER_WORKER)
                ]
                if not spill and self.read_inflight:
                    readers = [lk for lk in live if len(lk.inflight) > lk.spills]
                    if len(readers) >= max(1, self.read_inflight // b.ns.shard_bytes):
                        room = [lk for lk in room if lk in readers]  # no further reader
                if not room:
                    break
                link = min(room, key=lambda lk: len(lk.inflight))
                assert b.slots is not None, "an IO job's block keeps its slots until the job ends"
                self._seq += 1
                flags, args = P.io_job(
                    ns_raw[b.ns.ns_id],
                    b.key,
                    job.rank,
                    b.ns.world_size,
                    b.slots[job.rank],
                    b.ns.shard_bytes,
                )
                try:
                    pushed = link.req.try_push(job.op.kind, self._seq, *args, flags=flags)
                except RingError as exc:
                    log.error("IO worker %s request ring failed: %s", link.worker.base, exc)
                    pushed = False
                if not pushed:
                    return  # ring full (a stuck worker): try again on the next wake-up
                q.popleft()
                job.sent = time.monotonic()
                link.inflight[self._seq] = job
                link.spills += spill

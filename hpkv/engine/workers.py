"""Worker processes as the server sees them: start, NUMA placement, supervision, stop.

A worker owns nothing the server needs to survive its death: its rings and job
arena are created by the server, its counters live in its row of the stats
segment. When a worker dies the server takes over the worker's ends of both rings,
answers the batch that was in flight (the worker's INFLIGHT_SEQ) and every queued
batch with an error completion, so no job is ever reported done that was not, and
no stale job runs later against device blocks the engine has reused; then it
starts a replacement on the same rings.

A worker that is alive but stopped turning its job loop (its heartbeat older than
HPKV_WORKER_HANG_S: a job taken and not finished, or the process stopped) is *hung*:
the server shows it as such, kills it, and then treats it like a dead one.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

from hpkv.common.native import ffi, lib
from hpkv.common.numa import format_cpulist
from hpkv.common.proc import pid_stopped
from hpkv.protocol import wire as P
from hpkv.protocol.errors import Status
from hpkv.protocol.stats import StatsSegment, W, WorkerState
from hpkv.ring import Doorbell, Ring, RingError

if TYPE_CHECKING:
    from hpkv.runtime.fence import SlotFence

log = logging.getLogger("hpkv.workers")

_LIVE = (WorkerState.RUNNING, WorkerState.HUNG)  # states of a worker that had started serving

# A worker that dies within STABLE_S of its start is crash-looping (a layout it rejects, a
# broken installation): its next start waits BACKOFF_S[0], doubling up to BACKOFF_S[1].
STABLE_S = 10.0
BACKOFF_S = (0.5, 30.0)


def ring_counts(directory: str, name: str) -> tuple[int, int] | None:
    """(descriptors ever pushed, ever popped) of ring file ``name``; None if unreadable."""

    pushed = ffi.new("uint64_t *")
    popped = ffi.new("uint64_t *")
    if lib.hpkv_ring_peek_counts(os.path.join(directory, name + ".ring").encode(), pushed, popped) != 0:
        return None
    return int(pushed[0]), int(popped[0])


#: The process main of each kind of worker.
WORKER_MODULES = {
    "transfer": "hpkv.transfer_workers.worker",
    "io": "hpkv.io_workers.worker",
    "remote": "hpkv.io_workers.remote_worker",
}


def worker_file_names(base: str) -> tuple[str, str, str]:
    return f"{base}.req", f"{base}.resp", f"{base}.jobs"


class WorkerProcess:
    """One transfer (or IO) worker process and the files the server made for it."""

    def __init__(
        self,
        directory: str,
        base: str,
        slot: int,
        kind: str,
        device: str,
        spec: dict[str, Any],
        stats: StatsSegment,
    ):
        self.dir = directory
        self.base = base
        self.slot = slot
        self.kind = kind
        self.device = device
        self.spec = spec
        self.stats = stats
        self.req_name, self.resp_name, jobs = worker_file_names(base)
        self.jobs_path = os.path.join(directory, jobs)
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._stopping = False
        self.incarnation = 0  # bumped by every (re)start: a barrier mark is per incarnation
        self._popped_at_spawn = 0  # request-ring pops and JOBS when this incarnation started
        self._jobs_at_spawn = 0
        self._started_at = 0.0
        self._backoff = BACKOFF_S[0]
        self.restart_at: float | None = None  # in back-off: when the next start is due
        self.fence: SlotFence | None = None  # transfer workers: the slot fence they hold slots in

    # ------------------------------------------------------------ start / stop
    @classmethod
    def start_transfer(
        cls,
        directory: str,
        base: str,
        slot: int,
        spec: dict[str, Any],
        device: str,
        stats: StatsSegment,
        fence: SlotFence | None = None,
    ) -> WorkerProcess:
        w = cls(directory, base, slot, "transfer", device, spec, stats)
        w.fence = fence
        # The server only makes the files; the client and the worker attach the ends.
        Ring.create(directory, w.req_name, capacity=P.RING_CAPACITY).close(unlink=False)
        Ring.create(directory, w.resp_name, capacity=P.RING_CAPACITY).close(unlink=False)
        fd = os.open(w.jobs_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, P.JOB_ARENA_BYTES)
        finally:
            os.close(fd)
        row = stats.workers[slot]
        row[:] = 0
        w._spawn()
        return w

    @classmethod
    def start_io(
        cls,
        directory: str,
        base: str,
        slot: int,
        spec: dict[str, Any],
        stats: StatsSegment,
        doorbell: Doorbell,
        kind: str = "io",
    ) -> tuple[WorkerProcess, Ring, Ring]:
        """An IO worker (or, ``kind="remote"``, the remote tier's worker): the server itself
        holds the other end of both rings (it issues the jobs and consumes the completions,
        woken by its doorbell); returns (worker, req, resp)."""
        w = cls(directory, base, slot, kind, "disk" if kind == "io" else "network", spec, stats)
        req = Ring.create(directory, w.req_name, capacity=P.RING_CAPACITY, role="producer")
        resp = Ring.create(
            directory, w.resp_name, capacity=P.RING_CAPACITY, role="consumer", doorbell=doorbell
        )
        stats.workers[slot][:] = 0
        w._spawn()
        return w, req, resp

    def respawn(self) -> None:
        """Start a replacement of a dead worker on the same rings (its jobs are the caller's)."""
        was_running = self.stats.workers[self.slot][W.STATE] in _LIVE
        self.stats.workers[self.slot][W.STATE] = WorkerState.DEAD
        if self.restart_at is None and self._crash_looping(was_running):
            self.stats.workers[self.slot][W.STATE] = WorkerState.BACKOFF
            log.error(
                "%s worker %s (pid %s) died %.1fs after its start (exit status %s); next start in %.1fs",
                self.kind,
                self.base,
                self.proc.pid if self.proc else "?",
                time.monotonic() - self._started_at,
                self.proc.returncode if self.proc else None,
                (self.restart_at or 0.0) - time.monotonic(),
            )
            return
        self.restarts += 1
        log.error(
            "%s worker %s (pid %s) died (exit status %s); restarting (restart %d)",
            self.kind,
            self.base,
            self.proc.pid if self.proc else "?",
            self.proc.returncode if self.proc else None,
            self.restarts,
        )
        self._spawn()

    def _spawn(self) -> None:
        row = self.stats.workers[self.slot]
        row[W.STATE] = WorkerState.STARTING
        row[W.INFLIGHT_SEQ] = 0
        self.restart_at = None
        self.incarnation += 1
        counts = ring_counts(self.dir, self.req_name)
        self._popped_at_spawn = counts[1] if counts else 0
        self._jobs_at_spawn = int(row[W.JOBS])
        self._started_at = time.monotonic()
        args = {
            **self.spec,
            "dir": self.dir,
            "req": self.req_name,
            "resp": self.resp_name,
            "jobs": self.jobs_path,
            "slot": self.slot,
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", WORKER_MODULES[self.kind], json.dumps(args)],
            stdin=subprocess.DEVNULL,
            close_fds=True,
        )
        row[W.PID] = self.proc.pid
        row[W.RESTARTS] = self.restarts
        log.info(
            "%s worker %s started: pid %d, device %s, NUMA node %s, CPUs %s",
            self.kind,
            self.base,
            self.proc.pid,
            self.device,
            self.spec.get("numa_node"),
            format_cpulist(self.spec.get("cpus", [])),
        )

    def stop(self, timeout: float = 3.0) -> None:
        self._stopping = True
        p = self.proc
        if p is not None and p.poll() is None and pid_stopped(p.pid):
            # A stopped worker would not act on SIGTERM, and continued it would finish a job
            # its stop has already given up on (a file written after "NOT written"): killed.
            p.kill()
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning(
                    "worker %s (pid %d) ignored SIGTERM for %.0fs: killing it", self.base, p.pid, timeout
                )
                p.kill()
                p.wait()
        self.stats.workers[self.slot][W.STATE] = WorkerState.STOPPED
        self._release_fence()
        for name in (self.req_name, self.resp_name):
            try:
                os.unlink(os.path.join(self.dir, name + ".ring"))
            except FileNotFoundError:
                pass
        try:
            os.unlink(self.jobs_path)
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------ supervision
    def kill_if_hung(self, hang_s: float) -> bool:
        """Running, alive, and no heartbeat for ``hang_s`` seconds: show it as hung and SIGKILL it
        (the next supervision round fails its jobs and restarts it, as for any dead worker).
        True when it was killed now. ``hang_s`` 0 turns detection off."""
        if hang_s <= 0 or self._stopping or self.proc is None or self.proc.poll() is not None:
            return False
        row = self.stats.workers[self.slot]
        if row[W.STATE] != WorkerState.RUNNING:
            return False
        age = (time.time_ns() - int(row[W.HEARTBEAT_NS])) / 1e9
        if age < hang_s:
            return False
        row[W.STATE] = WorkerState.HUNG
        row[W.HANGS] += 1
        log.error(
            "%s worker %s (pid %d) is hung: no heartbeat for %.1fs (HPKV_WORKER_HANG_S=%g), job seq %d "
            "in flight; killing it, its jobs are reported failed and it is restarted",
            self.kind,
            self.base,
            self.proc.pid,
            age,
            hang_s,
            int(row[W.INFLIGHT_SEQ]),
        )
        self.proc.kill()  # SIGKILL also ends a stopped (SIGSTOP) process
        return True

    def _release_fence(self) -> None:
        """The process is gone: drop the slot holds it left (a copy it was making ends with it),
        before a replacement with the same holder id starts."""
        if self.fence is None:
            return
        n = self.fence.clear_holder(self.slot + 1)
        if n:
            log.warning("worker %s left %d pool slot(s) held by an unfinished save: released", self.base, n)

    def poll_dead(self) -> bool:
        """Dead and due for a restart (not while a back-off delay runs)."""
        if self._stopping or self.proc is None or self.proc.poll() is None:
            return False
        return self.restart_at is None or time.monotonic() >= self.restart_at

    # ------------------------------------------------------------ barriers (transfer workers)
    def mark(self) -> tuple[int, int] | None:
        """A point in this worker's job stream: every job pushed so far. None when the worker
        cannot run anything pushed so far (stopped, or dead: its queue is failed at restart)."""
        if self._stopping or self.proc is None or self.proc.poll() is not None:
            return None
        counts = ring_counts(self.dir, self.req_name)
        if counts is None:
            return None
        return self.incarnation, counts[0] - self._popped_at_spawn

    def passed(self, mark: tuple[int, int] | None) -> bool:
        """Has every job pushed before ``mark`` finished (executed, or failed by a restart)?
        The worker counts JOBS after a job's copy ended, so this never says yes early."""
        if mark is None or self._stopping or self.proc is None or self.proc.poll() is not None:
            return True
        incarnation, target = mark
        if incarnation != self.incarnation:
            return True
        return int(self.stats.workers[self.slot][W.JOBS]) - self._jobs_at_spawn >= target

    def fail_pending_and_restart(self) -> None:
        row = self.stats.workers[self.slot]
        rc = self.proc.returncode if self.proc else None
        was_running = row[W.STATE] in _LIVE
        row[W.STATE] = WorkerState.DEAD
        self._release_fence()
        inflight = int(row[W.INFLIGHT_SEQ])
        failed = unanswered = 0
        try:
            req = Ring.attach(self.dir, self.req_name, role="consumer")
            resp = Ring.attach(self.dir, self.resp_name, role="producer")
            try:
                # Never waits for room (this runs under the server's lock, and the reader of
                # the answers may be the server itself): a job whose answer does not fit is
                # timed out by its client.
                seqs = [inflight] if inflight else []
                while (d := req.try_pop()) is not None:
                    seqs.append(d.seq)
                for seq in seqs:
                    if unanswered or not resp.try_push(P.ERROR, seq, status=Status.WORKER_DIED):
                        unanswered += 1
                    else:
                        failed += 1
                if unanswered:
                    log.warning(
                        "worker %s: %d failed job(s) not reported (its answer ring is full); "
                        "their client times them out",
                        self.base,
                        unanswered,
                    )
            finally:
                req.close()
                resp.close()
        except RingError as exc:
            log.error(
                "worker %s: cannot fail its pending jobs (%s); the client will time them out", self.base, exc
            )
        row[W.JOBS_FAILED] += failed
        if self.restart_at is None and self._crash_looping(was_running):
            row[W.STATE] = WorkerState.BACKOFF
            log.error(
                "%s worker %s (pid %s) died %.1fs after its start (exit status %s); %d job(s) "
                "reported failed; next start in %.1fs (see its log lines above)",
                self.kind,
                self.base,
                self.proc.pid if self.proc else "?",
                time.monotonic() - self._started_at,
                rc,
                failed,
                (self.restart_at or 0.0) - time.monotonic(),
            )
            return
        self.restarts += 1
        log.error(
            "%s worker %s (pid %s) died (exit status %s); %d job(s) reported failed; restarting (restart %d)",
            self.kind,
            self.base,
            self.proc.pid if self.proc else "?",
            rc,
            failed,
            self.restarts,
        )
        self._spawn()

    def _crash_looping(self, was_running: bool) -> bool:
        """Died during its start-up, or crashed soon after it (not killed from outside): set
        ``restart_at`` (a growing delay) and say so."""
        rc = self.proc.returncode if self.proc else None
        killed = rc in (-signal.SIGKILL, -signal.SIGTERM)
        if was_running and (killed or time.monotonic() - self._started_at >= STABLE_S):
            self._backoff = BACKOFF_S[0]
            return False
        self.restart_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, BACKOFF_S[1])
        return True

    def describe(self) -> dict[str, Any]:
        return {
            "slot": self.slot,
            "kind": self.kind,
            "name": self.base,
            "device": self.device,
            "numa_node": self.spec.get("numa_node"),
            "cpus": self.spec.get("cpus", []),
            "restarts": self.restarts,
            "rings": [self.req_name, self.resp_name],
            "backoff_s": round(max(0.0, self.restart_at - time.monotonic()), 1)
            if self.restart_at is not None
            else 0.0,
        }

"""What every worker process (transfer or IO) does besides its own job.

Started by the server with one JSON argument (the spec), a worker sets up
logging, ignores Ctrl-C (the server decides when it stops), stops on SIGTERM or
when the server is gone, publishes its pid, state, heartbeat and counters in its
row of the stats segment, and runs one loop: pop a descriptor, mark it in flight
(so the server can fail it if we die), execute it, push the completion. A handler may
also hand a job on to a thread of its own, which completes it later (:meth:`finish`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from hpkv.protocol import wire as P
from hpkv.protocol.stats import G, StatsSegment, W, WorkerState
from hpkv.ring import Desc, PeerDead, Ring, RingError, RingTimeout
from hpkv.runtime.logs import setup_logging

#: A job handler: the descriptor → (status, bytes moved, completion flags), or None when it
#: handed the job on and calls :meth:`WorkerRuntime.finish` for it later.
Handler = Callable[[Desc], "tuple[int, int, int] | None"]


class WorkerRuntime:
    def __init__(self, argv: list[str], log: logging.Logger):
        self.spec = json.loads(argv[0])
        self.log = log
        setup_logging(self.spec["dir"], self.spec.get("log_level", "INFO"), to_stderr=True)
        self.stopping = False
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.parent = os.getppid()
        self.stats = StatsSegment.attach(self.spec["dir"], writable=True)
        self.row = self.stats.workers[self.spec["slot"]]
        self._resp: Ring | None = None
        self._finish_lock = threading.Lock()  # the completion ring and the job counters
        self._active = 0  # jobs taken, not finished
        self._busy_mark = 0  # when BUSY_NS was last brought up to date

    def pool_warm_bytes(self) -> int:
        """How much of the pool, from its start, the server has allocated so far."""
        return int(self.stats.glob[G.POOL_WARM])

    def _on_term(self, signum, _frame) -> None:
        self.stopping = True

    def finish(self, d: Desc, status: int, nbytes: int, flags: int = 0) -> None:
        """Push the completion of job ``d`` and count it; any thread may call it, once per job."""
        with self._finish_lock:
            self._count_busy(-1)
            row = self.row
            row[W.JOBS] += 1
            if status:
                row[W.JOBS_FAILED] += 1
            try:
                assert self._resp is not None
                self._resp.push(
                    P.COMPLETION if status == 0 else P.ERROR,
                    d.seq,
                    nbytes,
                    status=status,
                    flags=flags,
                    timeout=5.0,
                )
            except RingError as exc:
                self.log.warning("cannot post the completion of seq %d: %s", d.seq, exc)

    def _count_busy(self, change: int) -> None:
        """Busy = time with at least one job taken, brought up to date at every job's start and
        end (lock held), so the monitor's rate stays 0..1 while jobs overlap."""
        now = time.perf_counter_ns()
        if self._active:
            self.row[W.BUSY_NS] += now - self._busy_mark
        self._busy_mark = now
        self._active += change

    def serve(
        self,
        handle: Handler,
        *,
        exit_when_producer_gone: bool,
        drain: Callable[[], None] | None = None,
    ) -> int:
        """Run the job loop until SIGTERM, the server's exit, or (IO workers) the server closing
        the ring. ``drain`` runs after the loop, while the completion ring is still open: it
        finishes the jobs the handler handed on."""
        spec, row, log = self.spec, self.row, self.log
        req = Ring.attach(spec["dir"], spec["req"], role="consumer", slice_ms=50)
        resp = self._resp = Ring.attach(spec["dir"], spec["resp"], role="producer")
        row[W.PID] = os.getpid()
        row[W.HEARTBEAT_NS] = time.time_ns()  # before RUNNING: the server judges hangs by its age
        row[W.STATE] = WorkerState.RUNNING
        try:
            while not self.stopping:
                row[W.HEARTBEAT_NS] = time.time_ns()
                if os.getppid() != self.parent:
                    log.warning("the server (pid %d) is gone: exiting", self.parent)
                    break
                try:
                    d = req.pop(timeout=0.5)
                except RingTimeout:
                    continue
                except PeerDead:
                    if exit_when_producer_gone:
                        log.warning("the producer of %s is gone: exiting", spec["req"])
                        break
                    time.sleep(0.05)  # the client went away; the server will stop us
                    continue
                except RingError as exc:
                    log.error("request ring failed: %s", exc)
                    break
                row[W.INFLIGHT_SEQ] = d.seq
                with self._finish_lock:
                    self._count_busy(+1)
                done = handle(d)
                if done is not None:
                    self.finish(d, *done)
                row[W.INFLIGHT_SEQ] = 0
        finally:
            if drain is not None:
                drain()
            row[W.STATE] = WorkerState.STOPPED
            req.close()
            resp.close()
        return 0

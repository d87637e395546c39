"""A device's transfer workers, as a client drives them: copy jobs over each worker's rings."""

from __future__ import annotations

import errno
import threading
import time
from typing import Any

import numpy as np

from hpkv.common import shm
from hpkv.common.proc import pid_alive
from hpkv.protocol import wire as P
from hpkv.protocol.errors import HpkvUnavailable
from hpkv.ring import PeerDead, Ring, RingTimeout


class _WorkerLink:
    def __init__(self, directory: str, info: dict[str, Any]):
        self.req = Ring.attach(directory, info["req"], role="producer", wait=5.0)
        self.resp = Ring.attach(directory, info["resp"], role="consumer", wait=5.0)
        self.jobs = np.frombuffer(shm.map_file(info["jobs"]), dtype=np.int64).reshape(P.JOB_SLOTS, -1)
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

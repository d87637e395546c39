"""Following the server of one pool directory through its stats segment.

A :class:`Watcher` is polled once per refresh. Each poll finds out whether a
server holds the pool directory's lock, (re)attaches its stats segment when the
server is new, takes a snapshot and the ring fill levels, and turns counters
into per-second rates over the interval since the previous poll. The last
minute of rates is kept for the sparklines.

Counters are differenced per component (a namespace, a worker process), not as
sums: a worker that exits or a client that detaches takes its counters out of
the sum, which must not read as a negative rate.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from hpkv.config import Config
from hpkv.monitor.rings import RingLevel, peek_all
from hpkv.monitor.status import server_pid
from hpkv.protocol.stats import H, StatsSegment, StatsVersionError

#: Seconds of history behind each sparkline.
HISTORY_S = 60.0

#: The rate series shown in the traffic section, in display order.
SERIES = (
    "hits_dram",
    "tokens_dram",
    "hits_storage",
    "tokens_storage",
    "misses",
    "lookups",
    "dev_save",
    "dev_load",
    "io_write",
    "io_read",
)

#: A server whose heartbeat is older than this is shown as not responding.
STALE_HEARTBEAT_S = 5.0


@dataclass
class View:
    """Everything one frame shows; built by :meth:`Watcher.poll`, rendered by :mod:`hpkv.monitor.frame`."""

    pool_dir: str
    status: str  # "up", "none" (no server), "starting" (lock held, no segment yet)
    wall_time: float = field(default_factory=time.time)
    pid: int | None = None
    gone: tuple[int, float] | None = None  # (pid, wall time) of the last server that went away
    snap: dict[str, Any] | None = None
    rings: dict[str, RingLevel | None] = field(default_factory=dict)
    totals: dict[str, int] = field(default_factory=dict)  # series -> counter value now
    rates: dict[str, float] = field(default_factory=dict)  # series -> per second
    history: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # series -> [(age_s, rate)]
    worker_busy: dict[int, float] = field(default_factory=dict)  # slot -> busy fraction 0..1
    interval: float = 1.0
    source: str = ""  # where the pool directory setting came from
    error: str | None = None  # a transient read problem, shown in the title line

    @property
    def heartbeat_stale(self) -> bool:
        return self.snap is not None and self.snap["server"].get("heartbeat_age_s", 0.0) > STALE_HEARTBEAT_S


def ring_names(snap: dict[str, Any]) -> list[str]:
    """Every ring of the server: the clients' request/response rings and each worker's pair."""
    names = [r["name"] for r in snap.get("rings", [])]
    for w in snap.get("workers", []):
        names.extend(w.get("rings", []))
    return list(dict.fromkeys(names))


def components(snap: dict[str, Any]) -> dict[str, dict[Any, int]]:
    """Each rate series as {component: counter}; a component keeps its key while its counter lives."""
    out: dict[str, dict[Any, int]] = {s: {} for s in SERIES}
    out["busy_ns"] = {}
    for ns in snap.get("namespaces", []):
        key = ns["id"]
        tokens = int(ns.get("block_tokens") or 0)
        out["hits_dram"][key] = ns.get("hits_dram", 0)
        out["tokens_dram"][key] = ns.get("hits_dram", 0) * tokens
        out["hits_storage"][key] = ns.get("hits_storage", 0)
        out["tokens_storage"][key] = ns.get("hits_storage", 0) * tokens
        out["misses"][key] = ns.get("misses", 0)
        out["lookups"][key] = ns.get("lookups", 0)
    io_seen = False
    for w in snap.get("workers", []):
        key = (w["slot"], w.get("pid", 0))
        out["busy_ns"][key] = w.get("busy_ns", 0)
        if w.get("kind") == "io":
            io_seen = True
            out["io_write"][key] = w.get("bytes_saved", 0)  # pool -> file
            out["io_read"][key] = w.get("bytes_loaded", 0)  # file -> pool
        else:
            out["dev_save"][key] = w.get("bytes_saved", 0)  # device -> pool
            out["dev_load"][key] = w.get("bytes_loaded", 0)  # pool -> device
    storage = snap.get("storage") or {}
    if not io_seen and storage:
        out["io_write"]["storage"] = storage.get("bytes_written", 0)
        out["io_read"]["storage"] = storage.get("bytes_read", 0)
    return out


def _delta(prev: dict[Any, int], cur: dict[Any, int]) -> int:
    return sum(max(0, v - prev[k]) for k, v in cur.items() if k in prev)


class Watcher:
    """Follows whichever server serves ``cfg.pool_dir``, across restarts; never raises on a gone server."""

    def __init__(self, cfg: Config, interval: float = 1.0):
        self.cfg = cfg
        self.interval = interval
        self.seg: StatsSegment | None = None
        self.pid: int | None = None
        self.gone: tuple[int, float] | None = None
        self._prev: tuple[float, dict[str, dict[Any, int]]] | None = None
        self._history: dict[str, deque[tuple[float, float]]] = {s: deque() for s in SERIES}
        self._last_snap: dict[str, Any] | None = None

    @property
    def pool_dir(self) -> str:
        return self.cfg.pool_dir

    def _view(self, status: str, **kw: Any) -> View:
        return View(
            self.pool_dir,
            status,
            gone=self.gone,
            interval=self.interval,
            source=str(self.cfg.source("HPKV_SHARE_MEM_FILE_PATH")),
            **kw,
        )

    def poll(self) -> View:
        """The state of the pool directory now; a server vanishing mid-read reads as no server."""
        try:
            return self._poll()
        except OSError as exc:
            self._forget()
            return self._view("none", error=f"reading {self.pool_dir} failed: {exc}")

    def _poll(self) -> View:

        now = time.monotonic()
        pid = server_pid(self.cfg)
        if pid is None:
            self._forget()
            return self._view("none")
        if self.seg is None or pid != self.pid:
            self._forget()
            try:
                if not self._attach(pid):
                    return self._view("starting", pid=pid)
            except StatsVersionError as exc:  # not starting: it will never publish what we read
                return self._view("starting", pid=pid, error=str(exc))
        seg = self.seg
        if seg is None:
            return self._view("starting", pid=pid)
        error = None
        try:
            snap = seg.snapshot()
            self._last_snap = snap
        except (TimeoutError, ValueError) as exc:  # catalog rewritten under us, or torn JSON
            if self._last_snap is None:
                return self._view("starting", pid=pid)
            snap, error = self._last_snap, f"stats catalog unreadable ({exc}); showing the previous one"
        view = self._view("up", pid=pid, snap=snap, error=error)
        view.rings = peek_all(self.pool_dir, ring_names(snap))
        self._rates(now, snap, view)
        return view

    # ------------------------------------------------------------ attach / detach
    def _attach(self, pid: int) -> bool:

        try:
            seg = StatsSegment.attach(self.pool_dir)
        except StatsVersionError:
            raise
        except (FileNotFoundError, ValueError, OSError):
            return False  # the server holds the lock but has not published its segment yet
        if int(seg.header[H.SERVER_PID]) != pid:
            seg.close()  # the previous server's file, about to be replaced
            return False
        self.seg, self.pid = seg, pid
        self.gone = None
        return True

    def _forget(self) -> None:
        if self.seg is not None:
            if self.pid is not None:
                self.gone = (self.pid, time.time())
            self.seg.close()
        self.seg, self.pid = None, None
        self._prev, self._last_snap = None, None
        for h in self._history.values():
            h.clear()

    def close(self) -> None:
        if self.seg is not None:
            self.seg.close()
            self.seg = None

    # ------------------------------------------------------------ rates
    def _rates(self, now: float, snap: dict[str, Any], view: View) -> None:
        comps = components(snap)
        view.totals = {s: sum(c.values()) for s, c in comps.items() if s in SERIES}
        if self._prev is not None and now - self._prev[0] > 1e-3:
            t0, prev = self._prev
            dt = now - t0
            view.rates = {s: _delta(prev[s], comps[s]) / dt for s in SERIES}
            for w in snap.get("workers", []):
                key = (w["slot"], w.get("pid", 0))
                if key in prev["busy_ns"]:
                    busy = max(0, comps["busy_ns"][key] - prev["busy_ns"][key])
                    view.worker_busy[w["slot"]] = busy / (dt * 1e9)
            for s in SERIES:
                h = self._history[s]
                h.append((now, view.rates[s]))
                while h and now - h[0][0] > HISTORY_S:
                    h.popleft()
        else:
            view.rates = {s: 0.0 for s in SERIES}
        view.history = {s: [(now - t, r) for t, r in h] for s, h in self._history.items()}
        self._prev = (now, comps)

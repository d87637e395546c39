"""The server's supervisor thread: a heartbeat, hung and dead workers killed and restarted,
clients whose process exited dropped, leases expired, deferred releases made, the idle exit of
an auto-spawned server; and the catalog `hpkv status` and hpkv-top read.

:class:`Supervision` is a part of :class:`hpkv.engine.server.Server` (its base class), like
:class:`hpkv.engine.registry.Registry`, on the server's state and under its lock.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from hpkv.common.proc import pid_alive
from hpkv.engine.registry import Registry
from hpkv.protocol.stats import G

log = logging.getLogger("hpkv.server")

MAX_CATALOG_ENTRIES = 256  # clients and holds listed in the stats catalog (the rest counted)


class Supervision(Registry):
    """The supervisor thread's rounds and the catalog (see the module docstring)."""

    # The server's state these methods use, beside the registry's.
    auto: bool
    idle_exit: float
    down: threading.Event
    stop_event: threading.Event
    _holds: dict[int, Any]

    if TYPE_CHECKING:

        def _expire_leases(self) -> None: ...
        def _release_due(self) -> None: ...
        def _publish_pool_gauges(self) -> None: ...

    def _supervisor_loop(self) -> None:
        while not self.down.wait(0.2):
            try:
                self._supervise_once()
            except Exception:  # noqa: BLE001 - supervision must keep running
                log.exception("supervisor step failed")

    def _supervise_once(self) -> None:
        now = time.time_ns()
        self.stats.header[4] = now  # heartbeat
        with self.lock:
            self._supervise_workers()
            for c in list(self.clients.values()):
                if c.alive and not pid_alive(c.pid):
                    self._drop_client(c, reason=f"process {c.pid} exited")
            self._expire_leases()
            self._release_due()
            if self._kv_orphans:
                self._remove_orphan_kv_files()
            if self.index.reclaim_fenced():  # slots whose last save ended since their release
                self._publish_pool_gauges()
            if self.tiers.take_catalog_dirty():
                self._catalog_dirty = True
            if self._catalog_dirty:
                self._publish_catalog()
            idle = (
                not self.clients
                and not self._holds
                and self.idle_exit > 0
                and not self.stop_event.is_set()
                and time.monotonic() - self._last_client_seen > self.idle_exit
            )
            if idle:  # under the lock: a `hold` is either counted above or refused
                self.stop_event.set()
        if idle:
            log.info("no client for %.0fs (HPKV_SERVER_IDLE_EXIT): exiting", self.idle_exit)
            self.doorbell.ring()

    def _supervise_workers(self) -> None:
        """Kill hung workers (HPKV_WORKER_HANG_S), restart dead ones and fail their jobs."""
        hang_s = self.cfg["HPKV_WORKER_HANG_S"]
        for w in list(self.workers):
            if w.kill_if_hung(hang_s):
                self._catalog_dirty = True
                continue  # reaped next round: `hpkv status` shows it hung until then
            if not w.poll_dead():
                continue
            if w.kind in ("io", "remote") and self.tiers.worker_died(w):
                continue  # its tier's request loop recovers its jobs and restarts it
            before = w.restarts
            w.fail_pending_and_restart()  # or a back-off delay, if it keeps failing
            self.stats.glob[G.WORKER_RESTARTS] += w.restarts - before
            self._catalog_dirty = True

    def _publish_catalog_if_dirty(self) -> None:
        with self.lock:
            if self._catalog_dirty:
                self._publish_catalog()

    def _publish_catalog(self) -> None:
        """Write the catalog `hpkv status` and hpkv-top read. Its lists of clients and holds are
        capped (the rest counted in ``*_omitted``) and halved until it fits the segment: a
        catalog that does not fit must never fail the hello or `stats` call that wrote it."""
        self._catalog_dirty = False
        catalog = self._catalog()
        full = {key: catalog[key] for key in ("clients", "holds", "rings")}
        limit = MAX_CATALOG_ENTRIES
        while True:
            for key, items in full.items():
                catalog[key] = items[: 2 * limit if key == "rings" else limit]
                catalog[f"{key}_omitted"] = len(items) - len(catalog[key])
            try:
                self.stats.write_catalog(catalog)
                return
            except ValueError as exc:  # too large
                if limit == 0:
                    self._errors.log(logging.ERROR, "catalog", "stats catalog not updated: %s", exc)
                    return
                limit //= 2
                self._errors.log(
                    logging.WARNING,
                    "catalog-full",
                    "stats catalog too large (%s): lists cut to %d",
                    exc,
                    limit,
                )

    def _catalog(self) -> dict[str, Any]:
        return {
            "server": {
                "pool_dir": self.dir,
                "pool_file": self.pool.path,
                "storage": self.cfg.storage_path,
                "auto": self.auto,
                "pool_locked": self.pool.locked,
            },
            "namespaces": [
                {
                    "id": ns.ns_id,
                    "name": ns.name,
                    "fingerprint": ns.fingerprint,
                    "world_size": ns.world_size,
                    "shard_bytes": ns.shard_bytes,
                    "block_tokens": ns.block_tokens,
                }
                for ns in self.namespaces_by_fp.values()
            ],
            "workers": [w.describe() for w in self.workers],
            "clients": [
                {
                    "id": c.cid,
                    "pid": c.pid,
                    "name": c.name,
                    "namespaces": sorted(c.namespaces),
                    "ranks": sorted(c.ranks),
                }
                for c in self.clients.values()
            ],
            "holds": [{"pid": h.pid, "name": h.hold} for h in self._holds.values()],
            "rings": [
                {"name": r.name, "capacity": r.capacity}
                for c in self.clients.values()
                for r in (c.req, c.resp)
            ],
            "storage": self.tiers.describe(),
        }

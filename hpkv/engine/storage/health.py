"""The storage tier's state as monitors show it: ok, or degraded with a reason and since when.

Degraded means the file system answers late or not at all (a hung or slow mount): lookups
end their prefix at the first storage block, promotes answer storage blocks missing at once,
new spills beyond a bound are dropped, and nothing waits on the mount; the DRAM pool serves
as usual. Nothing needs doing to recover: the state goes
back to ok by itself once nothing is overdue. The request loop evaluates it on every poll
(:meth:`Health.update`); the gauge ``G.STORAGE_DEGRADED`` and the catalog's ``state``,
``degraded_reason`` and ``degraded_since`` carry it to ``hpkv status``, hpkv-top and
Prometheus.
"""

from __future__ import annotations

import logging
import time

from hpkv.protocol.stats import G

log = logging.getLogger("hpkv.storage")


class Health:
    def __init__(self, glob):
        self.g = glob
        self.reason: str | None = None
        self.since: float | None = None  # wall-clock time it became degraded
        self._changed = False

    @property
    def degraded(self) -> bool:
        return self.reason is not None

    def update(self, reason: str | None) -> None:
        """The current reason to be degraded (None: all is well); logs the transitions."""
        if reason is not None and self.reason is None:
            self.since = time.time()
            log.warning(
                "storage degraded: %s. Storage blocks are misses and nothing waits on the file "
                "system (DRAM keeps serving) until it answers again",
                reason,
            )
        elif reason is None and self.reason is not None:
            log.warning(
                "storage recovered after %.1fs (was: %s)",
                time.time() - (self.since or time.time()),
                self.reason,
            )
            self.since = None
        if reason != self.reason:
            self._changed = (reason is None) != (self.reason is None) or self._changed
            self.reason = reason
        self.g[G.STORAGE_DEGRADED] = int(reason is not None)

    def take_changed(self) -> bool:
        changed, self._changed = self._changed, False
        return changed

    def describe(self) -> dict:
        return {
            "state": "degraded" if self.reason else "ok",
            "degraded_reason": self.reason,
            "degraded_since": self.since,
        }

"""Logging for errors that can repeat a thousand times a second (a full disk, a dead mount)."""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    """Logs the first event of each kind, then at most one line per ``interval`` seconds
    per kind, saying how many were suppressed in between; every event is still counted
    by the caller's own counters."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0):
        self.logger = logger
        self.interval = interval
        self._last: dict[str, float] = {}  # kinds are a fixed set: never pruned
        self._suppressed: dict[str, int] = {}

    def log(self, level: int, kind: str, msg: str, *args: object, exc_info: bool = False) -> None:
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return
        self._last[kind] = now
        n = self._suppressed.pop(kind, 0)
        if n and last is not None:
            msg += f" ({n} more like it in the last {now - last:.0f}s not logged)"
        self.logger.log(level, msg, *args, exc_info=exc_info)

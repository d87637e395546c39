"""An hpkv client that, once lost, is re-established in the background (never blocking a step).

Engine-agnostic: every connector (vLLM, SGLang) holds its hpkv connection through one.
The operator hears of an outage twice: once when hpkv goes away (with the reason) and
once when it is back; the retries in between log at debug level only.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from hpkv.client.contract import KvStore

RECONNECT_INTERVAL_S = 10.0
#: The first retry after a failed attempt; each further one waits twice as long, up to
#: RECONNECT_INTERVAL_S. A start-up race (a connection reset while the server comes up)
#: then costs a second of recomputing, not ten or more.
FIRST_RETRY_S = 1.0

C = TypeVar("C", bound=KvStore)


class Reconnecting(Generic[C]):
    def __init__(
        self,
        what: str,
        connect_fn: Callable[[], C],
        log: logging.Logger,
        interval_s: float = RECONNECT_INTERVAL_S,
        first_retry_s: float = FIRST_RETRY_S,
    ):
        self.what = what
        self.client: C | None = None
        self._connect_fn = connect_fn
        self._log = log
        self._interval = interval_s
        self._first_retry = min(first_retry_s, interval_s)
        self._failures = 0  # attempts failed in a row
        self._lock = threading.Lock()
        self._next_try = 0.0
        self._thread: threading.Thread | None = None
        self._down_since: float | None = None  # monotonic time hpkv went away, while it is away

    def get(self) -> C | None:
        """The client, or None (then a connection attempt runs in the background)."""
        c = self.client
        if c is not None:
            return c
        now = time.monotonic()
        with self._lock:
            if self._thread is None and now >= self._next_try:
                self._next_try = now + self._interval
                self._thread = threading.Thread(
                    target=self._run, name=f"hpkv-{self.what}-connect", daemon=True
                )
                self._thread.start()
        return None

    def connect_now(self, timeout: float) -> None:
        self.get()
        t = self._thread
        if t is not None:
            t.join(timeout)

    def _run(self) -> None:
        try:
            client = self._connect_fn()
        except Exception as exc:  # noqa: BLE001 - any failure means: recompute, retry later
            with self._lock:
                self._failures += 1
                wait = min(self._interval, self._first_retry * 2 ** (self._failures - 1))
                self._next_try = time.monotonic() + wait
            if self._down_since is None:
                self._down_since = time.monotonic()
                self._log.warning(
                    "hpkv %s: cannot reach the hpkv server (%s); the engine recomputes "
                    "until it is back (retrying after %gs, then less often, at least every %.0fs; "
                    "logged again when it is back)",
                    self.what,
                    exc,
                    self._first_retry,
                    self._interval,
                )
            else:
                self._log.debug("hpkv %s: still no hpkv server (%s)", self.what, exc)
        else:
            self._failures = 0
            if self._down_since is not None:
                self._log.warning(
                    "hpkv %s: the hpkv server is back (pid %d) after %.0fs",
                    self.what,
                    client.server_pid,
                    time.monotonic() - self._down_since,
                )
                self._down_since = None
            self.client = client
        finally:
            with self._lock:
                self._thread = None

    def lost(self, exc: BaseException) -> None:
        """A call failed: drop the client (the next :meth:`get` reconnects in the background)."""
        c = self.client
        self.client = None
        if c is not None:
            if self._down_since is None:
                self._down_since = time.monotonic()
                self._log.warning(
                    "hpkv %s: lost the hpkv server (%s); the engine recomputes until it is back",
                    self.what,
                    exc,
                )
            with contextlib.suppress(Exception):
                c.close()

    def close(self) -> None:
        c, self.client = self.client, None
        if c is not None:
            with contextlib.suppress(Exception):
                c.close()

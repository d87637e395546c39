"""The one error model of hpkv.

* On the wire (descriptor ``status``): 0, ``-errno``, or a :class:`Status` (defined once,
  in native/ring.h, like the descriptor kinds).
* In Python: one exception type per meaning, all :class:`HpkvError`; a connector catches
  :class:`HpkvError` and recomputes.
* Per-row results of a vector call (reserve, pin, promote) use the named sentinels below,
  because one row failing must not fail the others.
* Processes exit with an :class:`ExitCode`.
"""

from __future__ import annotations

import errno
import os
from enum import IntEnum
from typing import Any

from hpkv.common.native import lib


class Status(IntEnum):
    OK = lib.HPKV_OK
    NO_NAMESPACE = lib.HPKV_E_NO_NAMESPACE
    TOO_MANY_KEYS = lib.HPKV_E_TOO_MANY_KEYS
    BAD_REQUEST = lib.HPKV_E_BAD_REQUEST
    WORKER_DIED = lib.HPKV_E_WORKER_DIED
    CORRUPT = lib.HPKV_E_CORRUPT
    NOT_OWNER = lib.HPKV_E_NOT_OWNER
    INTERNAL = lib.HPKV_E_INTERNAL
    STALE_SLOT = lib.HPKV_E_STALE_SLOT


_MESSAGES = {
    Status.NO_NAMESPACE: "namespace not attached",
    Status.TOO_MANY_KEYS: "too many keys in one call",
    Status.BAD_REQUEST: "bad request",
    Status.WORKER_DIED: "the worker died during the job",
    Status.CORRUPT: "KV file corrupt (quarantined)",
    Status.NOT_OWNER: "the reservation belongs to another client",
    Status.INTERNAL: "internal server error (see server.log)",
    Status.STALE_SLOT: "the reservation was released before the save: nothing written",
}


def status_message(status: int) -> str:
    """Words for a descriptor status: a :class:`Status`, ``-errno`` or 0."""
    if status in _MESSAGES:
        return _MESSAGES[Status(status)]
    return os.strerror(-status) if status < 0 else "ok"


# Sentinels in the per-row answers of vector calls (pool byte offsets otherwise).
ROW_PRESENT = -1  # reserve: already stored or being written, nothing to write
ROW_POOL_FULL = -2  # reserve: no slot (the pool is full of unevictable blocks)
ROW_MISSING = -1  # pin/promote: not available (evicted, unreadable, or timed out)


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1  # the command ran and failed (bad config, no server to stop …)
    USAGE = 2  # bad command line
    ALREADY_SERVED = 3  # ``hpkv serve``: another server holds the pool directory


class HpkvError(RuntimeError):
    """The server refused a call; :attr:`status` says why (a :class:`Status` or -errno)."""

    default_status: int = Status.BAD_REQUEST

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = self.default_status if status is None else status


class HpkvUnavailable(HpkvError):
    """No server answered in time, or the connection broke: recompute instead."""

    default_status = -errno.ETIMEDOUT


class NamespaceNotAttached(HpkvError):
    """The namespace id is not (or no longer) attached for this client."""

    default_status = Status.NO_NAMESPACE


class CallTooLarge(HpkvError):
    """The keys of one call, or its answer, do not fit the mailbox; split the call."""

    default_status = Status.TOO_MANY_KEYS


class NotOwner(HpkvError):
    """A commit or abort named a reservation another client made."""

    default_status = Status.NOT_OWNER


class ServerFault(HpkvError):
    """The server failed inside the call (its log says why); it keeps serving."""

    default_status = Status.INTERNAL


# A control connection refused because the server has as many as it keeps (or no
# descriptor left): the client recomputes, as when no server answers.
TOO_MANY_CONNECTIONS = -errno.EUSERS

_EXCEPTIONS: dict[int, type[HpkvError]] = {
    TOO_MANY_CONNECTIONS: HpkvUnavailable,
    Status.NO_NAMESPACE: NamespaceNotAttached,
    Status.TOO_MANY_KEYS: CallTooLarge,
    Status.NOT_OWNER: NotOwner,
    Status.INTERNAL: ServerFault,
}


def error_for(status: int, what: str, detail: str | None = None) -> HpkvError:
    """The exception for a failed call ``what`` answered with ``status`` (and the server's words)."""
    return _EXCEPTIONS.get(status, HpkvError)(f"{what} failed: {detail or status_message(status)}", status)


def refusal(status: int, error: str) -> dict[str, Any]:
    """A control call's reply when it failed (the JSON form of an :class:`HpkvError`)."""
    return {"ok": False, "status": int(status), "error": error}


def raise_refusal(reply: dict[str, Any], what: str) -> None:
    """Raise the :class:`HpkvError` a control reply carries, if it is a refusal."""
    if not reply.get("ok"):
        raise error_for(int(reply.get("status", Status.BAD_REQUEST)), what, str(reply.get("error")))

"""Exceptions raised by rings and doorbells."""

from __future__ import annotations


class RingError(Exception):
    """Base class: a ring or doorbell could not be created, attached or used."""


class PeerDead(RingError):
    """The other end's process is gone (killed, crashed, or it closed its end).

    Raised by blocking waits instead of hanging; descriptors already in the
    ring were delivered first. The ring cannot be used with that peer again:
    recreate or re-attach.
    """


class PeerClosed(PeerDead):
    """The other end closed its end cleanly (a :class:`PeerDead` that said goodbye)."""


class RingTimeout(RingError, TimeoutError):
    """A blocking push/pop did not complete within its timeout (the peer is alive)."""


class RingExists(RingError, FileExistsError):
    """``create`` found the name held by a live creator (or a stale file, with replace_stale=False)."""


class RingNotFound(RingError, FileNotFoundError):
    """``attach`` found no ring or doorbell file of that name."""


class RingBusy(RingError):
    """The end asked for is held by another live process (one producer, one consumer)."""


class RingClosed(RingError):
    """The ring or doorbell was closed in this process."""

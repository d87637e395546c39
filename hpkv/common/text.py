"""Text a client chose (its name, a namespace's name) made safe for a log line or a terminal."""

from __future__ import annotations


def printable(text: object, limit: int) -> str:
    """``text`` with every non-printable character (newline, escape, other control and format
    characters) written as its Python escape (``\\n``, ``\\x1b``, ``\\u202e``), cut to ``limit``
    characters with a trailing ``…`` when longer: one line that cannot forge another line of
    ``server.log`` nor move the cursor of a terminal running ``hpkv status``."""
    s = text if isinstance(text, str) else str(text)
    if not s.isprintable():
        s = "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in s)
    return s if len(s) <= limit else s[: max(limit - 1, 0)] + "…"

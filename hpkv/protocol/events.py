"""The records of the server's event log (control call ``events``): the format both sides read.

A record is a block's 16-byte key and one code byte: the tier it entered
(``hpkv.protocol.wire.Tier``: 1 DRAM pool, 2 storage), with :data:`REMOVED` set when it left
that tier (evicted, dropped by a clear, deleted for capacity, found corrupt or missing). The
server keeps them per namespace (:mod:`hpkv.engine.events`); an engine's connector turns the
keys it knows into its own KV events (:mod:`hpkv.connectors.vllm.events`).
"""

from __future__ import annotations

from hpkv.protocol.keys import KEY_BYTES

RECORD = KEY_BYTES + 1  # the key, then its code
REMOVED = 0x80


def decode(records: bytes) -> list[tuple[bytes, int]]:
    """(key, code) of each record."""
    return [(records[i : i + KEY_BYTES], records[i + KEY_BYTES]) for i in range(0, len(records), RECORD)]

"""The IO worker process (:mod:`.worker`) and the KV file format it shares with the server:
:mod:`.kvfile` (the one definition of the format and paths), :mod:`.tree` (every path below
the storage root, resolved beneath it) and :mod:`.checksum` (CRC32C). The server's side of
the storage tier is :mod:`hpkv.engine.storage`. Imports no server code."""

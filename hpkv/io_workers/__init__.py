"""The storage tier: KV files (:mod:`.kvfile`, the one definition of the format and paths),
the O_DIRECT probe (:mod:`.probe`), the IO worker process (:mod:`.worker`) and what the
server runs for it (:mod:`.tier`). CRC32C lives in :mod:`.checksum`."""

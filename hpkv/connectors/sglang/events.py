"""KV events for cache-aware routers: hpkv's tiers as SGLang ``BlockStored`` / ``BlockRemoved``.

SGLang publishes KV events (``--kv-events-config``, ZMQ + msgpack) from its scheduler: what its
radix cache records (GPU, and its own host pool as ``CPU_PINNED``). It publishes nothing for
its storage backend (L3). hpkv's plugin adds hpkv's tier changes of the pages this engine
backed up to hpkv (:mod:`hpkv.connectors.sglang.plugin`), with the hashes, parents and tokens
SGLang's own events give the same pages, so a router can match them:

* medium ``EXTERNAL`` (SGLang's "shared / remote pool"): hpkv's DRAM pool, shared by every
  engine on the node; not ``CPU_PINNED``, which SGLang uses for its own host pool and removes
  when that pool evicts, while hpkv may still hold the page;
* medium ``DISK``: hpkv's KV files.

The records come from the hpkv server through :class:`~hpkv.connectors.events.EventFeed`;
:class:`SglangEvents` remembers the pages (bounded) and builds SGLang's events. Hashes are
SGLang's default ones (the first 64 bits of a page's storage key, as both its Python and Rust
tree cores publish them); pages of requests with a LoRA adapter, which SGLang may publish
under an adapter-seeded hash, are published under the base hash.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, StorageMedium
from sglang.srt.mem_cache.utils import hash_str_to_int64

from hpkv.client.contract import KvStore
from hpkv.connectors.events import INTERVAL_S, MAX_BLOCKS, EventFeed, TierTracker
from hpkv.protocol.wire import Tier

log = logging.getLogger("sglang.hpkv")

MEDIUM = {int(Tier.DRAM): StorageMedium.EXTERNAL, int(Tier.STORAGE): StorageMedium.DISK}


class _Page:
    __slots__ = ("hash", "parent", "tokens", "group", "tiers")

    def __init__(self, block_hash: int, parent: int | None, tokens: list[int]):
        self.hash = block_hash
        self.parent = parent
        self.tokens = tokens
        self.group = 0
        self.tiers = 0  # bit t set: published as stored in tier t


class SglangEvents(TierTracker[_Page]):
    """hpkv's tier changes of the pages this engine backed up, as SGLang KV events. Scheduler
    thread only: :meth:`remember` when SGLang backs a radix node up to hpkv, :meth:`take` when
    SGLang takes its events to publish them."""

    def __init__(
        self,
        page_size: int,
        storage_keys: Callable[[list[str]], list[bytes]],
        client: Callable[[], KvStore | None],
        ns_id: Callable[[], int],
        max_blocks: int = MAX_BLOCKS,
        interval_s: float = INTERVAL_S,
    ):
        super().__init__(max_blocks)
        self.page_size = page_size
        self._storage_keys = storage_keys
        self.feed = EventFeed(client, ns_id, interval_s)
        self._queued: list[Any] = []  # events for the next take

    def start(self) -> None:
        self.feed.start()

    def remember(self, spec: Any) -> None:
        """SGLang backs a radix node's pages up to hpkv: ``spec`` is SGLang's own description of
        that backup (``build_storage_backup_spec`` with the prefix keys): the pages' storage
        keys, tokens, and the keys of the pages before them. SGLang publishes a page under
        the first 64 bits of that key (``hash_str_to_int64``), its parent under the previous
        page's."""
        keys = list(spec.hash_value)
        prefix = spec.prefix_keys or []
        parent = hash_str_to_int64(prefix[-1]) if prefix else None
        tokens = list(spec.token_ids)
        p = self.page_size
        for i, skey in enumerate(self._storage_keys(keys)):
            h = hash_str_to_int64(keys[i])
            if not self.known(skey):
                self.add(skey, _Page(h, parent, tokens[i * p : (i + 1) * p]))
            parent = h

    def take(self) -> list[Any]:
        """The events since the last call: those :meth:`announce_again` queued, then the
        records fetched meanwhile."""
        out, self._queued = self._queued, []
        return out + self.translate(self.feed.take())

    def announce_again(self) -> None:
        """SGLang's reset queued ``AllBlocksCleared``: the router forgets hpkv's pages too, so
        the next :meth:`take` announces again those hpkv still holds, tier by tier."""
        records = [(k, t) for t in MEDIUM for k, b in self._blocks.items() if b.tiers & (1 << t)]
        for b in self._blocks.values():
            b.tiers = 0
        self._queued += self.translate(records)

    def close(self) -> None:
        self.feed.close()

    # ------------------------------------------------------------------ TierTracker
    def stored(self, run: list[_Page], tier: int) -> Any:
        first = run[0]
        return BlockStored(
            block_hashes=[b.hash for b in run],
            parent_block_hash=first.parent,
            token_ids=[t for b in run for t in b.tokens],
            block_size=self.page_size,
            lora_id=None,
            medium=MEDIUM[tier],
        )

    def removed(self, run: list[_Page], tier: int) -> Any:
        return BlockRemoved(block_hashes=[b.hash for b in run], medium=MEDIUM[tier])

    def all_cleared(self) -> Any:
        return AllBlocksCleared()

"""KV events for cache-aware routers: hpkv's tiers as vLLM ``BlockStored`` / ``BlockRemoved``.

vLLM publishes KV events (``--kv-events-config``, ZMQ + msgpack) from its scheduler: its own
GPU prefix cache's, and whatever the connector's ``take_events`` returns. A router (llm-d's
precise prefix scorer, Dynamo's KV router) matches the *engine's* block hashes, which only
this process knows; which blocks enter or leave hpkv's DRAM pool and storage only the hpkv
server knows. :mod:`hpkv.connectors.events` fetches the server's records and tracks the
blocks; :class:`EventTranslator` remembers, for the blocks this engine saved or loaded, their
hash, parent hash, tokens and group, and publishes their tier changes with medium ``CPU`` (the
DRAM pool) or ``STORAGE`` (KV files), the names vLLM's own offloading connector publishes
(``vllm.distributed.kv_events.MEDIUM_CPU`` / ``MEDIUM_STORAGE``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

from hpkv.connectors.events import INTERVAL_S, MAX_BLOCKS, SERVER_CHANGED, EventFeed, TierTracker
from hpkv.protocol.wire import Tier

__all__ = ["INTERVAL_S", "MAX_BLOCKS", "SERVER_CHANGED", "EventFeed", "EventTranslator"]

MEDIUM = {int(Tier.DRAM): MEDIUM_CPU, int(Tier.STORAGE): MEDIUM_STORAGE}


class _Block:
    __slots__ = ("hash", "parent", "tokens", "group", "lora_id", "lora_name", "extra", "tiers")

    def __init__(self, request: Any, i: int, block_size: int, group: int):
        hashes = request.block_hashes
        self.hash = hashes[i]
        self.parent = hashes[i - 1] if i > 0 else None
        start = i * block_size
        self.tokens = tuple(request.all_token_ids[start : start + block_size])
        self.group = group
        lora = request.lora_request
        self.lora_id = lora.adapter_id if lora is not None else None
        self.lora_name = lora.name if lora is not None else None
        self.extra = generate_block_hash_extra_keys(request, start, start + block_size, 0)[0]
        self.tiers = 0  # bit t set: published as stored in tier t


class EventTranslator(TierTracker[_Block]):
    """key → the engine's view of a block, and records → vLLM KV events. Scheduler thread only."""

    def __init__(self, block_size: int, max_blocks: int = MAX_BLOCKS):
        super().__init__(max_blocks)
        self.block_size = block_size

    def remember(
        self, request: Any, keys: Sequence[bytes], indices: Sequence[int], groups: Sequence[int]
    ) -> None:
        """The request's blocks ``indices[j]`` (of KV cache group ``groups[j]``) are saved or
        loaded under ``keys[j]``: their tier changes are published with the request's hashes."""
        for key, i, g in zip(keys, indices, groups, strict=True):
            if not self.known(key):
                self.add(key, _Block(request, i, self.block_size, g))

    def stored(self, run: list[_Block], tier: int) -> KVCacheEvent:
        first = run[0]
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(b.hash) for b in run],
            parent_block_hash=maybe_convert_block_hash(first.parent) if first.parent is not None else None,
            token_ids=[t for b in run for t in b.tokens],
            block_size=self.block_size,
            lora_id=first.lora_id,
            medium=MEDIUM[tier],
            lora_name=first.lora_name,
            extra_keys=to_event_extra_keys([b.extra for b in run]),
            group_idx=first.group,
        )

    def removed(self, run: list[_Block], tier: int) -> KVCacheEvent:
        return BlockRemoved(
            block_hashes=[maybe_convert_block_hash(b.hash) for b in run],
            medium=MEDIUM[tier],
            group_idx=run[0].group,
        )

    def all_cleared(self) -> KVCacheEvent:
        return AllBlocksCleared()

"""What the scheduler tells the workers each step, and the connector's stats."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

#: vLLM's null block (``BlockPool.null_block``, the pool's first block): what a sliding-window
#: group's block table holds outside its window. Never saved, never loaded into.
NULL_BLOCK_ID = 0


@dataclass
class LoadOp:
    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    offsets: np.ndarray  # [n, world] pool byte offsets; ROW_MISSING: not in DRAM (promote)
    background: bool = False  # loaded while the engine steps (vLLM's async load); get_finished reports it
    tokens: int | None = None  # tokens the load completes; None: a block's per key (one KV cache group)


@dataclass
class SaveOp:
    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    offsets: np.ndarray  # [n, world] reserved pool byte offsets


@dataclass
class HpkvMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
    # finish these requests' saves before their blocks are reused
    preempted: set[str] = field(default_factory=set)


STAT_KEYS = (
    "loaded_tokens_dram",
    "loaded_tokens_storage",
    "loaded_bytes",
    "load_time_s",
    "load_time_dram_s",  # of loads from DRAM only
    "load_time_storage_s",  # of loads that needed storage (promote + copy)
    "saved_tokens",
    "saved_bytes",
    "save_time_s",
    "load_failed_blocks",
    "save_failed_blocks",
)


@dataclass
class HpkvConnectorStats(KVConnectorStats):
    """Tokens and bytes moved per tier and the time spent, summed over ranks and steps."""

    def __post_init__(self) -> None:
        for k in STAT_KEYS:
            self.data.setdefault(k, 0)

    def reset(self) -> None:
        self.data = {k: 0 for k in STAT_KEYS}

    def aggregate(self, other: KVConnectorStats) -> HpkvConnectorStats:
        for k in STAT_KEYS:
            self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data.get(k, 0) for k in STAT_KEYS}
        if self.data.get("load_time_s"):
            out["load_gbps"] = round(self.data["loaded_bytes"] / self.data["load_time_s"] / 1e9, 2)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in STAT_KEYS)

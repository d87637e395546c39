"""``HpkvHiCacheStorage``: hpkv's DRAM pool and KV files as SGLang HiCache's storage tier (L3).

SGLang (0.5.23) calls this backend from its cache controller's prefetch, prefetch-IO and
backup threads, never from the scheduler thread, and concurrently: every method is
thread-safe (the hpkv client serialises its own calls; the connection state has a lock).

Data path (``interface_v1``): SGLang's host pool (L2) lives in a memfd when the extra
config says ``"allocator": "shm"`` (``--enable-ct-hpkv`` does). The backend registers
that memory with the hpkv server as a *device* exactly as the vLLM CPU path registers
vLLM's KV cache: hpkv's transfer worker maps it and copies whole pages between the host
pool and pool slots, one native call per batch, with no Python copy per page. A page is
one hpkv block: ``page_size`` tokens of every layer, K and V, in the host pool's own byte
order (the layout is part of the namespace, so bytes never cross layouts). A load whose
pages only storage holds promotes them in parts (``HPKV_PROMOTE_PART_SIZE``), each copied
into the host pool while the next is read (:mod:`hpkv.connectors.promote`).

The legacy ``batch_get``/``batch_set`` (flat page tensors, used without ``interface_v1``)
copy in-process between the flat tensors and this process's mapping of the hpkv pool,
under a namespace of their own (the flat ``[2, L, P, H, D]`` byte order).

Keys: SGLang's page keys are chained SHA-256 hex strings that name only the tokens.
hpkv derives its block keys from them *and* a namespace fingerprint of everything that
changes the bytes: model identity, page size, host layout, KV dtype, head count and
size, TP rank and size (MHA: each rank stores its own head shard under its own
namespace; MLA: the KV is the same on every rank, so one namespace serves all ranks and
only ``is_storage_writer`` stores), PP/CP rank, SGLang version, hpkv's format.

Hybrid models (SGLang's storage interface v2): a hybrid radix tree (sliding-window layers in
SGLang's SWA pool, e.g. GPT-OSS; Mamba/linear-attention state) has sidecar host pools next to the
KV pool. Each sidecar pool SGLang registers (``register_mem_host_pool_v2``) gets a namespace of its
own (the KV namespace's fingerprint plus the pool's name, with its own page geometry) and its own
device registration of that pool's memfd. SGLang stores only the pages a later hit needs (for a
sliding window, the trailing pages of a node), so ``batch_exists_v2`` asks for every page's
presence and applies the pool's hit policy (``TRAILING_PAGES``: the last N pages before the hit
end; ``ALL_PAGES``: all of them): the hit is the longest prefix every pool can restore. The KV
pages still go through ``batch_get_v1``/``batch_set_v1``; the sidecar pages through
``batch_get_v2``/``batch_set_v2``, with the same zero-copy transfer worker path.

Failures: hpkv slow, dead or wrong means a miss (``batch_exists`` 0, per-page False),
never an exception into SGLang and never a wait longer than the client's call timeout
(a promote from storage at most ``PROMOTE_TIMEOUT_S``). A checksum failure in a KV file
is a promote failure, hence a miss. A lost server is reconnected (auto-spawned) in the
background: 1 s after a failed attempt, then less often, up to ``RECONNECT_INTERVAL_S`` apart.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from hpkv.client import HpkvClient, connect
from hpkv.common import shm
from hpkv.common.layout import pages_fit
from hpkv.common.numa import current_numa_node
from hpkv.connectors.promote import load_in_parts
from hpkv.connectors.reconnect import Reconnecting
from hpkv.protocol.errors import ROW_MISSING, ROW_POOL_FULL, ROW_PRESENT
from hpkv.protocol.keys import block_keys, namespace_fingerprint
from hpkv.protocol.model_identity import model_identity
from hpkv.protocol.wire import MAX_KEYS_PER_CALL, slot_offset

# A child of SGLang's logger, so our lines appear in SGLang's log with its format.
log = logging.getLogger("sglang.hpkv")

CALL_TIMEOUT_S = 5.0
PROMOTE_TIMEOUT_S = 5.0  # a storage read that takes longer is a miss (SGLang recomputes)
CONNECT_AT_START_S = 120.0  # the first connect may spawn the hpkv server


# ---------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class HostLayout:
    """Where page ``i`` of the host pool lies in its memfd: component ``c`` (a K or V run of
    one layer, or of all layers, depending on the layout) at ``bases[c] + i * stride``,
    ``page_bytes`` long. A pool slot holds the components one after another."""

    fd: int
    region_size: int
    bases: tuple[int, ...]
    stride: int
    page_bytes: int
    num_pages: int

    @property
    def shard_bytes(self) -> int:
        return len(self.bases) * self.page_bytes


def describe_host_pool(pool: Any) -> HostLayout:
    """The page geometry of SGLang's host pool, from its own zero-copy metadata
    (``get_page_buffer_meta``, which Mooncake uses too). ValueError says why it cannot be used."""
    allocator = getattr(pool, "allocator", None)
    fd = getattr(pool, "fd", None)
    mms = getattr(allocator, "mms", None)
    if fd is None or not mms:
        raise ValueError(
            "SGLang's host pool is not in shared memory, so hpkv's transfer worker cannot reach it: add "
            '"allocator":"shm" to --hicache-storage-backend-extra-config (--enable-ct-hpkv does)'
        )
    mm = mms[0]
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    size = len(mm)
    page = int(pool.page_size)
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(2 * page, dtype=torch.int64))
    ncomp = len(ptrs) // 2
    if ncomp == 0 or len(ptrs) != 2 * ncomp:
        raise ValueError(f"unexpected page metadata from {type(pool).__name__}: {len(ptrs)} pointers")
    p0, p1 = ptrs[:ncomp], ptrs[ncomp:]
    strides = {b - a for a, b in zip(p0, p1, strict=True)}
    page_bytes = set(sizes)
    if len(strides) != 1 or len(page_bytes) != 1:
        raise ValueError(
            f"{type(pool).__name__} layout {getattr(pool, 'layout', '?')}: pages are not "
            f"evenly strided (strides {sorted(strides)}, sizes {sorted(page_bytes)})"
        )
    stride, nbytes = strides.pop(), page_bytes.pop()
    num_pages = int(pool.size) // page
    bases = tuple(p - base for p in p0)
    for b in bases:
        if not pages_fit(b, size, num_pages, stride, nbytes):
            raise ValueError("the host pool's pages lie outside its shared-memory allocation")
    return HostLayout(fd, size, bases, stride, nbytes, num_pages)


def _register_host_pool(client: HpkvClient, ns_id: int, lay: HostLayout) -> Any:
    """Register a host pool's memfd with the hpkv server as a CPU device of namespace ``ns_id``."""
    return client.register_device(
        ns_id,
        rank=0,
        device="cpu",
        numa_node=current_numa_node(),
        regions=[{"path": f"/proc/{os.getpid()}/fd/{lay.fd}", "size": lay.region_size}],
        layer_bases=[(0, b) for b in lay.bases],
        block_stride=lay.stride,
        page_bytes=lay.page_bytes,
        num_blocks=lay.num_pages,
    )


def model_spec(model_name: str, pool: Any, model_id: str | None = None) -> dict[str, Any]:
    """The model's entries of the namespace (:mod:`hpkv.protocol.model_identity`).

    SGLang names the model by its served name, the model path unless ``--served-model-name``
    says otherwise, with ``-<tag>`` appended when its host pool has a page format of its own
    (``storage_model_name``). A name that is a local directory once the tag (or a
    ``:suffix``) is taken off is identified by that directory's content and keeps only the
    suffix; any other name is identified by itself (or its hub snapshot's content)."""
    tag = getattr(pool, "storage_format_tag", None)
    tag_suffix = f"-{tag}" if tag and model_name.endswith(f"-{tag}") else ""
    if model_id:
        return {**model_identity(model_name, model_id=model_id), "model_name_suffix": tag_suffix}
    for path in (model_name, model_name.split(":", 1)[0], model_name[: len(model_name) - len(tag_suffix)]):
        if path and os.path.isdir(path):
            return {**model_identity(path), "model_name_suffix": model_name[len(path) :]}
    return {**model_identity(model_name), "model_name_suffix": ""}


def namespace_spec(
    cfg: HiCacheStorageConfig, pool: Any, data_path: str, model_id: str | None = None
) -> dict[str, Any]:
    """Everything that changes the bytes of a stored page (see the module docstring);
    ``model_id`` (``HPKV_MODEL_ID``) names the model instead of its files' content."""
    import sglang

    mla = bool(cfg.is_mla_model)
    spec: dict[str, Any] = {
        **model_spec(str(cfg.model_name or ""), pool, model_id),
        "engine": "sglang",
        "engine_version": sglang.__version__,
        "torch": torch.__version__.split("+")[0],
        "hash_algo": "sglang-page-sha256",
        "page_size": int(pool.page_size),
        "layout": str(getattr(pool, "layout", "")),
        "data_path": data_path,
        "pool_class": type(pool).__name__,
        "dtype": str(pool.dtype),
        "layers": int(getattr(pool, "layer_num", 0)),
        "heads": int(getattr(pool, "head_num", 0)),
        "head_dim": int(getattr(pool, "head_dim", 0)),
        "mla": mla,
        "pp": [cfg.pp_rank, cfg.pp_size],
        "cp": [cfg.attn_cp_rank, cfg.attn_cp_size],
        "dcp": [cfg.dcp_rank, cfg.dcp_size],
    }
    if mla:  # rank-replicated KV: every rank reads what the writer rank stored
        spec["tp"] = "replicated"
    else:  # each rank holds its own heads
        spec["tp"] = [cfg.tp_rank, cfg.tp_size]
    for k in ("kv_lora_rank", "qk_rope_head_dim"):
        if hasattr(pool, k):
            spec[k] = int(getattr(pool, k))
    return spec


def _raw_hash(key: str) -> bytes:
    """SGLang's page key as bytes (64 hex digits → 32 bytes; anything else as UTF-8)."""
    try:
        return bytes.fromhex(key)
    except ValueError:
        return key.encode()


@dataclass
class SidePool:
    """A sidecar host pool of a hybrid model (SGLang's SWA or Mamba pool) in its own namespace."""

    name: str
    layout: HostLayout
    page_size: int
    fingerprint: str
    ns_name: str
    ns_id: int = -1
    device: Any = None


# ---------------------------------------------------------------------------- backend
class HpkvHiCacheStorage(HiCacheStorage):
    """SGLang HiCache storage backend over hpkv. Constructed by SGLang's ``dynamic`` factory as
    ``HpkvHiCacheStorage(storage_config, kwargs)``."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None):
        self.config = storage_config
        self.extra = dict(storage_config.extra_config or {})
        self.enabled = False
        self.promote_part_bytes = 0  # one part; HPKV_PROMOTE_PART_SIZE once configured
        self.ns_id = -1  # set by _connect
        self.fingerprint = ""
        self.ns_name = ""  # set once the host pool is known: connecting needs both
        self.page_size = 0
        self.layout: HostLayout | None = None
        self.mem_pool_host: Any = None
        self._device: Any = None
        self._pool_map: np.ndarray | None = None  # this process's view of hpkv's pool (legacy API)
        self._side: dict[str, SidePool] = {}  # sidecar pools of a hybrid model, by SGLang's pool name
        self._legacy_page: tuple[torch.dtype, tuple[int, ...]] | None = None
        self._conn: Reconnecting[HpkvClient] = Reconnecting(
            f"sglang rank {int(storage_config.tp_rank)}", self._connect, log
        )
        self._stat_lock = threading.Lock()
        self.stats: dict[str, int] = dict.fromkeys(
            (
                "exists_calls",
                "hit_pages",
                "below_threshold",
                "loaded_pages",
                "load_failed_pages",
                "saved_pages",
                "save_failed_pages",
                "already_stored_pages",
                "sidecar_loaded_pages",
                "sidecar_saved_pages",
                "sidecar_failed_pages",
            ),
            0,
        )
        self._events: Any = None  # SglangEvents while hpkv publishes KV events
        self._events_state = ""  # "" until the first use, then "on" or "off"
        self.rank = 0 if storage_config.is_mla_model else int(storage_config.tp_rank)
        self.writer = bool(storage_config.is_storage_writer)
        self.interface_v1 = bool(self.extra.get("interface_v1", 0))
        try:
            from hpkv.config import ConfigError, load_config

            self.cfg = load_config()
        except ConfigError as exc:
            log.error("hpkv disabled: configuration error: %s", exc)
            return
        if not self.cfg["VLLM_ENABLE_HPKV"]:
            log.warning(
                "hpkv: VLLM_ENABLE_HPKV=0 (from %s): the storage backend stores and finds nothing",
                self.cfg.source("VLLM_ENABLE_HPKV"),
            )
            return
        # None ("auto"): no threshold of hpkv's own; SGLang's prefetch_threshold decides.
        self.threshold: int | None = self.cfg["VLLM_HPKV_TOKEN_THRESHOLD"]
        self.promote_part_bytes = int(self.cfg["HPKV_PROMOTE_PART_SIZE"])
        self.lookup_retry_s = float(self.cfg["HPKV_STORAGE_LOOKUP_RETRY_MS"]) / 1000.0
        self.enabled = True

    # ------------------------------------------------------------------ attach
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.mem_pool_host = mem_pool_host
        if not self.enabled:
            return
        self.page_size = int(mem_pool_host.page_size)
        try:
            if self.interface_v1:
                self.layout = describe_host_pool(mem_pool_host)
                shard = self.layout.shard_bytes
                data_path = f"host-pages x{len(self.layout.bases)} stride {self.layout.stride}"
            else:
                dummy = mem_pool_host.get_dummy_flat_data_page()
                self._legacy_page = (dummy.dtype, tuple(dummy.shape))
                shard = dummy.numel() * dummy.element_size()
                data_path = f"flat-page {tuple(dummy.shape)}"
            spec = namespace_spec(self.config, mem_pool_host, data_path, self.cfg["HPKV_MODEL_ID"])
        except Exception as exc:  # noqa: BLE001 - never fail SGLang's start-up over hpkv
            log.error("hpkv disabled: %s", exc)
            self.enabled = False
            return
        self.shard_bytes = shard
        self.fingerprint = namespace_fingerprint(spec)
        model = os.path.basename(str(self.config.model_name or "model").split(":", 1)[0].rstrip("/"))
        tp = "" if self.config.is_mla_model else f" tp{self.config.tp_size}r{self.config.tp_rank}"
        self.ns_name = f"{model}{tp} ps{self.page_size} {getattr(mem_pool_host, 'layout', '')}"[:60]
        self._conn.connect_now(timeout=CONNECT_AT_START_S)
        log.info(
            "hpkv storage backend: namespace %s (%s), token threshold %s (%s), %s, %s",
            self.fingerprint[:12],
            self.ns_name,
            "auto (SGLang's prefetch_threshold)" if self.threshold is None else self.threshold,
            self.cfg.source("VLLM_HPKV_TOKEN_THRESHOLD"),
            "zero-copy host pool" if self.interface_v1 else "legacy flat pages",
            "writer" if self.writer else "reader (MLA: another rank stores)",
        )

    def _connect(self) -> HpkvClient:
        client = connect(self.cfg, name=f"sglang-r{self.rank}", call_timeout=CALL_TIMEOUT_S)
        try:
            ns = client.attach_namespace(
                self.fingerprint, 1, self.shard_bytes, name=self.ns_name, rank=0, block_tokens=self.page_size
            )
            if self.layout is not None:
                self._device = _register_host_pool(client, ns.ns_id, self.layout)
                for side in list(self._side.values()):
                    self._attach_side(client, side)
            else:
                # Not populated: the pool may still be sparse, and populating would allocate
                # all of it here (seconds per GiB, and past the server's free-space checks).
                # Only slots the server handed out are touched, and their memory exists.
                self._pool_map = np.frombuffer(shm.map_file(client.pool_path, populate=False), np.uint8)
            self.ns_id = ns.ns_id
        except Exception:
            client.close()
            raise
        return client

    def _attach_side(self, client: HpkvClient, side: SidePool) -> None:
        ns = client.attach_namespace(
            side.fingerprint,
            1,
            side.layout.shard_bytes,
            name=side.ns_name,
            rank=0,
            block_tokens=side.page_size,
        )
        side.device = _register_host_pool(client, ns.ns_id, side.layout)
        side.ns_id = ns.ns_id

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang registers each host pool of its pool group (hybrid models: the SWA or Mamba pool
        next to the KV pool): a sidecar pool gets a namespace of its own."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if (
            name == str(PoolName.KV)
            or host_pool is self.mem_pool_host
            or not self.enabled
            or not self.ns_name
        ):
            return
        if not self.interface_v1:
            log.warning(
                "hpkv: SGLang's %s pool is not stored (hpkv stores sidecar pools only with "
                '"interface_v1":1 and "allocator":"shm", as --enable-ct-hpkv sets): hybrid prefixes '
                "are recomputed",
                name,
            )
            return
        try:
            layout = describe_host_pool(host_pool)
            data_path = f"host-pages x{len(layout.bases)} stride {layout.stride}"
            spec = namespace_spec(self.config, host_pool, data_path, self.cfg["HPKV_MODEL_ID"])
        except Exception as exc:  # noqa: BLE001 - never fail SGLang's start-up over hpkv
            log.error(
                "hpkv: SGLang's %s pool is not stored, so hybrid prefixes are recomputed: %s", name, exc
            )
            return
        # a sidecar is per rank also where the KV is replicated (SGLang backs Mamba state up on every rank)
        spec.update(pool=name, kv_namespace=self.fingerprint, tp=[self.config.tp_rank, self.config.tp_size])
        side = SidePool(
            name,
            layout,
            int(host_pool.page_size),
            namespace_fingerprint(spec),
            f"{self.ns_name[: 59 - len(name)]} {name}",
        )
        self._side[name] = side
        if (client := self._conn.client) is not None:
            try:
                self._attach_side(client, side)
            except Exception as exc:  # noqa: BLE001 - reconnecting attaches it again
                self._conn.lost(exc)
        log.info(
            "hpkv storage backend: SGLang's %s pool in namespace %s (%d bytes a page)",
            name,
            side.fingerprint[:12],
            layout.shard_bytes,
        )

    def _client(self) -> HpkvClient | None:
        return self._conn.get() if self.enabled and self.ns_name else None

    def _keys(self, keys: Sequence[str], fingerprint: str = "") -> list[bytes]:
        return block_keys(fingerprint or self.fingerprint, [_raw_hash(k) for k in keys])

    def _count(self, **inc: int) -> None:
        with self._stat_lock:
            for k, v in inc.items():
                self.stats[k] += v

    def _pages(self, host_indices: torch.Tensor, n: int, page_size: int = 0) -> np.ndarray | None:
        """Host page numbers of ``n`` pages given as token indices (``n * page_size`` of them)."""
        idx = host_indices.numpy() if host_indices.device.type == "cpu" else host_indices.cpu().numpy()
        p = page_size or self.page_size
        if len(idx) < n * p:
            return None
        first = idx[: n * p : p].astype(np.int64)
        if (first % p).any():
            log.error("hpkv: host indices not page-aligned; pages treated as misses")
            return None
        return first // p

    # ------------------------------------------------------------------ queries
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages of ``keys`` hpkv has (DRAM or storage); 0 when that is fewer
        tokens than VLLM_HPKV_TOKEN_THRESHOLD (recomputing them is cheaper). HiCache asks from
        its prefetch thread, so a page still being checked on storage is asked about again
        (for at most HPKV_STORAGE_LOOKUP_RETRY_MS) rather than taken as a miss."""
        client = self._client()
        if client is None or not keys:
            return 0
        try:
            hit = len(self._settled(client, self.ns_id, self._keys(keys)))
        except Exception as exc:  # noqa: BLE001 - hpkv trouble means a miss
            self._conn.lost(exc)
            return 0
        self._count(exists_calls=1)
        if hit * self.page_size < (self.threshold or 0):
            if hit:
                self._count(below_threshold=1)
            return 0
        self._count(hit_pages=hit)
        return hit

    def exists(self, key: str) -> bool:
        client = self._client()
        if client is None:
            return False
        try:
            n, _ = client.lookup(self.ns_id, self._keys([key]))
        except Exception as exc:  # noqa: BLE001
            self._conn.lost(exc)
            return False
        return n == 1

    # ------------------------------------------------------------------ loads
    def _pin_or_promote(self, client: HpkvClient, hkeys: list[bytes]) -> tuple[np.ndarray, list[bytes]]:
        """Pool offsets of the leading keys hpkv can deliver (DRAM ones pinned, storage ones
        promoted and pinned); -1 from the first it cannot. Returns (offsets, keys to unpin)."""
        offs = client.pin(self.ns_id, hkeys)[:, 0].copy()
        pinned = [k for k, o in zip(hkeys, offs, strict=True) if o != ROW_MISSING]
        missing = np.flatnonzero(offs == ROW_MISSING)
        if len(missing):
            # Only the prefix up to the first page that is in no tier can be used.
            got = client.promote(self.ns_id, [hkeys[i] for i in missing], timeout=PROMOTE_TIMEOUT_S)[:, 0]
            offs[missing] = got
            pinned += [hkeys[i] for i, o in zip(missing, got, strict=True) if o != ROW_MISSING]
        bad = np.flatnonzero(offs < 0)
        if len(bad):
            offs[bad[0] :] = -1
        return offs, pinned

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Copy the pages of ``keys`` from hpkv into the host pool at ``host_indices`` (the
        transfer worker does the copy). Per page: True when it arrived."""
        n = len(keys)
        client = self._client()
        if client is None or self._device is None or n == 0:
            return [False] * n
        ok = self._load(
            client,
            self.ns_id,
            self._device,
            self.fingerprint,
            self.shard_bytes,
            self.page_size,
            keys,
            host_indices,
        )
        self._count(loaded_pages=int(ok.sum()), load_failed_pages=n - int(ok.sum()))
        return ok.tolist()

    def _load(
        self,
        client: HpkvClient,
        ns_id: int,
        device: Any,
        fingerprint: str,
        shard_bytes: int,
        page_size: int,
        keys: Sequence[str],
        host_indices: torch.Tensor,
    ) -> np.ndarray:
        """Copy the pages of ``keys`` from namespace ``ns_id`` into a host pool (``device``) at
        ``host_indices``; True for each of the leading pages that arrived."""
        n = len(keys)
        ok = np.zeros(n, bool)
        pages = self._pages(host_indices, n, page_size)
        if pages is None:
            return ok
        hkeys = self._keys(keys, fingerprint)
        pinned: list[bytes] = []
        try:
            offs = client.pin(ns_id, hkeys)[:, 0].copy()
            pinned = [k for k, o in zip(hkeys, offs, strict=True) if o >= 0]
            ok = load_in_parts(
                client,
                ns_id,
                hkeys,
                offs,
                0,
                shard_bytes,
                self.promote_part_bytes,
                PROMOTE_TIMEOUT_S,
                lambda idx, offsets: device.load(pages[idx], offsets),
                stop_after_short_part=True,  # SGLang uses the leading pages that arrived
            )
        except Exception as exc:  # noqa: BLE001 - a miss; SGLang recomputes
            self._conn.lost(exc)
            ok[:] = False
        finally:
            if pinned and self._conn.client is client:
                with contextlib.suppress(Exception):
                    client.unpin(ns_id, pinned)
        short = np.flatnonzero(~ok)
        if len(short):
            ok[short[0] :] = False
        return ok

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Legacy API: fill SGLang's flat page tensors from hpkv's pool (an in-process copy)."""
        n = len(keys)
        out: list[torch.Tensor | None] = [None] * n
        client = self._client()
        pool = self._pool_map
        if client is None or pool is None or not n or target_locations is None:
            return out
        hkeys = self._keys(keys)
        pinned: list[bytes] = []
        try:
            offs, pinned = self._pin_or_promote(client, hkeys)
            for i, (t, o) in enumerate(zip(target_locations, offs, strict=False)):
                if o < 0:
                    break
                dst = t.view(torch.uint8).reshape(-1).numpy()
                np.copyto(dst, pool[o : o + self.shard_bytes])
                out[i] = t
        except Exception as exc:  # noqa: BLE001
            self._conn.lost(exc)
            out = [None] * n
        finally:
            if pinned and self._conn.client is client:
                with contextlib.suppress(Exception):
                    client.unpin(self.ns_id, pinned)
        got = sum(1 for t in out if t is not None)
        self._count(loaded_pages=got, load_failed_pages=n - got)
        return out

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        if target_location is None:
            return None
        return self.batch_get([key], [target_location])[0]

    # ------------------------------------------------------------------ saves
    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Store the pages at ``host_indices`` under ``keys`` (DRAM now, storage write-through).
        Pages hpkv already has count as stored."""
        n = len(keys)
        if n and self.enabled and not self.writer:
            return [True] * n  # MLA: the writer rank stores the same bytes
        client = self._client()
        if client is None or self._device is None or n == 0:
            return [False] * n
        res, already = self._save(
            client, self.ns_id, self._device, self.fingerprint, self.page_size, keys, host_indices
        )
        self._count(
            saved_pages=int(res.sum()), save_failed_pages=n - int(res.sum()), already_stored_pages=already
        )
        return res.tolist()

    def _save(
        self,
        client: HpkvClient,
        ns_id: int,
        device: Any,
        fingerprint: str,
        page_size: int,
        keys: Sequence[str],
        host_indices: torch.Tensor,
    ) -> tuple[np.ndarray, int]:
        """Store the host pool pages at ``host_indices`` under ``keys`` in namespace ``ns_id``:
        (True for each page stored or already there, how many were already there)."""
        n = len(keys)
        res = np.zeros(n, bool)
        pages = self._pages(host_indices, n, page_size)
        if pages is None:
            return res, 0
        hkeys = self._keys(keys, fingerprint)
        already = 0
        try:
            offs = client.reserve(ns_id, hkeys)[:, 0]
            res[offs == ROW_PRESENT] = True  # already stored (or being stored)
            already = int(res.sum())
            new = np.flatnonzero(offs >= 0)
            if len(new):
                new_keys = [hkeys[i] for i in new]
                if device.save(pages[new], offs[new]):
                    client.commit(ns_id, new_keys, rank=0)
                    res[new] = True
                else:
                    client.abort(ns_id, new_keys)
        except Exception as exc:  # noqa: BLE001 - a lost save is a future miss
            self._conn.lost(exc)
            res[:] = False
        return res, already

    # ------------------------------------------------------------------ lookups
    def _settled(self, client: HpkvClient, ns_id: int, hkeys: list[bytes], each: bool = False) -> list[int]:
        """The tiers of the leading ``hkeys`` present (``each``: of every key, 0 where missing), in
        lookups of at most MAX_KEYS_PER_CALL keys; a key still being checked on storage is asked
        about again, for at most HPKV_STORAGE_LOOKUP_RETRY_MS in all."""
        tiers: list[int] = []
        give_up = time.monotonic() + self.lookup_retry_s
        for i in range(0, len(hkeys), MAX_KEYS_PER_CALL):
            chunk = hkeys[i : i + MAX_KEYS_PER_CALL]
            patience = max(0.0, give_up - time.monotonic())
            n, got = client.settled_lookup(ns_id, chunk, patience, each=each)
            tiers += got
            if n < len(chunk) and not each:
                break
        return tiers

    # ------------------------------------------------------------------ v2 (hybrid models)
    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The longest prefix of ``keys`` that the KV pool and every sidecar pool can restore:
        the KV pages all present, and each sidecar pool's pages its hit policy asks for
        (``TRAILING_PAGES``: the last ``len(transfer.keys)`` before the prefix end). A pool hpkv
        does not hold (not registered, another policy) means no hit."""
        client = self._client()
        if client is None or not keys:
            return PoolTransferResult.empty()
        try:
            kv = len(self._settled(client, self.ns_id, self._keys(keys)))
            hits: dict[str, int] = {PoolName.KV: kv} if kv else {}
            restorable = set(range(1, kv + 1))
            for t in pool_transfers or []:
                side = self._side.get(str(t.name))
                if not restorable:
                    break
                if side is None or side.ns_id < 0 or t.hit_policy == PoolHitPolicy.BLOCK_GROUPS:
                    restorable = set()
                    break
                side_keys = self._keys(keys[:kv], side.fingerprint)
                present = [tier > 0 for tier in self._settled(client, side.ns_id, side_keys, each=True)]
                if t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                    tail = max(1, len(t.keys) if t.keys else 1)
                    mine = {n for n in range(1, kv + 1) if all(present[max(0, n - tail) : n])}
                else:  # ALL_PAGES
                    mine = set(range(1, (present.index(False) if False in present else kv) + 1))
                if mine:
                    hits[t.name] = max(mine)
                restorable &= mine
        except Exception as exc:  # noqa: BLE001 - hpkv trouble means a miss
            self._conn.lost(exc)
            return PoolTransferResult.empty()
        self._count(exists_calls=1)
        best = max(restorable, default=0)
        if best * self.page_size < (self.threshold or 0):
            if best:
                self._count(below_threshold=1)
            return PoolTransferResult(0, {}, [])
        self._count(hit_pages=best)
        return PoolTransferResult(best, hits, sorted(restorable))

    def _transfer_target(self, name: str) -> tuple[int, Any, str, int, int] | None:
        """(namespace, device, fingerprint, page bytes, page size) of SGLang's pool ``name``."""
        if name == str(PoolName.KV):
            if self._device is None:
                return None
            return self.ns_id, self._device, self.fingerprint, self.shard_bytes, self.page_size
        side = self._side.get(name)
        if side is None or side.device is None:
            return None
        return side.ns_id, side.device, side.fingerprint, side.layout.shard_bytes, side.page_size

    def _batch_v2(self, transfers: list[PoolTransfer], load: bool) -> dict[str, list[bool]]:
        client = self._client()
        out: dict[str, list[bool]] = {}
        for t in transfers:
            keys = list(t.keys or [])
            target = self._transfer_target(str(t.name)) if client is not None else None
            if target is None or not keys or t.host_indices is None:
                out[t.name] = [False] * len(keys)
                continue
            ns_id, device, fingerprint, shard_bytes, page_size = target
            if t.host_indices.numel() != len(keys) * page_size:
                log.error(
                    "hpkv: %s pages of pool %s with %d host indices (page size %d): treated as misses",
                    len(keys),
                    t.name,
                    t.host_indices.numel(),
                    page_size,
                )
                out[t.name] = [False] * len(keys)
                continue
            assert client is not None
            if load:
                ok = self._load(
                    client, ns_id, device, fingerprint, shard_bytes, page_size, keys, t.host_indices
                )
            else:
                ok, _ = self._save(client, ns_id, device, fingerprint, page_size, keys, t.host_indices)
            out[t.name] = ok.tolist()
        done = sum(sum(v) for v in out.values())
        failed = sum(len(v) for v in out.values()) - done
        if load:
            self._count(sidecar_loaded_pages=done, sidecar_failed_pages=failed)
        else:
            self._count(sidecar_saved_pages=done, sidecar_failed_pages=failed)
        return out

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Copy each transfer's pages from hpkv into its host pool; per pool, True per page that arrived."""
        return self._batch_v2(transfers, load=True)

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Store each transfer's host pool pages in its pool's namespace; per pool, True per page stored."""
        return self._batch_v2(transfers, load=False)

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Legacy API: store SGLang's flat page tensors (an in-process copy into hpkv's pool)."""
        n = len(keys)
        if n and self.enabled and not self.writer:
            return True
        client = self._client()
        pool = self._pool_map
        if client is None or pool is None or not n or values is None:
            return False
        hkeys = self._keys(keys)
        try:
            offs = slot_offset(client.reserve(self.ns_id, hkeys)[:, 0])  # written here, not by a worker
            if (offs == ROW_POOL_FULL).any():
                good = offs >= 0
                if good.any():
                    client.abort(self.ns_id, [k for k, g in zip(hkeys, good, strict=True) if g])
                return False
            new = [i for i, o in enumerate(offs) if o >= 0]
            for i in new:
                src = values[i].contiguous().view(torch.uint8).reshape(-1).numpy()
                if len(src) != self.shard_bytes:
                    raise ValueError(
                        f"a flat page of {len(src)} bytes, the namespace expects {self.shard_bytes}"
                    )
                np.copyto(pool[offs[i] : offs[i] + self.shard_bytes], src)
            if new:
                client.commit(self.ns_id, [hkeys[i] for i in new], rank=0)
        except Exception as exc:  # noqa: BLE001
            self._conn.lost(exc)
            self._count(save_failed_pages=n)
            return False
        self._count(saved_pages=n)
        return True

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    # ------------------------------------------------------------------ admin
    def clear(self) -> None:
        """``POST /hicache/storage-backend/clear``: drop this namespace from hpkv's DRAM tier
        (the KV files stay, as for vLLM's ``reset_external``)."""
        client = self._client()
        if client is None:
            return
        try:
            dropped = client.clear(self.ns_id)
        except Exception as exc:  # noqa: BLE001
            self._conn.lost(exc)
            return
        log.info(
            "hpkv: clear dropped %d pages of namespace %s from the DRAM tier",
            dropped,
            (self.fingerprint or "")[:12],
        )

    # ------------------------------------------------------------------ KV events
    # Called by the plugin's hooks on SGLang's radix cache (hpkv.connectors.sglang.plugin), in
    # the scheduler thread; never raise: events are a courtesy to routers.
    def hpkv_events(self, cache: Any) -> Any:
        """hpkv's KV events (:class:`~hpkv.connectors.sglang.events.SglangEvents`) for SGLang's
        radix ``cache``, started on first use; None where SGLang publishes no events
        (``--kv-events-config`` unset, or not this rank) or hpkv is off."""
        if self._events_state:
            return self._events
        self._events_state = "off"
        recorder = getattr(getattr(cache, "tree_core", None), "kv_events", None)
        if not self.enabled or not self.ns_name or not getattr(recorder, "enabled", False):
            return None
        from hpkv.connectors.sglang.events import SglangEvents

        try:
            events = SglangEvents(self.page_size, self._keys, self._client, lambda: self.ns_id)
            events.start()
        except Exception as exc:  # noqa: BLE001
            log.warning("hpkv: KV events of hpkv's tiers are off: %s", exc)
            return None
        self._events, self._events_state = events, "on"
        log.info("hpkv: publishing KV events of the DRAM pool (medium EXTERNAL) and storage (DISK)")
        return events

    def hpkv_events_remember(self, cache: Any, node_id: Any) -> None:
        """SGLang backs radix node ``node_id`` up to hpkv."""
        if (events := self.hpkv_events(cache)) is not None:
            try:
                spec = cache.tree_core.build_storage_backup_spec(node_id, True)
                if spec is not None:
                    events.remember(spec)
            except Exception as exc:  # noqa: BLE001
                self._events_broke(exc)

    def hpkv_events_take(self, cache: Any) -> list[Any]:
        """hpkv's events to publish with SGLang's own."""
        if (events := self.hpkv_events(cache)) is None:
            return []
        try:
            return events.take()
        except Exception as exc:  # noqa: BLE001
            self._events_broke(exc)
            return []

    def hpkv_events_reset(self, cache: Any) -> None:
        """SGLang reset its radix cache (and published ``AllBlocksCleared``)."""
        if (events := self.hpkv_events(cache)) is not None:
            try:
                events.announce_again()
            except Exception as exc:  # noqa: BLE001
                self._events_broke(exc)

    def _events_broke(self, exc: BaseException) -> None:
        log.warning("hpkv: KV events of hpkv's tiers stop (SGLang goes on): %r", exc)
        if self._events is not None:
            self._events.close()
        self._events = None

    def close(self) -> None:
        """SGLang detaches the backend or shuts down: say what hpkv did for it, drop the connection."""
        if self._events is not None:
            self._events.close()
        if self.enabled:
            with self._stat_lock:
                st = dict(self.stats)
            log.info("hpkv storage backend closing: %s", ", ".join(f"{k} {v}" for k, v in st.items()))
        self._conn.close()

"""``HpkvConnectorV1``: hpkv as a vLLM V1 KV connector (vLLM 0.32 API).

Two instances run per engine, in different processes, and never share Python
state:

* the **scheduler** instance (EngineCore process) looks prefixes up in hpkv,
  pins hits, reserves pool slots for newly full blocks and tells the workers what
  to copy through the step's metadata;
* one **worker** instance per rank exports the rank's KV cache to hpkv (on the
  CPU backend the KV cache is allocated in a shared-memory file, see
  :meth:`get_mem_pool_context`), and has the rank's transfer worker copy blocks
  pool → KV cache before the forward (loads) and KV cache → pool after it
  (saves), then commits the saved shards.

Loads are synchronous (the scheduler gets ``(N, False)``): on the CPU the copy
of a DRAM hit costs milliseconds, far less than an extra scheduler step, and a
storage hit is promoted into the pool by the IO workers first. Any failure —
hpkv slow, dead or wrong — is reported as invalid blocks, and vLLM recomputes
them (the connector sets ``kv_load_failure_policy=recompute``). Importing this
module starts nothing: vLLM's API server imports it too.
"""
from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

try:  # vLLM >= 0.30
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - older vLLM
    CacheHitSource = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# A child of vLLM's logger, so our lines appear in vLLM's log with its format.
log = logging.getLogger("vllm.hpkv")

TIER_DRAM = 1
TIER_STORAGE = 2
RECONNECT_INTERVAL_S = 10.0


# ---------------------------------------------------------------------------- metadata
@dataclass
class LoadOp:
    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    offsets: np.ndarray       # [n, world] pool byte offsets; -1: not in DRAM (promote from storage)


@dataclass
class SaveOp:
    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    offsets: np.ndarray       # [n, world] reserved pool byte offsets


@dataclass
class HpkvMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)


# ---------------------------------------------------------------------------- stats
_STAT_KEYS = ("loaded_tokens_dram", "loaded_tokens_storage", "loaded_bytes", "load_time_s",
              "saved_tokens", "saved_bytes", "save_time_s", "load_failed_blocks", "save_failed_blocks")


@dataclass
class HpkvConnectorStats(KVConnectorStats):
    """Tokens and bytes moved per tier and the time spent, summed over ranks and steps."""

    def __post_init__(self) -> None:
        for k in _STAT_KEYS:
            self.data.setdefault(k, 0)

    def reset(self) -> None:
        self.data = {k: 0 for k in _STAT_KEYS}

    def aggregate(self, other: KVConnectorStats) -> "HpkvConnectorStats":
        for k in _STAT_KEYS:
            self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data.get(k, 0) for k in _STAT_KEYS}
        if self.data.get("load_time_s"):
            out["load_gbps"] = round(self.data["loaded_bytes"] / self.data["load_time_s"] / 1e9, 2)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in _STAT_KEYS)


# ---------------------------------------------------------------------------- helpers
def _hpkv_config():
    from hpkv.config import ConfigError, load_config
    try:
        return load_config()
    except ConfigError as exc:
        raise ValueError(f"hpkv configuration error: {exc}") from None


def _cpu_isa(vllm_config: "VllmConfig") -> str:
    """The CPU attention kernel's page format tag (the bytes of a page depend on it)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        mc = vllm_config.model_config
        return _get_attn_isa(mc.dtype, vllm_config.cache_config.block_size, mc.get_head_size(),
                             vllm_config.cache_config.cache_dtype)
    except Exception as exc:  # noqa: BLE001 - the tag only needs to be stable and distinct
        return f"unknown:{type(exc).__name__}"


def _model_identity(model: str) -> dict[str, Any]:
    """For a local model directory, the names, sizes and mtimes of its files: new weights, new namespace."""
    if not os.path.isdir(model):
        return {"model": model}
    files = []
    for name in sorted(os.listdir(model)):
        p = os.path.join(model, name)
        if os.path.isfile(p) and name.endswith((".json", ".safetensors", ".bin", ".model")):
            st = os.stat(p)
            files.append((name, st.st_size, int(st.st_mtime)))
    return {"model": os.path.abspath(model), "files": files}


@dataclass(frozen=True)
class Layout:
    """What both roles derive from the engine config: the namespace and the shard size."""
    fingerprint: str
    name: str
    world_size: int
    block_size: int
    num_layers: int
    page_bytes: int

    @property
    def shard_bytes(self) -> int:
        return self.num_layers * self.page_bytes


def derive_layout(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> Layout:
    import vllm
    from hpkv.engine.keys import namespace_fingerprint

    pc = vllm_config.parallel_config
    cc = vllm_config.cache_config
    mc = vllm_config.model_config
    if pc.pipeline_parallel_size != 1:
        raise NotImplementedError("hpkv supports tensor parallelism; pipeline parallelism is not supported yet")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise NotImplementedError(f"hpkv supports models with one KV cache group, this one has {len(groups)}")
    spec = groups[0].kv_cache_spec
    page_bytes = int(spec.page_size_bytes)
    num_layers = len(groups[0].layer_names)
    spec_dict = {
        **_model_identity(mc.model), "revision": mc.revision, "dtype": str(mc.dtype),
        "kv_cache_dtype": str(cc.cache_dtype), "block_size": cc.block_size, "layers": num_layers,
        "page_bytes": page_bytes, "tp": pc.tensor_parallel_size, "pp": pc.pipeline_parallel_size,
        "layout": "per-layer-blocks", "device": str(vllm_config.device_config.device_type),
        "isa": _cpu_isa(vllm_config) if vllm_config.device_config.device_type == "cpu" else "",
        "engine": "vllm", "engine_version": vllm.__version__, "torch": torch.__version__.split("+")[0],
        "hash_algo": str(cc.prefix_caching_hash_algo),
    }
    name = f"{os.path.basename(str(mc.model).rstrip('/'))} tp{pc.tensor_parallel_size} bs{cc.block_size}"
    return Layout(namespace_fingerprint(spec_dict), name, pc.tensor_parallel_size, cc.block_size,
                  num_layers, page_bytes)


class _Reconnecting:
    """An hpkv client that, once lost, is re-established in the background (never blocking a step).

    The operator hears of an outage twice: once when hpkv goes away (with the reason) and
    once when it is back; the retries in between log at debug level only.
    """

    def __init__(self, what: str, connect_fn):
        self.what = what
        self._connect_fn = connect_fn
        self.client = None
        self._lock = threading.Lock()
        self._next_try = 0.0
        self._thread: threading.Thread | None = None
        self._down_since: float | None = None    # monotonic time hpkv went away, while it is away

    def get(self):
        c = self.client
        if c is not None:
            return c
        now = time.monotonic()
        with self._lock:
            if self._thread is None and now >= self._next_try:
                self._next_try = now + RECONNECT_INTERVAL_S
                self._thread = threading.Thread(target=self._run, name=f"hpkv-{self.what}-connect", daemon=True)
                self._thread.start()
        return None

    def connect_now(self, timeout: float) -> None:
        self.get()
        t = self._thread
        if t is not None:
            t.join(timeout)

    def _run(self) -> None:
        try:
            client = self._connect_fn()
        except Exception as exc:  # noqa: BLE001 - any failure means: recompute, retry later
            if self._down_since is None:
                self._down_since = time.monotonic()
                log.warning("hpkv %s: cannot reach the hpkv server (%s); vLLM recomputes until it is "
                            "back (retrying every %.0fs; logged again when it is back)",
                            self.what, exc, RECONNECT_INTERVAL_S)
            else:
                log.debug("hpkv %s: still no hpkv server (%s)", self.what, exc)
        else:
            if self._down_since is not None:
                log.warning("hpkv %s: the hpkv server is back (pid %d) after %.0fs", self.what,
                            client.server_pid, time.monotonic() - self._down_since)
                self._down_since = None
            self.client = client
        finally:
            with self._lock:
                self._thread = None

    def lost(self, exc: BaseException) -> None:
        c = self.client
        self.client = None
        if c is not None:
            if self._down_since is None:
                self._down_since = time.monotonic()
                log.warning("hpkv %s: lost the hpkv server (%s); vLLM recomputes until it is back",
                            self.what, exc)
            with contextlib.suppress(Exception):
                c.close()


@dataclass
class _ReqState:
    request: Any
    saved_upto: int = 0                       # blocks [0, saved_upto) need no save
    plan: tuple[int, list[bytes], list[int]] | None = None   # (first block, keys, tiers) of a hit
    pinned: list[bytes] = field(default_factory=list)


# ---------------------------------------------------------------------------- connector
class HpkvConnectorV1(KVConnectorBase_V1):
    if CacheHitSource is not None:
        _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.cfg = _hpkv_config()
        self.enabled = bool(self.cfg["VLLM_ENABLE_HPKV"])
        self.threshold = int(self.cfg["VLLM_HPKV_TOKEN_THRESHOLD"])
        self.block_size = vllm_config.cache_config.block_size
        self.layout: Layout | None = None
        self.ns_id: int | None = None
        # Worker-side state every step touches, also when hpkv is off.
        self._device = None
        self._load_errors: set[int] = set()
        self._stats = HpkvConnectorStats()
        if not self.enabled:
            log.warning("hpkv: VLLM_ENABLE_HPKV=0 (from %s): the connector does nothing",
                        self.cfg.source("VLLM_ENABLE_HPKV"))
            return
        try:
            self.layout = derive_layout(vllm_config, kv_cache_config)
        except NotImplementedError as exc:
            log.error("hpkv disabled: %s", exc)
            self.enabled = False
            return
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler(vllm_config)
        else:
            self._init_worker(vllm_config)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss, never an error

    # ======================================================================== scheduler
    def _init_scheduler(self, vllm_config: "VllmConfig") -> None:
        ktc = vllm_config.kv_transfer_config
        if ktc.kv_load_failure_policy != "recompute" and \
                not ktc.get_from_extra_config("hpkv_fail_on_load_error", False):
            # A cache miss must never fail a request: recompute what hpkv could not deliver.
            ktc.kv_load_failure_policy = "recompute"
            log.info("hpkv: kv_load_failure_policy set to 'recompute' (a failed hpkv load recomputes)")
        if str(vllm_config.cache_config.prefix_caching_hash_algo).startswith("xxhash") and \
                "PYTHONHASHSEED" not in os.environ:
            log.warning("hpkv: prefix_caching_hash_algo=%s without PYTHONHASHSEED gives block hashes "
                        "that change with every restart: storage hits will not survive restarts",
                        vllm_config.cache_config.prefix_caching_hash_algo)
        self._reqs: dict[str, _ReqState] = {}
        self._pending_loads: list[LoadOp] = []
        self._hit_tiers: dict[str, tuple[int, int]] = {}   # req -> (dram tokens, storage tokens)
        self._hpkv = _Reconnecting("scheduler", self._connect_scheduler)
        self._hpkv.connect_now(timeout=120.0)
        log.info("hpkv scheduler connector: namespace %s (%s), token threshold %d (%s)",
                 self.layout.fingerprint[:12], self.layout.name, self.threshold,
                 self.cfg.source("VLLM_HPKV_TOKEN_THRESHOLD"))

    def _connect_scheduler(self):
        from hpkv.engine.client import connect
        client = connect(self.cfg, name="vllm-scheduler", call_timeout=2.0)
        ns = client.attach_namespace(self.layout.fingerprint, self.layout.world_size,
                                     self.layout.shard_bytes, name=self.layout.name,
                                     block_tokens=self.block_size)
        self.ns_id = ns.ns_id
        return client

    def _client(self):
        return self._hpkv.get() if self.enabled else None

    def _keys(self, hashes) -> list[bytes]:
        from hpkv.engine.keys import block_keys
        return block_keys(self.layout.fingerprint, list(hashes))

    def on_new_request(self, request: "Request") -> None:
        if self.enabled:
            self._reqs[request.request_id] = _ReqState(request)

    def _state(self, request: "Request") -> _ReqState:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _ReqState(request)
        return st

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        client = self._client()
        if client is None:
            return 0, False
        st = self._state(request)
        st.plan = None
        first = num_computed_tokens // self.block_size
        # A synchronous hit must leave at least one token to compute.
        last = min(len(request.block_hashes), (request.num_tokens - 1) // self.block_size)
        if last <= first:
            return 0, False
        keys = self._keys(request.block_hashes[first:last])
        try:
            n, tiers = client.lookup(self.ns_id, keys)
        except Exception as exc:  # noqa: BLE001 - hpkv trouble means recompute
            self._hpkv.lost(exc)
            return 0, False
        if n == 0 or n * self.block_size < self.threshold:
            return 0, False
        st.plan = (first, keys[:n], tiers)
        return n * self.block_size, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        if not self.enabled:
            return
        st = self._state(request)
        plan, st.plan = st.plan, None
        if num_external_tokens == 0 or plan is None:
            return
        first, keys, tiers = plan
        n = num_external_tokens // self.block_size
        keys, tiers = keys[:n], tiers[:n]
        block_ids = blocks.get_block_ids()[0][first:first + n]
        client = self._client()
        offsets = np.full((n, self.layout.world_size), -1, np.int64)
        if client is not None:
            try:
                offsets = client.pin(self.ns_id, keys)
                st.pinned.extend(keys)
            except Exception as exc:  # noqa: BLE001 - the worker reports the blocks failed
                self._hpkv.lost(exc)
        self._pending_loads.append(LoadOp(request.request_id, keys, list(block_ids), offsets))
        dram = sum(1 for t in tiers if t == TIER_DRAM) * self.block_size
        self._hit_tiers[request.request_id] = (dram, num_external_tokens - dram)
        st.saved_upto = max(st.saved_upto, first + n)

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int):
        if CacheHitSource is None or num_external_tokens == 0:
            return {}
        dram, storage = self._hit_tiers.pop(request.request_id, (num_external_tokens, 0))
        out = {}
        if dram:
            out[CacheHitSource.HOST] = dram
        if storage:
            out[CacheHitSource.DISK] = storage
        return out

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = HpkvMetadata()
        if not self.enabled:
            return meta
        meta.loads, self._pending_loads = self._pending_loads, []
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            if rid in self._reqs:
                self._reqs[rid].saved_upto = 0   # its blocks were freed; new ones come on resume
        client = self._client()
        if client is None or self._kv_cache_manager is None:
            return meta
        computed: dict[str, int] = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for rid, n_sched in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(rid)
            if st is None:
                continue
            req = st.request
            full = min((computed.get(rid, req.num_computed_tokens) + n_sched) // self.block_size,
                       len(req.block_hashes))
            if full <= st.saved_upto:
                continue
            first = st.saved_upto
            keys = self._keys(req.block_hashes[first:full])
            try:
                offsets = client.reserve(self.ns_id, keys)
            except Exception as exc:  # noqa: BLE001
                self._hpkv.lost(exc)
                return meta
            st.saved_upto = full
            rows = np.flatnonzero((offsets >= 0).all(axis=1))
            if len(rows) == 0:
                continue
            block_ids = self._kv_cache_manager.get_block_ids(rid)[0]
            meta.saves.append(SaveOp(rid, [keys[i] for i in rows], [block_ids[first + i] for i in rows],
                                     offsets[rows]))
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict | None]:
        st = self._reqs.pop(request.request_id, None) if self.enabled else None
        self._hit_tiers.pop(request.request_id, None) if self.enabled else None
        if st is not None and st.pinned:
            client = self._client()
            if client is not None:
                try:
                    client.unpin(self.ns_id, st.pinned)
                except Exception as exc:  # noqa: BLE001
                    self._hpkv.lost(exc)
        return False, None   # saves were copied synchronously in wait_for_save

    def reset_cache(self) -> bool | None:
        """``/reset_prefix_cache?reset_external=true``: drop this namespace from the DRAM tier (files stay)."""
        client = self._client()
        if client is None:
            return not self.enabled
        try:
            dropped = client.clear(self.ns_id)
        except Exception as exc:  # noqa: BLE001
            self._hpkv.lost(exc)
            return False
        log.info("hpkv: reset_cache dropped %d blocks of namespace %s from the DRAM tier", dropped,
                 self.layout.fingerprint[:12])
        return True

    # ======================================================================== worker
    def _init_worker(self, vllm_config: "VllmConfig") -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        self.rank = get_tensor_model_parallel_rank() if self.layout.world_size > 1 else 0
        self._device_type = str(vllm_config.device_config.device_type)
        self._kv_file: str | None = None
        self._kv_mmap: mmap.mmap | None = None
        self._kv_base = 0
        self._device_spec: dict[str, Any] | None = None
        self._hpkv = _Reconnecting(f"worker rank {self.rank}", self._connect_worker)

    def get_mem_pool_context(self):
        """Allocate the KV cache in a shared-memory file the transfer worker maps (CPU backend)."""
        if not self.enabled or self._role != KVConnectorRole.WORKER or self._device_type != "cpu":
            return None
        return self._shared_kv_allocation()

    @contextlib.contextmanager
    def _shared_kv_allocation(self) -> Iterator[None]:
        # vLLM allocates the whole KV cache as one torch.zeros(int8) buffer inside this
        # context (vllm/v1/worker/utils.py: allocate_kv_cache). The CPU has no memory-pool
        # API, so for that one call we hand out a tensor backed by a file in the pool
        # directory, which the transfer worker maps too.
        real_zeros = torch.zeros
        connector = self

        def zeros(*size, dtype=None, device=None, **kwargs):
            if (connector._kv_file is None and dtype == torch.int8 and len(size) == 1
                    and isinstance(size[0], int) and (device is None or torch.device(device).type == "cpu")):
                t = connector._alloc_shared_kv(size[0])
                if t is not None:
                    return t
            return real_zeros(*size, dtype=dtype, device=device, **kwargs)

        torch.zeros = zeros
        try:
            yield
        finally:
            torch.zeros = real_zeros

    def _alloc_shared_kv(self, nbytes: int) -> torch.Tensor | None:
        from hpkv import shm
        from hpkv.engine.protocol import device_file_name
        pool_dir = self.cfg.pool_dir
        path = os.path.join(pool_dir, device_file_name(os.getpid(), self.rank))
        try:
            os.makedirs(pool_dir, mode=0o700, exist_ok=True)
            mm = shm.create(path, nbytes, exclusive=False)
        except OSError as exc:
            log.error("hpkv: cannot place the %d-byte KV cache in shared memory at %s (%s): hpkv is "
                      "disabled on this worker; free space in %s or lower --gpu-memory-utilization",
                      nbytes, path, exc.strerror, pool_dir)
            with contextlib.suppress(OSError):
                os.unlink(path)
            self.enabled = False
            return None
        self._kv_file, self._kv_mmap = path, mm
        t = torch.frombuffer(mm, dtype=torch.int8)
        self._kv_base = t.data_ptr()
        log.info("hpkv: KV cache of rank %d (%d bytes) placed in %s", self.rank, nbytes, path)
        return t

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not self.enabled:
            return
        if self._kv_file is None:
            log.error("hpkv: the KV cache was not allocated through hpkv's shared-memory context "
                      "(device %s): hpkv is disabled on this worker", self._device_type)
            self.enabled = False
            return
        try:
            self._device_spec = self._describe_kv(kv_caches)
        except ValueError as exc:
            log.error("hpkv disabled on this worker: %s", exc)
            self.enabled = False
            return
        self._hpkv.connect_now(timeout=120.0)

    def _describe_kv(self, kv_caches: dict[str, torch.Tensor]) -> dict[str, Any]:
        size = self._kv_mmap.size()
        seen: dict[int, torch.Tensor] = {}
        for t in kv_caches.values():
            seen.setdefault(t.data_ptr(), t)
        layers = sorted(seen.values(), key=lambda t: t.data_ptr())
        if len(layers) != self.layout.num_layers:
            raise ValueError(f"{len(layers)} KV cache tensors, the namespace expects {self.layout.num_layers}")
        bases, strides, pages = [], set(), set()
        for t in layers:
            elem = t.element_size()
            per_kernel_block = t[0].numel() * elem
            k = self.layout.page_bytes // per_kernel_block   # kernel blocks per vLLM block
            if k * per_kernel_block != self.layout.page_bytes or t.stride(0) * elem != per_kernel_block \
                    or not t[0].is_contiguous():
                raise ValueError(f"unsupported KV cache tensor layout: shape {tuple(t.shape)}, strides "
                                 f"{t.stride()}, page {self.layout.page_bytes} bytes")
            off = t.data_ptr() - self._kv_base
            if not 0 <= off < size:
                raise ValueError("a KV cache tensor lies outside hpkv's shared-memory allocation")
            bases.append((0, off))
            strides.add(k * per_kernel_block)
            pages.add(self.layout.page_bytes)
            num_blocks = t.shape[0] // k
        if len(strides) != 1:
            raise ValueError(f"KV cache layers have different block strides {sorted(strides)}")
        return dict(regions=[{"path": self._kv_file, "size": size}], layer_bases=bases,
                    block_stride=strides.pop(), page_bytes=pages.pop(), num_blocks=num_blocks)

    def _connect_worker(self):
        from hpkv.engine.client import connect
        client = connect(self.cfg, name=f"vllm-worker-r{self.rank}", call_timeout=5.0)
        try:
            ns = client.attach_namespace(self.layout.fingerprint, self.layout.world_size,
                                         self.layout.shard_bytes, name=self.layout.name, rank=self.rank,
                                         block_tokens=self.block_size)
            self.ns_id = ns.ns_id
            self._device = client.register_device(ns.ns_id, rank=self.rank, device="cpu",
                                                  numa_node=_current_numa_node(), **self._device_spec)
        except Exception:
            client.close()
            raise
        return client

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, HpkvMetadata) or not meta.loads:
            return
        blocks = [b for op in meta.loads for b in op.block_ids]
        # The scheduler promised these blocks; if this worker cannot deliver them (hpkv
        # disabled here, or unreachable), vLLM must recompute them, never read garbage.
        client = self._hpkv.get() if self.enabled and self._device is not None else None
        if client is None:
            self._fail_loads(blocks, "no hpkv server")
            return
        t0 = time.perf_counter()
        keys = [k for op in meta.loads for k in op.keys]
        offsets = np.concatenate([op.offsets[:, self.rank] for op in meta.loads])
        promoted: list[bytes] = []
        try:
            missing = np.flatnonzero(offsets < 0)
            if len(missing):
                promote = getattr(client, "promote", None)
                if promote is not None:
                    got = promote(self.ns_id, [keys[i] for i in missing])
                    # Promoted blocks come back pinned for us; failed rows (-1) are not.
                    promoted = [keys[i] for i, row in zip(missing, got) if (row >= 0).all()]
                    offsets[missing] = got[:, self.rank]
            ok = offsets >= 0
            dst = np.asarray(blocks, np.int64)
            if ok.any() and not self._device.load(dst[ok], offsets[ok]):
                ok[:] = False
        except Exception as exc:  # noqa: BLE001 - recompute
            self._hpkv.lost(exc)
            self._fail_loads(blocks, str(exc))
            return
        finally:
            if promoted and self._hpkv.client is not None:
                with contextlib.suppress(Exception):
                    client.unpin(self.ns_id, promoted)
        failed = [b for b, good in zip(blocks, ok) if not good]
        if failed:
            self._fail_loads(failed, "blocks missing or copy failed")
        n_ok = int(ok.sum())
        n_storage = sum(1 for i in missing if ok[i]) if len(missing) else 0
        s = self._stats.data
        s["loaded_tokens_dram"] += (n_ok - n_storage) * self.block_size
        s["loaded_tokens_storage"] += n_storage * self.block_size
        s["loaded_bytes"] += n_ok * self.layout.shard_bytes
        s["load_time_s"] += time.perf_counter() - t0

    def _fail_loads(self, block_ids: list[int], why: str) -> None:
        self._load_errors.update(block_ids)
        self._stats.data["load_failed_blocks"] += len(block_ids)
        log.warning("hpkv: %d block(s) could not be loaded (%s); vLLM recomputes them", len(block_ids), why)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # the KV of the whole step is copied in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if not self.enabled or not isinstance(meta, HpkvMetadata) or not meta.saves:
            return
        client = self._hpkv.get()
        if client is None or self._device is None:
            return
        keys = [k for op in meta.saves for k in op.keys]
        blocks = np.asarray([b for op in meta.saves for b in op.block_ids], np.int64)
        offsets = np.concatenate([op.offsets[:, self.rank] for op in meta.saves])
        t0 = time.perf_counter()
        try:
            # On the CPU the forward is synchronous: the step's KV is final here. We wait for
            # the copy, so vLLM may free or reuse these blocks as soon as we return.
            if self._device.save(blocks, offsets):
                client.commit(self.ns_id, keys, rank=self.rank)
                s = self._stats.data
                s["saved_tokens"] += len(keys) * self.block_size
                s["saved_bytes"] += len(keys) * self.layout.shard_bytes
            else:
                self._stats.data["save_failed_blocks"] += len(keys)
                client.abort(self.ns_id, keys)
        except Exception as exc:  # noqa: BLE001 - a lost save is a future miss
            self._stats.data["save_failed_blocks"] += len(keys)
            self._hpkv.lost(exc)
        self._stats.data["save_time_s"] += time.perf_counter() - t0

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if not self.enabled or self._role != KVConnectorRole.WORKER or self._stats.is_empty():
            return None
        stats, self._stats = self._stats, HpkvConnectorStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return HpkvConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if not self.enabled:
            return
        c = self._hpkv.client
        self._hpkv.client = None
        if c is not None:
            with contextlib.suppress(Exception):
                c.close()
        if self._role == KVConnectorRole.WORKER and self._kv_file:
            with contextlib.suppress(OSError):
                os.unlink(self._kv_file)   # the mapping stays valid while vLLM still uses it


def _current_numa_node() -> int:
    """The NUMA node of the CPUs this engine worker runs on (its transfer worker is placed there)."""
    cpus = sorted(os.sched_getaffinity(0))
    try:
        for entry in os.listdir(f"/sys/devices/system/cpu/cpu{cpus[0]}"):
            if entry.startswith("node") and entry[4:].isdigit():
                return int(entry[4:])
    except (OSError, IndexError):
        pass
    return 0

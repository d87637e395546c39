"""``HpkvConnectorV1``: hpkv as a vLLM V1 KV connector (vLLM 0.32 API).

Two instances run per engine, in different processes, and never share Python state: the
**scheduler** instance (EngineCore process, :mod:`.scheduler`) and one **worker** instance
per rank (:mod:`.worker`). This class is the facade vLLM sees; it builds the side its role
needs and delegates. Any failure (hpkv slow, dead or wrong) is reported as invalid blocks,
and vLLM recomputes them (the connector sets ``kv_load_failure_policy=recompute``).
Importing this module starts nothing: vLLM's API server imports it too.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from hpkv.client import connect, ensure_server
from hpkv.client.contract import KvStore
from hpkv.common.numa import current_numa_node
from hpkv.config import Config, ConfigError, load_config
from hpkv.connectors.vllm.events import INTERVAL_S, MAX_BLOCKS
from hpkv.connectors.vllm.groups import has_recurrent_state
from hpkv.connectors.vllm.layout import Layout, derive_layout
from hpkv.connectors.vllm.metadata import HpkvConnectorStats, HpkvMetadata
from hpkv.connectors.vllm.scheduler import SchedulerSide
from hpkv.connectors.vllm.worker import Opened, WorkerSide

try:  # vLLM >= 0.30
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - older vLLM
    CacheHitSource = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# A child of vLLM's logger, so our lines appear in vLLM's log with its format.
log = logging.getLogger("vllm.hpkv")


def _hpkv_config() -> Config:
    try:
        return load_config()
    except ConfigError as exc:
        raise ValueError(f"hpkv configuration error: {exc}") from None


def _model_kind(vllm_config: VllmConfig) -> str:
    """The model as an operator names it: its architecture and directory (or hub name)."""
    mc = vllm_config.model_config
    return f"{getattr(mc, 'architecture', '?')} ({os.path.basename(str(mc.model).rstrip('/'))})"


_early_start = threading.Lock()
_early_started = False
_early_hold: socket.socket | None = None  # referenced for the process's life: collected, it would close


def _start_server_early(cfg: Config) -> None:
    """Start the pool directory's server in the background, once per process, without attaching.

    The pool needs its memory before the first hit (first touches cost 2.5-4 s per GiB on a
    VM) and its workers a few seconds to start: the earlier, the less of it vLLM waits for.
    The process holds the server for its lifetime: its engine may compile for longer than
    the server's idle exit before its connectors attach, and a server that exits just as
    they connect costs them the pool's contents and a restart."""
    global _early_started
    with _early_start:
        if _early_started:
            return
        _early_started = True

    def run() -> None:
        global _early_hold
        try:
            _early_hold = ensure_server(cfg, hold="vllm early start")
        except Exception as exc:  # noqa: BLE001 - the connection at KV-cache registration reports it
            log.debug("hpkv: early server start failed (%s); retried at KV cache registration", exc)

    threading.Thread(target=run, name="hpkv-early-start", daemon=True).start()


class HpkvConnectorV1(KVConnectorBase_V1, SupportsHMA):
    """``SupportsHMA``: vLLM keeps its hybrid KV cache manager on with hpkv (a model with
    several KV cache groups gets per-group block ids in every hook, :mod:`.groups`)."""

    if CacheHitSource is not None:
        _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        self.cfg = _hpkv_config()
        self.enabled = bool(self.cfg["VLLM_ENABLE_HPKV"])
        self.threshold: int | None = self.cfg["VLLM_HPKV_TOKEN_THRESHOLD"]  # None: auto
        self.layout: Layout | None = None
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._orphan_load_errors: set[int] = set()
        self._orphan_loads: set[str] = set()  # background loads promised with no worker here
        self._orphan_failed: set[str] = set()
        self._idle_step = False
        # Saves complete after wait_for_save returns, so finished requests' blocks are freed
        # only once the workers report them (request_finished -> True, get_finished).
        self._saving: set[str] = set()
        if not self.enabled:
            log.warning(
                "hpkv: VLLM_ENABLE_HPKV=0 (from %s): the connector does nothing",
                self.cfg.source("VLLM_ENABLE_HPKV"),
            )
            return
        try:
            self.layout = derive_layout(vllm_config, kv_cache_config, self.cfg["HPKV_MODEL_ID"])
        except NotImplementedError as exc:
            # Both roles derive the same layout: the scheduler says why, once per engine.
            say = log.error if role == KVConnectorRole.SCHEDULER else log.debug
            say("hpkv disabled for %s: %s", _model_kind(vllm_config), exc)
            self.enabled = False
            return
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = self._init_scheduler(vllm_config, self.layout)
        else:
            self._worker = self._init_worker(vllm_config, self.layout)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """On CUDA, BLNHC: a block of all layers is one run, one DMA descriptor (HPKV_CUDA_BLOCK_OUTERMOST).

        vLLM's EngineCore asks this once, right after its workers loaded the model and
        before it profiles and compiles, 13-20 s before the connectors are built: the
        first moment hpkv's server can start without competing with vLLM for the CPU, so
        it is started here."""
        from hpkv.connectors.vllm.cuda_layout import REQUESTED_LAYOUT

        try:
            cfg = load_config()
        except ConfigError:
            return None  # the connector's constructor reports the configuration error
        if not cfg["VLLM_ENABLE_HPKV"]:
            return None
        if not has_recurrent_state(vllm_config):  # hpkv turns itself off for those
            _start_server_early(cfg)
        if str(vllm_config.device_config.device_type) != "cuda" or not cfg["HPKV_CUDA_BLOCK_OUTERMOST"]:
            return None
        return REQUESTED_LAYOUT

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss, never an error

    # ======================================================================== scheduler
    def _init_scheduler(self, vllm_config: VllmConfig, layout: Layout) -> SchedulerSide:
        ktc = vllm_config.kv_transfer_config
        if (
            ktc is not None
            and ktc.kv_load_failure_policy != "recompute"
            and not ktc.get_from_extra_config("hpkv_fail_on_load_error", False)
        ):
            # A cache miss must never fail a request: recompute what hpkv could not deliver.
            ktc.kv_load_failure_policy = "recompute"
            log.info("hpkv: kv_load_failure_policy set to 'recompute' (a failed hpkv load recomputes)")
        if (
            str(vllm_config.cache_config.prefix_caching_hash_algo).startswith("xxhash")
            and "PYTHONHASHSEED" not in os.environ
        ):
            log.warning(
                "hpkv: prefix_caching_hash_algo=%s without PYTHONHASHSEED gives block hashes "
                "that change with every restart: storage hits will not survive restarts",
                vllm_config.cache_config.prefix_caching_hash_algo,
            )

        def open_store() -> tuple[KvStore, int]:
            client = connect(self.cfg, name="vllm-scheduler", call_timeout=2.0)
            ns = client.attach_namespace(
                layout.fingerprint,
                layout.world_size,
                layout.shard_bytes,
                name=layout.name,
                block_tokens=layout.block_size,
            )
            return client, ns.ns_id

        # The CUDA path loads synchronously for now (its saves are the asynchronous part).
        cuda = str(vllm_config.device_config.device_type) == "cuda"
        side = SchedulerSide(
            layout,
            self.threshold,
            open_store,
            self._block_ids_of,
            background_storage_loads=bool(self.cfg["HPKV_ASYNC_STORAGE_LOADS"]) and not cuda,
            lookup_retry_s=float(self.cfg["HPKV_STORAGE_LOOKUP_RETRY_MS"]) / 1000.0,
            background_dram_loads=False if cuda else self.cfg["HPKV_ASYNC_DRAM_LOADS"],
        )
        side.hpkv.connect_now(timeout=120.0)
        kec = vllm_config.kv_events_config
        if kec is not None and kec.enable_kv_cache_events:
            extra = ktc.get_from_extra_config if ktc is not None else (lambda _k, d: d)
            side.enable_kv_events(
                interval_s=float(extra("hpkv_kv_events_interval_ms", INTERVAL_S * 1000)) / 1000.0,
                max_blocks=int(extra("hpkv_kv_events_max_blocks", MAX_BLOCKS)),
            )
            log.info("hpkv: publishing KV events of the DRAM pool (medium CPU) and storage (STORAGE)")
        log.info(
            "hpkv scheduler connector: namespace %s (%s), token threshold %s (%s)",
            layout.fingerprint[:12],
            layout.name,
            "auto (load where it beats recompute)" if self.threshold is None else self.threshold,
            self.cfg.source("VLLM_HPKV_TOKEN_THRESHOLD"),
        )
        return side

    def _block_ids_of(self, req_id: str) -> Sequence[Sequence[int]] | None:
        if self._kv_cache_manager is None:
            return None
        return self._kv_cache_manager.get_block_ids(req_id)

    def on_new_request(self, request: Request) -> None:
        if self._scheduler is not None:
            self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._scheduler is None:
            return 0, False
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self._scheduler is not None:
            block_ids = blocks.get_block_ids() if num_external_tokens else ()
            self._scheduler.update_state_after_alloc(request, block_ids, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        if CacheHitSource is None or num_external_tokens == 0 or self._scheduler is None:
            return {}
        dram, storage = self._scheduler.hit_tiers(request.request_id, num_external_tokens)
        out = {}
        if dram:
            out[CacheHitSource.HOST] = dram
        if storage:
            out[CacheHitSource.DISK] = storage
        return out

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._scheduler is None:
            return HpkvMetadata()
        meta = self._scheduler.build_connector_meta(scheduler_output)
        self._saving.update(op.req_id for op in meta.saves)
        meta.preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:
            stats = connector_output.kv_connector_stats
            self._scheduler.step_finished(stats.data if stats is not None else None)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict | None]:
        """vLLM calls this instead of ``request_finished`` (``SupportsHMA``), with every group's blocks."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        if self._scheduler is not None:
            self._scheduler.request_finished(request.request_id)
        if request.request_id in self._saving:  # saves may still read its blocks (SaveTracker)
            self._saving.discard(request.request_id)
            return True, None
        return False, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """hpkv's tier changes as vLLM KV events (``--kv-events-config``; :mod:`.events`)."""
        return self._scheduler.take_events() if self._scheduler is not None else ()

    def reset_cache(self) -> bool | None:
        """``/reset_prefix_cache?reset_external=true``: drop this namespace from the DRAM tier (files stay)."""
        if self._scheduler is None:
            return not self.enabled
        return self._scheduler.reset_cache()

    # ======================================================================== worker
    def _init_worker(self, vllm_config: VllmConfig, layout: Layout) -> WorkerSide:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        rank = get_tensor_model_parallel_rank() if layout.world_size > 1 else 0
        _start_server_early(self.cfg)  # usually running already (EngineCore, get_required_kvcache_layout)

        def open_store(device_spec: dict[str, Any]) -> Opened:
            client = connect(self.cfg, name=f"vllm-worker-r{rank}", call_timeout=5.0)
            try:
                ns = client.attach_namespace(
                    layout.fingerprint,
                    layout.world_size,
                    layout.shard_bytes,
                    name=layout.name,
                    rank=rank,
                    block_tokens=layout.block_size,
                )
                if device_spec.get("in_process"):  # CUDA without IPC: copies run in this process
                    return client, ns.ns_id, None  # type: ignore[return-value]
                spec = {"device": "cpu", "numa_node": current_numa_node(), **device_spec}  # CUDA: its own
                device = client.register_device(ns.ns_id, rank=rank, **spec)
            except Exception:
                client.close()
                raise
            return client, ns.ns_id, device

        def open_load_store() -> tuple[KvStore, int]:
            client = connect(self.cfg, name=f"vllm-worker-r{rank}-loads", call_timeout=5.0)
            try:
                ns = client.attach_namespace(
                    layout.fingerprint, layout.world_size, layout.shard_bytes, name=layout.name
                )
            except Exception:
                client.close()
                raise
            return client, ns.ns_id

        device_type = str(vllm_config.device_config.device_type)
        if device_type == "cuda":
            from hpkv.connectors.vllm.cuda_worker import CudaWorkerSide

            return CudaWorkerSide(
                layout, rank, self.cfg.pool_dir, open_store, kv_cache_config=self._kv_cache_config
            )
        worker = WorkerSide(layout, rank, self.cfg.pool_dir, device_type, open_store, open_load_store)
        # CPU only for now: on CUDA each part's copy takes an engine event and its own timeout
        # (one part there until that is measured on a GPU).
        worker.promote_part_bytes = int(self.cfg["HPKV_PROMOTE_PART_SIZE"])
        return worker

    def get_mem_pool_context(self) -> Any:
        if self._worker is None or self._role != KVConnectorRole.WORKER:
            return None
        return self._worker.mem_pool_context()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._worker is not None:
            self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        # vLLM runs a step without a forward pass (no attention metadata) just to poll
        # connectors while requests wait for their KV: get_finished may then wait briefly.
        self._idle_step = getattr(forward_context, "attn_metadata", None) is None
        meta = self._get_connector_metadata()
        if isinstance(meta, HpkvMetadata) and meta.loads:
            if self._worker is None:  # hpkv off here but a load promised: vLLM must recompute
                if self.layout is not None and len(self.layout.groups) > 1:
                    self._orphan_failed.update(op.req_id for op in meta.loads)  # by request: hybrid
                else:
                    self._orphan_load_errors.update(b for op in meta.loads for b in op.block_ids)
                self._orphan_loads.update(op.req_id for op in meta.loads if op.background)
                return
            self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before the forward

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # the KV of the whole step is copied in wait_for_save

    def wait_for_save(self) -> None:
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, HpkvMetadata):
            self._worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose saves completed: vLLM may free their blocks, requests whose
        background load ended)."""
        from hpkv.connectors.vllm.cuda_worker import CudaWorkerSide

        orphans, self._orphan_loads = self._orphan_loads, set()
        if self._worker is None:
            return None, orphans or None
        sending = self._worker.finished_saves(finished_req_ids, idle_step=self._idle_step)
        if isinstance(self._worker, CudaWorkerSide):
            return sending or None, orphans or None
        return sending or None, (
            self._worker.take_finished_loads(idle_step=self._idle_step) | orphans
        ) or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished`` plus the loads that failed, by request (hybrid models: vLLM cannot
        recompute their failed blocks by id)."""
        from hpkv.connectors.vllm.cuda_worker import CudaWorkerSide

        sending, recving = self.get_finished(finished_req_ids)
        done = set(recving or ())
        failed = self._orphan_failed & done
        self._orphan_failed -= failed
        if self._worker is not None and not isinstance(self._worker, CudaWorkerSide):
            failed |= self._worker.take_failed_loads(done)
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()), finished_recving=done, failed_recving=failed
        )

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        meta = kv_connector_metadata
        if self._worker is not None and isinstance(meta, HpkvMetadata) and meta.preempted:
            self._worker.handle_preemptions(meta.preempted)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._orphan_load_errors = self._orphan_load_errors, set()
        return errors | self._worker.take_load_errors() if self._worker is not None else errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._worker.take_stats() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return HpkvConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.shutdown()

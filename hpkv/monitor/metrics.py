"""Prometheus metrics of the hpkv server, read from the stats segment on each scrape.

:func:`start_metrics` is called once by the server. When ``HPKV_METRICS_PORT``
is set (0, the default, turns the endpoint off) it serves
``http://HPKV_METRICS_HOST:PORT/metrics`` from a daemon thread with one custom
collector, which maps the stats segment read-only and turns a snapshot of it
(and the ring headers) into metric families. Nothing is counted twice: the
figures are the segment's, the same ones ``hpkv status`` and ``hpkv-top`` show.

Names follow the Prometheus conventions: ``hpkv_`` prefix, the unit in the name
(``_bytes``, ``_seconds``), counters end in ``_total``. Per-namespace series carry
``namespace="<name>"`` (``tier`` for hits, blocks, bytes and the prefill time saved), per-worker series
``worker="<slot>", kind="transfer|io"``, ring series ``ring="<name>"``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from hpkv.config import Config
from hpkv.monitor.rings import peek_all
from hpkv.monitor.sample import ring_names
from hpkv.protocol.stats import REMOTE_COUNTER_HELP, STORAGE_HEALTH_COUNTERS, StatsSegment

if TYPE_CHECKING:
    from prometheus_client.core import Metric

log = logging.getLogger("hpkv.metrics")

WORKER_LABELS = ("worker", "kind")


def namespace_labels(namespaces: list[dict[str, Any]]) -> dict[int, str]:
    """ns id → its ``namespace`` label: the name, plus a fingerprint prefix where two share a name."""
    names = [n["name"] for n in namespaces]
    return {
        n["id"]: n["name"] if names.count(n["name"]) == 1 else f"{n['name']}@{n['fingerprint'][:8]}"
        for n in namespaces
    }


def _remote_families(rt: dict[str, Any] | None, gauge: Any, counter: Any) -> Iterator[Metric]:
    """The remote tier's families (``hpkv_remote_*``): its state and counters."""
    yield gauge("hpkv_remote_enabled", "1 when the remote tier (HPKV_REMOTE_BACKEND) is on.", 1 if rt else 0)
    if not rt:
        return
    yield gauge(
        "hpkv_remote_up",
        "1 while the remote store answers, 0 while its circuit breaker is open (down: not asked, "
        "blocks recomputed, re-probed every HPKV_REMOTE_PROBE_S).",
        0 if rt.get("down") else 1,
    )
    for key, _, text in REMOTE_COUNTER_HELP:
        yield (gauge if key == "blocks" else counter)(f"hpkv_remote_{key}", text, rt.get(key, 0))


def families(snap: dict[str, Any], rings: dict[str, Any]) -> Iterator[Metric]:
    """The metric families of one stats snapshot (``StatsSegment.snapshot()``) and ring levels."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    def gauge(
        name: str, doc: str, value: float | None = None, labels: tuple[str, ...] = ()
    ) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, value=value, labels=labels or None)

    def counter(
        name: str, doc: str, value: float | None = None, labels: tuple[str, ...] = ()
    ) -> CounterMetricFamily:
        return CounterMetricFamily(name, doc, value=value, labels=labels or None)

    srv, pool = snap["server"], snap["pool"]
    yield gauge(
        "hpkv_server_start_time_seconds",
        "Start time of the hpkv server (Unix time).",
        srv.get("start_time", 0.0),
    )
    yield gauge(
        "hpkv_server_heartbeat_age_seconds",
        "Seconds since the server's supervisor last beat.",
        srv.get("heartbeat_age_s", 0.0),
    )
    yield gauge("hpkv_pool_capacity_bytes", "Size of the shared-memory DRAM pool.", pool["capacity_bytes"])
    yield gauge("hpkv_pool_used_bytes", "Pool bytes held by blocks (ready or reserved).", pool["used_bytes"])
    yield gauge(
        "hpkv_pool_pinned_bytes",
        "Pool bytes of pinned blocks (being loaded; not evictable).",
        pool["pinned_bytes"],
    )
    yield gauge("hpkv_pool_blocks", "Blocks in the DRAM pool index.", pool["blocks"])
    yield gauge(
        "hpkv_engines_attached",
        "Inference-engine processes attached to the server.",
        len(snap.get("clients", [])),
    )
    yield counter(
        "hpkv_requests", "Hot-path requests answered (lookup, reserve, commit, pin, unpin).", snap["requests"]
    )
    yield counter("hpkv_request_errors", "Hot-path requests answered with an error.", snap["errors"])
    yield counter(
        "hpkv_server_worker_restarts",
        "Worker processes restarted after dying (all workers).",
        snap["worker_restarts"],
    )

    # ------------------------------------------------------------ namespaces
    labels = namespace_labels(snap.get("namespaces", []))
    ns_tier = ("namespace", "tier")
    blocks = gauge("hpkv_namespace_blocks", "Blocks present per tier.", labels=ns_tier)
    dram_bytes = gauge(
        "hpkv_namespace_dram_bytes", "Pool bytes of the namespace's ready blocks.", labels=("namespace",)
    )
    pinned = gauge("hpkv_namespace_pinned_blocks", "Pinned blocks.", labels=("namespace",))
    reserved = gauge(
        "hpkv_namespace_reserved_blocks",
        "Blocks reserved and not yet committed by every rank.",
        labels=("namespace",),
    )
    block_tokens = gauge("hpkv_namespace_block_tokens", "Tokens per block.", labels=("namespace",))
    hits = counter("hpkv_hit_blocks", "Blocks found by lookups, per tier.", labels=ns_tier)
    hit_tokens = counter(
        "hpkv_hit_tokens", "Tokens found by lookups (blocks x tokens per block), per tier.", labels=ns_tier
    )
    lookups = counter("hpkv_lookups", "Lookups.", labels=("namespace",))
    misses = counter("hpkv_lookup_misses", "Lookups that stopped at a missing block.", labels=("namespace",))
    evictions = counter("hpkv_evicted_blocks", "Blocks evicted from the DRAM pool.", labels=("namespace",))
    commits = counter(
        "hpkv_committed_blocks", "Blocks that became ready (every rank committed).", labels=("namespace",)
    )
    rsv_failed = counter(
        "hpkv_reserve_failures",
        "Reservations refused: the pool was full of unevictable blocks.",
        labels=("namespace",),
    )
    tier_bytes = gauge(
        "hpkv_namespace_bytes", "Bytes held per tier (storage: every rank's KV file).", labels=ns_tier
    )
    loaded_tokens = counter(
        "hpkv_loaded_tokens", "Tokens the engines loaded instead of computing them, per tier.", labels=ns_tier
    )
    prefill_saved = counter(
        "hpkv_prefill_saved_seconds",
        "Prefill time the loaded tokens would have cost at the engine's measured prefill rate, per tier.",
        labels=ns_tier,
    )
    load_seconds = counter(
        "hpkv_load_seconds",
        "Time the engines' loads took, per tier (time saved = prefill saved - load).",
        labels=ns_tier,
    )
    for n in snap.get("namespaces", []):
        name = labels[n["id"]]
        tokens = int(n.get("block_tokens") or 0)
        blocks.add_metric([name, "dram"], n["blocks_dram"])
        blocks.add_metric([name, "storage"], n["blocks_storage"])
        dram_bytes.add_metric([name], n["bytes_dram"])
        pinned.add_metric([name], n["blocks_pinned"])
        reserved.add_metric([name], n["blocks_reserved"])
        block_tokens.add_metric([name], tokens)
        for tier in ("dram", "storage"):
            hits.add_metric([name, tier], n[f"hits_{tier}"])
            hit_tokens.add_metric([name, tier], n[f"hits_{tier}"] * tokens)
            t = (n.get("tiers") or {}).get(tier)
            if t:  # a server before the time-saved counters has no "tiers"
                tier_bytes.add_metric([name, tier], t["bytes"])
                loaded_tokens.add_metric([name, tier], t["loaded_tokens"])
                prefill_saved.add_metric([name, tier], t["prefill_saved_s"])
                load_seconds.add_metric([name, tier], t["load_s"])
        lookups.add_metric([name], n["lookups"])
        misses.add_metric([name], n["misses"])
        evictions.add_metric([name], n["evictions"])
        commits.add_metric([name], n["commits"])
        rsv_failed.add_metric([name], n["reserve_failed"])
    yield from (
        blocks,
        dram_bytes,
        pinned,
        reserved,
        block_tokens,
        hits,
        hit_tokens,
        lookups,
        misses,
        evictions,
        commits,
        rsv_failed,
        tier_bytes,
        loaded_tokens,
        prefill_saved,
        load_seconds,
    )

    # ------------------------------------------------------------ workers
    info = gauge(
        "hpkv_worker_info",
        "A worker process (value 1); its pid, device, NUMA node and state.",
        labels=WORKER_LABELS + ("pid", "device", "numa_node", "state"),
    )
    up = gauge("hpkv_worker_up", "1 while the worker process is running.", labels=WORKER_LABELS)
    inflight = gauge(
        "hpkv_worker_inflight_jobs",
        "Job batches being executed or queued in the worker's ring.",
        labels=WORKER_LABELS,
    )
    hb_age = gauge(
        "hpkv_worker_heartbeat_age_seconds", "Seconds since the worker last beat.", labels=WORKER_LABELS
    )
    jobs = counter("hpkv_worker_jobs", "Job batches executed.", labels=WORKER_LABELS)
    failed = counter("hpkv_worker_failed_jobs", "Job batches that failed.", labels=WORKER_LABELS)
    saved = counter(
        "hpkv_worker_saved_bytes",
        "Bytes written: device to pool (transfer workers), pool to file (io workers).",
        labels=WORKER_LABELS,
    )
    loaded = counter(
        "hpkv_worker_loaded_bytes",
        "Bytes read: pool to device (transfer workers), file to pool (io workers).",
        labels=WORKER_LABELS,
    )
    busy = counter("hpkv_worker_busy_seconds", "Time spent executing jobs.", labels=WORKER_LABELS)
    restarts = counter(
        "hpkv_worker_restarts", "Times this worker was restarted after dying.", labels=WORKER_LABELS
    )
    now_ns = time.time_ns()
    for w in snap.get("workers", []):
        lab = [str(w["slot"]), w.get("kind", "")]
        node = w.get("numa_node")
        info.add_metric(
            lab
            + [
                str(w.get("pid", 0)),
                str(w.get("device", "")),
                "" if node is None else str(node),
                w.get("state", ""),
            ],
            1,
        )
        up.add_metric(lab, 1 if w.get("state") == "running" else 0)
        queue = rings.get((w.get("rings") or [None])[0])
        inflight.add_metric(lab, (1 if w.get("inflight_seq") else 0) + (queue.depth if queue else 0))
        if w.get("heartbeat_ns"):
            hb_age.add_metric(lab, max(0.0, (now_ns - w["heartbeat_ns"]) / 1e9))
        jobs.add_metric(lab, w.get("jobs", 0))
        failed.add_metric(lab, w.get("jobs_failed", 0))
        saved.add_metric(lab, w.get("bytes_saved", 0))
        loaded.add_metric(lab, w.get("bytes_loaded", 0))
        busy.add_metric(lab, w.get("busy_ns", 0) / 1e9)
        restarts.add_metric(lab, w.get("restarts", 0))
    yield from (info, up, inflight, hb_age, jobs, failed, saved, loaded, busy, restarts)

    # ------------------------------------------------------------ storage
    st = snap.get("storage")
    enabled = bool(st and st.get("path")) or bool(srv.get("storage"))
    yield gauge("hpkv_storage_enabled", "1 when the storage tier (KV files) is on.", 1 if enabled else 0)
    if st and enabled:
        yield gauge("hpkv_storage_files", "KV files in the storage directory.", st.get("files", 0))
        yield gauge("hpkv_storage_bytes", "Bytes of KV files in the storage directory.", st.get("bytes", 0))
        yield gauge(
            "hpkv_storage_capacity_bytes",
            "Storage tier capacity (HPKV_KV_STORAGE_SIZE; 0 = no limit).",
            st.get("capacity_bytes", 0),
        )
        yield gauge(
            "hpkv_storage_free_bytes", "Free space of the storage file system.", st.get("free_bytes", 0)
        )
        yield gauge(
            "hpkv_storage_o_direct",
            "1 when KV files are read and written with O_DIRECT.",
            1 if st.get("o_direct") else 0,
        )
        yield gauge(
            "hpkv_storage_spill_paused",
            "1 while spilling is paused for lack of free space.",
            1 if st.get("spill_paused") else 0,
        )
        yield counter("hpkv_storage_io_errors", "KV file read/write errors.", st.get("io_errors", 0))
        yield counter(
            "hpkv_storage_quarantined_files",
            "KV files quarantined (bad header or checksum).",
            st.get("quarantined", 0),
        )
        yield counter("hpkv_storage_written_bytes", "Bytes written to KV files.", st.get("bytes_written", 0))
        yield counter("hpkv_storage_read_bytes", "Bytes read from KV files.", st.get("bytes_read", 0))
        yield counter("hpkv_storage_spills", "Blocks spilled from the pool to KV files.", st.get("spills", 0))
        yield counter(
            "hpkv_storage_promotes", "Blocks promoted from KV files into the pool.", st.get("promotes", 0)
        )
        yield counter(
            "hpkv_storage_evicted_files",
            "KV files evicted to stay under the capacity.",
            st.get("evicted_files", 0),
        )
        yield gauge(
            "hpkv_storage_spills_pending",
            "Spill jobs queued or running: write-through not yet on storage.",
            st.get("spills_pending", 0),
        )
        yield gauge(
            "hpkv_storage_degraded",
            "1 while the storage file system answers late or not at all (a hung or slow mount): "
            "storage blocks are misses, DRAM serves; recovers by itself.",
            1 if st.get("state") == "degraded" else 0,
        )
        for key, _, text in STORAGE_HEALTH_COUNTERS:
            yield counter(f"hpkv_storage_{key}", text, st.get(key, 0))

    yield from _remote_families((st or {}).get("remote"), gauge, counter)

    # ------------------------------------------------------------ rings
    depth = gauge("hpkv_ring_depth", "Descriptors queued in the ring.", labels=("ring",))
    capacity = gauge("hpkv_ring_capacity", "Descriptor slots of the ring.", labels=("ring",))
    for name, level in rings.items():
        if level is not None:
            depth.add_metric([name], level.depth)
            capacity.add_metric([name], level.capacity)
    yield from (depth, capacity)


class StatsCollector:
    """A prometheus_client collector over the stats segment of one pool directory."""

    def __init__(self, directory: str):
        self.dir = directory
        self._seg: StatsSegment | None = None
        self._attach_lock = threading.Lock()  # scrapes run in the HTTP server's threads, maybe two at once

    def collect(self) -> Iterator[Metric]:

        with self._attach_lock:
            if self._seg is None:
                # Our own read-only mapping: it outlives the server's object during shutdown.
                self._seg = StatsSegment.attach(self.dir)
        snap = self._seg.snapshot()
        yield from families(snap, peek_all(self.dir, ring_names(snap)))


def start_metrics(cfg: Config) -> Any:
    """Serve the metrics endpoint if ``HPKV_METRICS_PORT`` is set; returns the HTTP server or None.

    Never raises for a port in use or a missing package: the endpoint is an
    observer, and the server runs on without it (the log says why).
    """
    port, host = cfg["HPKV_METRICS_PORT"], cfg["HPKV_METRICS_HOST"]
    if not port:
        return None
    where = (
        f"HPKV_METRICS_PORT={port} (from {cfg.source('HPKV_METRICS_PORT')}), "
        f"HPKV_METRICS_HOST={host} (from {cfg.source('HPKV_METRICS_HOST')})"
    )
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError as exc:
        log.error(
            "metrics endpoint off: prometheus_client is not installed (%s); %s. "
            "Install it (pip install 'prometheus_client>=0.17') or set HPKV_METRICS_PORT=0.",
            exc,
            where,
        )
        return None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(cfg.pool_dir))
    try:
        started = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        log.error(
            "metrics endpoint off: cannot listen on %s port %d: %s; %s. The hpkv server runs on "
            "without it: free the port or set HPKV_METRICS_PORT to a free one (0 turns it off).",
            host,
            port,
            exc.strerror or exc,
            where,
        )
        return None
    log.info("Prometheus metrics on http://%s:%d/metrics", f"[{host}]" if ":" in host else host, port)
    return started[0] if isinstance(started, tuple) else started

"""``hpkv status``: reads the stats segment, no RPC needed."""

from __future__ import annotations

import json
import sys
import time

from hpkv.common.numa import format_cpulist
from hpkv.config import Config, format_size
from hpkv.protocol.stats import REMOTE_COUNTER_HELP, STORAGE_HEALTH_COUNTERS, StatsSegment, StatsVersionError
from hpkv.protocol.wire import live_server_pid


def server_pid(cfg: Config) -> int | None:
    """The pid of the live server of this pool directory, if any."""
    return live_server_pid(cfg.pool_dir)


def read_snapshot(cfg: Config) -> dict | None:
    """The server's counters; None while no server (or one still starting) has published
    them. Raises :class:`StatsVersionError` for a server of another hpkv version."""
    if server_pid(cfg) is None:
        return None
    try:
        seg = StatsSegment.attach(cfg.pool_dir)
    except StatsVersionError:
        raise
    except FileNotFoundError:
        return None
    try:
        return seg.snapshot()
    finally:
        seg.close()


def _storage_state(st: dict) -> str:
    """The storage tier's state after its path: nothing when all is well and nothing went."""
    out = ""
    if st.get("state") == "degraded":
        since = st.get("degraded_since")
        when = time.strftime(" since %H:%M:%S", time.localtime(since)) if since else ""
        out += f"  DEGRADED{when}: {st.get('degraded_reason') or 'the file system answers late'}"
    shown = [f"{label} {st[k]}" for k, label, _ in STORAGE_HEALTH_COUNTERS if st.get(k)]
    if shown:
        out += "\n          " + "  ".join(shown)
    return out


def remote_summary(rt: dict) -> tuple[str, list[str]]:
    """The remote tier's state (UP, or DOWN with since when and why) and its counters, each
    "label value" (``hpkv status`` and hpkv-top show the same)."""
    state = f"{rt.get('master') or ''}  UP"
    if rt.get("down"):
        since = rt.get("down_since")
        when = time.strftime(" since %H:%M:%S", time.localtime(since)) if since else ""
        state = f"{rt.get('master') or ''}  DOWN{when}: {rt.get('down_reason') or 'the store failed'}"
    if rt.get("tier_order") and rt.get("write_policy"):  # (from a server that says them)
        state += f"  (order dram,{rt['tier_order']}; publish on {rt['write_policy']})"
    shown = []
    for key, label, _ in REMOTE_COUNTER_HELP:
        v = rt.get(key, 0)
        shown.append(f"{label} {format_size(v)}" if key.startswith("bytes_") else f"{label} {v}")
    return state, shown


def _tier_table(namespaces: list[dict]) -> list[str]:
    """Per namespace and tier: what it holds there, and the prefill time its loads from there
    saved (TIME SAVED = PREFILL SAVED - LOAD TIME: see hpkv.protocol.stats._tiers)."""
    lines = [
        "NAMESPACE            FINGERPRINT   TIER       BLOCKS       BYTES  LOADED TOKENS"
        "  PREFILL SAVED  LOAD TIME  TIME SAVED"
    ]
    for ns in namespaces:
        for i, (tier, t) in enumerate((ns.get("tiers") or {}).items()):
            who = f"{ns['name'][:20]:20} {ns['fingerprint'][:12]:12}" if i == 0 else " " * 33
            lines.append(
                f"{who}  {tier:8} {t['blocks']:8}  {format_size(t['bytes']):>10}  {t['loaded_tokens']:13}"
                f"  {t['prefill_saved_s']:12.3f}s  {t['load_s']:8.3f}s  {t['time_saved_s']:9.3f}s"
            )
    return lines


def _remote_lines(rt: dict | None) -> list[str]:
    if not rt:
        return []
    state, counters = remote_summary(rt)
    return [f"remote    {state}", "          " + "  ".join(counters)]


def format_status(s: dict) -> str:
    p = s["pool"]
    lines = [
        f"hpkv server pid {s['server']['pid']}  pool dir {s['server'].get('pool_dir')}",
        f"pool      {format_size(p['used_bytes'])} used / {format_size(p['capacity_bytes'])}"
        f"  pinned {format_size(p['pinned_bytes'])}  blocks {p['blocks']}",
        f"storage   {s['server'].get('storage') or 'disabled'}{_storage_state(s.get('storage') or {})}",
        *_remote_lines((s.get("storage") or {}).get("remote")),
        f"requests  {s['requests']}  errors {s['errors']}  worker restarts {s['worker_restarts']}",
        "",
        "NAMESPACE            RANKS  DRAM BLOCKS  PINNED  OPERATOR PINNED  HITS DRAM  HITS STORAGE  MISSES"
        "  EVICTIONS",
    ]
    # the remote store's hits, where a namespace has any there (HITS STORAGE: the files')
    remote = any(ns.get("blocks_remote") or ns.get("hits_remote") for ns in s["namespaces"])
    if remote:
        lines[-1] += "  HITS REMOTE"
    for ns in s["namespaces"]:
        # OPERATOR PINNED: bytes `hpkv pin` holds in DRAM (counted in PINNED's blocks too)
        op_pinned = format_size(ns.get("bytes_pinned_operator", 0))
        lines.append(
            f"{ns['name'][:20]:20} {ns['world_size']:5}  {ns['blocks_dram']:11}  {ns['blocks_pinned']:6}"
            f"  {op_pinned:>15}  {ns['hits_dram']:9}  {ns['hits_storage']:12}  {ns['misses']:6}  {ns['evictions']:9}"
            + (f"  {ns.get('hits_remote', 0):11}" if remote else "")
        )
    lines += ["", *_tier_table(s["namespaces"])]
    lines += ["", "WORKER  KIND      PID      DEVICE  NODE  CPUS    STATE     JOBS  FAILED  RESTARTS  HANGS"]
    for w in s["workers"]:
        cpus = format_cpulist(w["cpus"])
        lines.append(
            f"{w['slot']:6}  {w['kind']:8}  {w['pid']:7}  {w['device']:6}  {w['numa_node']!s:4}  {cpus[:6]:6}"
            f"  {w['state']:8}  {w['jobs']:4}  {w['jobs_failed']:6}  {w['restarts']:8}  {w.get('hangs', 0):5}"
        )
    lines += ["", "CLIENT  PID      NAME"]
    for c in s["clients"]:
        lines.append(f"{c['id']:6}  {c['pid']:7}  {c['name']}")
    if s.get("clients_omitted"):
        lines.append(f"        ... and {s['clients_omitted']} more")
    if s.get("holds"):
        lines += ["", "HELD BY (engine processes that started the server early: no idle exit while they run)"]
        lines += [f"        {h['pid']:7}  {h['name']}" for h in s["holds"]]
        if s.get("holds_omitted"):
            lines.append(f"        ... and {s['holds_omitted']} more")
    return "\n".join(lines)


def print_status(cfg: Config, as_json: bool = False) -> int:
    pid = server_pid(cfg)
    try:
        snap = read_snapshot(cfg) if pid is not None else None
    except StatsVersionError as exc:
        print(f"hpkv: server {pid} runs, but {exc}", file=sys.stderr)
        return 1
    if snap is None:
        if pid is not None:  # holds the lock but has no stats segment yet (or no more)
            print(
                f"hpkv: server {pid} holds the pool directory {cfg.pool_dir} but is starting or "
                "stopping (no stats yet); try again in a moment",
                file=sys.stderr,
            )
            return 1
        print(f"hpkv: no server is running for the pool directory {cfg.pool_dir}", file=sys.stderr)
        return 1
    print(json.dumps(snap, indent=2) if as_json else format_status(snap))
    return 0
